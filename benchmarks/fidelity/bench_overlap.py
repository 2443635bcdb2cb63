"""A/B: global entries inside the query's own SWA window, kept (the spec's rule) or excluded from the indexer's
candidates (``ModelArgs.exclude_in_window``; docs/MODEL.md).

    python benchmarks/fidelity/bench_overlap.py --data .corpus --out DIR --device cuda --steps 400 --budget-s 520

Trains tiny-16 twice from the same seed on the same batches with the same schedule (``replay.train``), once per
rule; then for each model: held-out bits per byte on the first --eval-windows windows of 2,048 (bf16, as the
card), the same with every global entry masked (the SWA-only ablation), and bounded-replay fidelity at R = 128 and
R = 256 against the never-evicted session on --sessions x 4 held-out resumes of --history-token histories
(``resumes.one_resume``: the stretches and resume-point kinds of the checkpoint's calibration). Resumes
alternate between the two models, so a run cut short by the time budget still compares them on the same resumes.
Writes DIR/overlap.json after every stage (the loss curves in it at the end) and DIR/log_keep.jsonl,
DIR/log_exclude.jsonl. The committed run is benchmarks/results/fidelity.overlap.json; ``section`` renders it into
benchmarks/results/fidelity.md (bench_fidelity.py's render calls it).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import common
from benchmarks.common import machine, markdown_table
from benchmarks.fidelity.resumes import KINDS, one_resume, pooled
from replay.fidelity import Fidelity
from replay.model import Transformer
from replay.train import TrainConfig, load_split, train

VARIANTS = {"keep": False, "exclude": True}  # name -> exclude_in_window
REPLAYS = (128, 256)
CALIBRATION_SPAN = 32768 + max(KINDS) + 256  # bench_fidelity's stretches (its longest history), as calibrated
COMMITTED = common.COMMITTED / "fidelity.overlap.json"  # the committed run, which bench_fidelity's render reads


def fidelity_rows(per: dict[str, list[Fidelity]]) -> dict[str, dict[str, float]]:
    return {k: pooled(v).__dict__ for k, v in per.items() if v}


def section(raw: dict[str, Any]) -> str:
    """The fidelity.md section of one A/B run (overlap.json's numbers)."""
    v = raw["variants"]
    rows = []
    for name, label in (("keep", "keep (the spec; the shipped checkpoint's rule)"), ("exclude", "exclude_in_window")):
        x, f = v[name], v[name].get("fidelity", {})
        fid = [c for r in REPLAYS for c in ((f"{f[f'R={r}']['mean_kl']:.2g}", f"{f[f'R={r}']['max_kl']:.2g}",
                                             f"{f[f'R={r}']['top1_agreement']:.2%}") if f"R={r}" in f else "---")]
        rows.append([label, x["steps"], f"{x['heldout_bpb']:.4f}", f"{x['heldout_bpb_swa_only']:.4f}",
                     f"{x['heldout_bpb_swa_only'] - x['heldout_bpb']:.3f}", *fid])
    table = markdown_table(["rule", "steps", "held-out bpb", "SWA-only bpb", "global KV carries", "R=128 mean KL",
                            "R=128 max KL", "R=128 top-1", "R=256 mean KL", "R=256 max KL", "R=256 top-1"], rows)
    curves = {n: {r["step"]: r["loss"] for r in v[n].get("curve", [])} for n in VARIANTS}
    paired = [curves["keep"][s] - curves["exclude"][s] for s in curves["keep"] if s in curves["exclude"] and s >= 100]
    a = raw["args"]
    lower = sum(d > 0 for d in paired)
    return f"""
## Global entries inside the query's window

MINIATURE.md lets a query select global entries that lie wholly inside its own SWA window (an m=1 decoder entry is
visible to its own token), so such tokens count twice: FP8 via SWA and FP4 via the selection.
`ModelArgs.exclude_in_window` drops those entries from the indexer's candidates (and so from attention): an entry
stays a candidate only if one of its tokens precedes the window the query's SWA really sees (from max(where the
layer's SWA run began, p - 127)). Same rule in `replay/model.py` and `replay/dense.py`; tests/replay/test_overlap.py
checks the dense forward against `_run` bit for bit, that no selected entry lies inside the window, and that exact
replay stays bit-identical. What is stored does not change: the same entries are written and persisted either way.

A/B: both rules trained from the same initial weights on the same batches with the same short schedule ({a["steps"]}
steps x {a["batch"]} x {a["seq_len"]:,} bytes, cosine {a["lr"]:g} -> {a["lr"] / 10:g}, {a["warmup"]} warm-up; the card's
recipe at a third of its length), on one {raw["gpu"]}
({raw["machine"]}). Held-out bits per byte on the first
{a["eval_windows"]} held-out windows of 2,048 (bf16, decoder over the whole window); SWA-only = every global entry
masked. Fidelity: bounded replay against the never-evicted session on {raw.get("resumes", 0)} held-out resumes of
{a["history"]:,}-token histories (the calibration's stretches and resume-point kinds, `bench_fidelity.one_resume`),
{a["fidelity_steps"]} teacher-forced steps each, float32 (TF32 off). Whole run {raw["wall_s"]:.0f} s.
Compare the rows with each other only: the shipped checkpoint (0.939 bits per byte on all held-out windows)
trained almost three times longer.

{table}

Training loss on the same batches (paired, logged every 10 steps from step 100): the excluding model is lower at
{lower} of {len(paired)} points, by {sum(paired) / max(1, len(paired)):.3f} nats on average.

**Decision: the miniature keeps the spec's rule** (`exclude_in_window=False`, the default; the shipped checkpoint and
its calibration table are trained and measured with it). What a reader should conclude:
- **Replay fidelity does not hinge on this choice.** At R = 256 the two rules agree within noise; at R = 128 the
  excluding model is slightly worse (perhaps because it leans more on SWA, which bounded replay truncates), a gap that
  one seed and {raw.get("resumes", 0)} resumes do not pin on the rule. The double counting is not what drives
  bounded-replay error: kvstore's fidelity claims hold for either rule.
- **Excluding looks like the better language model per step** on this short, single-seed schedule: lower held-out bits
  per byte and a lower training loss at every paired point, presumably because top-k slots no longer go to entries
  SWA already holds in FP8. Its SWA-only ablation is much closer to its full score: with in-window entries excluded
  the global KV carries only what lies beyond the window, while the spec-rule model also routes local context through
  its FP4 copies (masking them costs it more). Whether the gap survives a full schedule or other seeds is not measured.
- It stays an option rather than the default because the miniature exists to mirror the spec's cache semantics, and a
  default change would silently change the committed checkpoint's forward. Train with `--exclude-in-window` to use it.

Reproduce (raw numbers and loss curves: `fidelity.overlap.json`):

```
{raw.get("command", "python benchmarks/fidelity/bench_overlap.py --data .corpus --device cuda")}
```
"""


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
    for name in VARIANTS:
        log = (out / f"log_{name}.jsonl").read_text().splitlines()
        result["variants"][name]["curve"] = [json.loads(line) for line in log]
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
