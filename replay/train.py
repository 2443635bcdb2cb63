"""Train tiny-16 on the Python standard library's sources (byte tokens), through replay/dense.py.

    python -m replay.train --out runs/tiny16 [--data DIR] [--steps N] [--batch B] [--device cuda]

The model is exactly replay/model.py's (its FP4 main / FP4 indexer / FP8 SWA caches fake-quantized in the
forward pass, straight-through gradients). Loss: next-byte cross-entropy over each sequence's decoder span
(decoder_from sampled per sequence, so training sees the truncated decoder windows that prefill creates)
plus the indexer's KL term (replay/dense.py). Data: ``replay.corpus`` split by file; ``--data DIR`` reads
the train.bin / heldout.bin that ``python -m replay.corpus DIR`` wrote (so a machine with another Python
trains on the same bytes). Writes DIR/log.jsonl (one line per logged step), DIR/tiny16.safetensors (bf16,
rewritten every ``save_every`` steps) and DIR/eval.json (held-out bits per byte, with and without globals).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor

from replay import dense
from replay.corpus import split_bytes
from replay.model import ModelArgs, Transformer

SLICE_WINDOWS = 2  # held-out windows the CPU test scores


@dataclass(frozen=True)
class TrainConfig:
    model: str = "tiny-16"
    seq_len: int = 2048
    batch: int = 32
    steps: int = 2000
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    index_kl_weight: float = 1.0
    full_decoder_frac: float = 0.5  # sequences whose decoder runs from position 0; the rest start it at random
    min_decoder_span: int = 256
    seed: int = 0
    log_every: int = 10
    save_every: int = 250
    eval_windows: int = 64  # held-out windows of seq_len for the final evaluation (0 = all)
    max_minutes: float = 0.0  # stop early (and save) after this long; 0 = no limit
    stop_at: int = 0  # stop after this many steps, on the schedule of ``steps`` (0 = run them all)
    exclude_in_window: bool = False  # ModelArgs.exclude_in_window (the A/B of benchmarks/fidelity/bench_overlap.py)


def model_args(cfg: TrainConfig) -> ModelArgs:
    return {"tiny-16": ModelArgs.tiny16, "tiny-8": ModelArgs.tiny8}[cfg.model](exclude_in_window=cfg.exclude_in_window)


def new_model(cfg: TrainConfig, device: torch.device) -> Transformer:
    """model.py's seeded init, with the residual-branch outputs (wo, w2) scaled by 1/sqrt(2 L)."""
    model = Transformer(model_args(cfg), seed=cfg.seed)
    with torch.no_grad():
        for layer in model.layers:
            for w in (layer.attention.wo.weight, layer.feed_forward.w2.weight):
                w.mul_((2 * model.args.n_layers) ** -0.5)
    return model.to(device)


def sample_batch(data: Tensor, cfg: TrainConfig, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """(tokens [B, T + 1] at random offsets, decoder_from [B])."""
    off = torch.randint(0, data.numel() - cfg.seq_len - 1, (cfg.batch,), generator=gen)
    toks = torch.stack([data[o : o + cfg.seq_len + 1] for o in off.tolist()]).long()
    dfrom = torch.randint(0, cfg.seq_len - cfg.min_decoder_span + 1, (cfg.batch,), generator=gen)
    full = torch.rand(cfg.batch, generator=gen) < cfg.full_decoder_frac
    return toks, dfrom.masked_fill(full, 0)


def lm_loss(logits: Tensor, targets: Tensor, dfrom: Tensor) -> Tensor:
    """Mean next-token cross-entropy (nats) over each sequence's decoder span. logits: [B, T, V]."""
    rows = torch.arange(targets.shape[1], device=targets.device)[None] >= dfrom[:, None]
    return F.cross_entropy(logits[rows], targets[rows])


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def bits_per_byte(model: Transformer, data: Tensor, seq_len: int, windows: int, batch: int = 8,
                  use_global: bool = True, bf16: bool = True) -> float:
    """Held-out bits per byte: the first ``windows`` non-overlapping windows of ``data``, teacher-forced with
    the decoder over the whole window (decoder_from = 0), every position scored."""
    n = (data.numel() - 1) // seq_len
    windows = n if windows <= 0 else min(windows, n)
    if windows < 1:
        raise ValueError(f"need at least {seq_len + 1} bytes of held-out data, got {data.numel()}")
    total, count = 0.0, 0
    dev = model.device
    for w0 in range(0, windows, batch):
        toks = torch.stack([data[i * seq_len : i * seq_len + seq_len + 1] for i in range(w0, min(windows, w0 + batch))])
        toks = toks.long().to(dev)
        with _autocast(dev, bf16):
            logits = dense.forward(model, toks[:, :-1], use_global=use_global).logits
        total += float(F.cross_entropy(logits.flatten(0, 1), toks[:, 1:].flatten(), reduction="sum"))
        count += toks[:, 1:].numel()
    return total / count / math.log(2)


def _autocast(dev: torch.device, enabled: bool = True) -> torch.autocast:
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=enabled and dev.type == "cuda")


def save_bf16(model: Transformer, path: Path, meta: dict[str, str]) -> None:
    """The checkpoint: every tensor in bf16, model.py's ``model_args`` metadata (load_checkpoint reads it)."""
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(path), metadata={"model_args": json.dumps(asdict(model.args)), **meta})


def bf16_rounded(model: Transformer) -> Transformer:
    """A float32 copy holding exactly the checkpoint's (bf16-rounded) weights."""
    copy = Transformer(model.args, device=model.device)
    copy.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    return copy


@torch.enable_grad()  # whatever the caller left autograd at
def train(cfg: TrainConfig, train_data: Tensor, heldout: Tensor, out: Path, device: torch.device) -> dict[str, float]:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model = new_model(cfg, device)
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(cfg.seed)
    ckpt, log = out / f"{cfg.model.replace('-', '')}.safetensors", (out / "log.jsonl").open("w")
    t0, tokens_seen, step = time.perf_counter(), 0, 0
    meta = {"train_config": json.dumps(asdict(cfg))}
    for step in range(cfg.steps):
        toks, dfrom = sample_batch(train_data, cfg, gen)
        toks, dfrom = toks.to(device, non_blocking=True), dfrom.to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        with _autocast(device):
            res = dense.forward(model, toks[:, :-1], dfrom, with_index_kl=cfg.index_kl_weight > 0)
        loss = lm_loss(res.logits, toks[:, 1:], dfrom)
        (loss + cfg.index_kl_weight * res.index_kl).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens_seen += int((cfg.seq_len - dfrom).sum())
        elapsed = time.perf_counter() - t0
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            rec = {"step": step, "loss": loss.item(), "bpb": loss.item() / math.log(2),
                   "index_kl": res.index_kl.item(), "grad_norm": norm.item(), "lr": lr_at(step, cfg),
                   "tokens": tokens_seen, "seconds": round(elapsed, 1)}
            if device.type == "cuda":
                rec["max_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(json.dumps(rec), flush=True)
        if (step + 1) % cfg.save_every == 0:
            save_bf16(model, ckpt, {**meta, "steps": str(step + 1), "tokens_seen": str(tokens_seen)})
        if cfg.stop_at and step + 1 >= cfg.stop_at:
            break
        if cfg.max_minutes and elapsed > cfg.max_minutes * 60:
            print(f"stopping at step {step + 1}: {cfg.max_minutes} minutes", flush=True)
            break
    steps_done = step + 1
    wall = time.perf_counter() - t0
    save_bf16(model, ckpt, {**meta, "steps": str(steps_done), "tokens_seen": str(tokens_seen)})
    model = bf16_rounded(model).eval()
    result = {"steps": steps_done, "tokens_seen": tokens_seen, "train_seconds": round(wall, 1),
              "heldout_bpb": bits_per_byte(model, heldout, cfg.seq_len, cfg.eval_windows),
              "heldout_bpb_swa_only": bits_per_byte(model, heldout, cfg.seq_len, cfg.eval_windows, use_global=False),
              "eval_windows": cfg.eval_windows, "seq_len": cfg.seq_len,
              # what tests/replay/test_train.py recomputes on CPU: float32, the first SLICE_WINDOWS windows
              "slice_bpb_fp32": bits_per_byte(model, heldout, cfg.seq_len, SLICE_WINDOWS, bf16=False),
              "slice_windows": SLICE_WINDOWS}
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return result


def load_split(data_dir: str | None, split: str) -> Tensor:
    raw = (Path(data_dir) / f"{split}.bin").read_bytes() if data_dir else split_bytes(split)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", help="a directory with train.bin and heldout.bin (default: this Python's stdlib)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for f in fields(TrainConfig):
        if isinstance(f.default, bool):
            ap.add_argument("--" + f.name.replace("_", "-"), action="store_true")
        else:
            ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args = ap.parse_args()
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    torch.backends.cuda.matmul.allow_tf32 = False
    train(cfg, load_split(args.data, "train"), load_split(args.data, "heldout"), Path(args.out),
          torch.device(args.device))


if __name__ == "__main__":
    main()
