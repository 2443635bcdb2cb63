"""A/B: global entries inside the query's own SWA window, kept (the spec's rule) or excluded from the indexer's
candidates (``ModelArgs.exclude_in_window``; docs/MODEL.md).

    python benchmarks/bench_overlap.py --data .corpus --out DIR --device cuda --steps 400 --budget-s 520

Trains tiny-16 twice from the same seed on the same batches with the same schedule (``replay.train``), once per
rule; then for each model: held-out bits per byte on the first --eval-windows windows of 2,048 (bf16, as the
card), the same with every global entry masked (the SWA-only ablation), and bounded-replay fidelity at R = 128 and
R = 256 against the never-evicted session on --sessions x 4 held-out resumes of --history-token histories
(``bench_fidelity.one_resume``: the stretches and resume-point kinds of the checkpoint's calibration). Resumes
alternate between the two models, so a run cut short by the time budget still compares them on the same resumes.
Writes DIR/overlap.json after every stage and DIR/log_keep.jsonl, DIR/log_exclude.jsonl (the loss curves).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_fidelity import KINDS, one_resume, pooled
from benchmarks.common import machine
from replay.fidelity import Fidelity
from replay.model import Transformer
from replay.train import TrainConfig, load_split, train

VARIANTS = {"keep": False, "exclude": True}  # name -> exclude_in_window
REPLAYS = (128, 256)
CALIBRATION_SPAN = 32768 + max(KINDS) + 256  # bench_fidelity's stretches (its longest history), as calibrated


def fidelity_rows(per: dict[str, list[Fidelity]]) -> dict[str, dict[str, float]]:
    return {k: pooled(v).__dict__ for k, v in per.items() if v}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", help="train.bin / heldout.bin from `python -m replay.corpus DIR`")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="tiny-16")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--eval-windows", type=int, default=128)
    ap.add_argument("--history", type=int, default=4096)
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--fidelity-steps", type=int, default=256)
    ap.add_argument("--budget-s", type=float, default=520.0, help="wall time for everything; training gets "
                    "--train-share of it, split between the variants")
    ap.add_argument("--train-share", type=float, default=0.75)
    args = ap.parse_args()
    t0, out, dev = time.perf_counter(), Path(args.out), torch.device(args.device)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    train_data, held = load_split(args.data, "train"), load_split(args.data, "heldout")
    result: dict[str, Any] = {"machine": machine(), "device": str(dev), "args": vars(args),
                              "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else None, "variants": {}}

    def save(stage: str) -> None:
        result["stage"], result["wall_s"] = stage, round(time.perf_counter() - t0, 1)
        (out / "overlap.json").write_text(json.dumps(result, indent=1))
        print(f"[{result['wall_s']:.0f} s] {stage}", flush=True)

    cfg = TrainConfig(model=args.model, seq_len=args.seq_len, batch=args.batch, steps=args.steps, lr=args.lr,
                      warmup=args.warmup, log_every=10, save_every=10**9, eval_windows=args.eval_windows,
                      max_minutes=args.budget_s * args.train_share / len(VARIANTS) / 60)
    runs = Path("/tmp/bench_overlap") if dev.type == "cuda" else out / "runs"
    stop_at = 0
    for name, flag in VARIANTS.items():  # the second variant stops where the first did: same steps, same batches
        guard = cfg.max_minutes * (1.25 if stop_at else 1)  # a safety net only: the second run stops at stop_at
        vcfg = replace(cfg, exclude_in_window=flag, stop_at=stop_at, max_minutes=guard)
        res = train(vcfg, train_data, held, runs / name, dev)
        stop_at = stop_at or int(res["steps"])
        shutil.copy(runs / name / "log.jsonl", out / f"log_{name}.jsonl")
        result["variants"][name] = {"train_config": asdict(vcfg), **res}
        save(f"trained {name}")
    models = {}
    for name, flag in VARIANTS.items():
        models[name] = Transformer.load_checkpoint(runs / name / f"{args.model.replace('-', '')}.safetensors",
                                                   device=dev).eval()
        assert models[name].args.exclude_in_window == flag
    torch.set_grad_enabled(False)
    text = list(held.tolist())
    span = max(CALIBRATION_SPAN, args.history + max(KINDS) + args.fidelity_steps)
    starts = [i * (len(text) - span) // max(1, args.sessions - 1) for i in range(args.sessions)]
    per: dict[str, dict[str, list[Fidelity]]] = {name: {} for name in VARIANTS}
    spent: list[float] = []
    for s in starts:
        for off in KINDS:
            if spent and time.perf_counter() - t0 + 1.5 * max(spent) > args.budget_s:
                result["fidelity_cut_short"] = True
                break
            t1 = time.perf_counter()
            for name, model in models.items():
                res = one_resume(model, text[s : s + span], args.history + off, args.fidelity_steps, list(REPLAYS))
                for key, f in res.items():
                    per[name].setdefault(key, []).append(f)
            spent.append(time.perf_counter() - t1)
            for name in VARIANTS:
                result["variants"][name]["fidelity"] = fidelity_rows(per[name])
            result["resumes"] = len(spent)
            save(f"resume {len(spent)}")
    save("done")
    print("| rule | steps | held-out bpb | SWA-only bpb | R=128 mean KL | R=128 top-1 | R=256 mean KL | R=256 top-1 |")
    for name, v in result["variants"].items():
        f = v.get("fidelity", {})
        cells = [f"{f[k]['mean_kl']:.3g} | {f[k]['top1_agreement']:.2%}" if k in f else "- | -"
                 for k in ("R=128", "R=256")]
        print(f"| {name} | {v['steps']} | {v['heldout_bpb']:.4f} | {v['heldout_bpb_swa_only']:.4f} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
