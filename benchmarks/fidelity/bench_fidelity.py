"""How close a resumed tiny-16 session is to one that was never evicted, on the trained checkpoint.

    python benchmarks/fidelity/bench_fidelity.py [--device cuda] [--sessions 4] [--steps 256]

Sessions are held-out text (``replay.corpus`` split by file; the model never trained on it). Each history is
an agent turn: a prefill of n - 32 tokens, then 32 decoded tokens (teacher-forced), so the decoder's run
began at decoder_from = n - 160 as it would in a serving engine. The persisted global KV of the history is
kept (``replay.fidelity.packed_copy``); the SWA state is rebuilt by replaying the last R tokens; then the
next 256 held-out tokens are teacher-forced through the resumed and the never-evicted session, and their
next-token distributions compared at every step. Resume points of four kinds per history length n0:
a chunk boundary (n0), an odd trailing token just past it (n0 + 1), a complete m=2 group inside a chunk
(n0 + 100), an odd trailing token inside a chunk (n0 + 157). Writes fidelity.md / fidelity.png /
fidelity.json and the checkpoint's calibration table (replay/checkpoints/*.calibration.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import RESULTS, machine, markdown_table, write_result
from benchmarks.fidelity import bench_overlap
from benchmarks.fidelity.resumes import BOUNDED, DECODED, KINDS, one_resume, pooled
from replay.calibration import Calibration, CalibrationRow
from replay.corpus import split_bytes
from replay.fidelity import Fidelity
from replay.weights import DEFAULT_CHECKPOINT, load_model

SWEEP = (1, 8, 16, 32, 64, 96, 128, 160, 192, 256, 384, 512, 768, 1024, 1176, 1536, 2048)
TARGET_KL, TARGET_TOP1 = 1e-3, 0.995


def cells(f: Fidelity) -> list[str]:
    return [f"{f.mean_kl:.3g}", f"{f.max_kl:.3g}", f"{f.top1_agreement:.2%}", f"{f.bpb:.3f}"]


def plot(sweep: dict[int, Fidelity], history: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = sorted(sweep)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6))
    floor = 1e-9
    ax.plot(xs, [max(sweep[r].mean_kl, floor) for r in xs], marker="o", label="mean KL")
    ax.plot(xs, [max(sweep[r].max_kl, floor) for r in xs], marker="o", color="tab:red", label="max KL")
    ax.axhline(TARGET_KL, color="gray", ls=":", label="target mean KL 1e-3")
    bx.plot(xs, [100 * sweep[r].top1_agreement for r in xs], marker="o", color="tab:green", label="top-1 agreement")
    bx.axhline(100 * TARGET_TOP1, color="gray", ls=":", label="target 99.5%")
    for a in (ax, bx):
        a.axvline(BOUNDED, color="tab:green", ls="--", lw=1, label="R = 128 (bounded)")
        a.axvline(exact_len(history), color="tab:orange", ls="--", lw=1, label=f"R = {exact_len(history):,} (exact)")
        a.set_xscale("log", base=2)
        a.set_xlabel("replayed tokens R")
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("KL(never evicted || resumed), nats")
    bx.set_ylabel("top-1 agreement (%)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def exact_len(n: int) -> int:
    """exact_replay_length for these histories: decoder_from = n - DECODED - 128."""
    return min(n, DECODED + 128 + 8 * 127)


def _rises(agg: dict[str, list[Fidelity]], history: int) -> str:
    """How many single resumes get worse somewhere between two neighbouring replay lengths of the sweep."""
    def at(r: int) -> list[Fidelity]:
        return agg.get(f"R={r}") or agg["bounded" if r == BOUNDED else "exact"]

    lens = [r for r in SWEEP if r <= 1024]
    steps = [(a, b, sum(y.mean_kl > x.mean_kl for x, y in zip(at(a), at(b), strict=True)))
             for a, b in itertools.pairwise(lens)]
    n, worse = len(at(BOUNDED)), sum(any(at(b)[i].mean_kl > at(a)[i].mean_kl for a, b, _ in steps)
                                     for i in range(len(at(BOUNDED))))
    top = sorted((c, a, b) for a, b, c in steps if c)[::-1][:3]
    return (f"{worse} of {n} resumes get worse somewhere from one sweep length to the next (most often "
            + ", ".join(f"{a:,} -> {b:,}: {c} resumes" for c, a, b in top) + ")")


def measure(args: argparse.Namespace) -> dict:  # type: ignore[type-arg]
    """Run every resume; returns (and writes fidelity.json with) the raw per-resume numbers."""
    t0 = time.perf_counter()
    model, weights = load_model(args.checkpoint, device=args.device)
    held = list(split_bytes("heldout"))
    span = max(args.histories) + max(KINDS) + args.steps
    starts = [i * (len(held) - span) // max(1, args.sessions - 1) for i in range(args.sessions)]
    texts = [held[s : s + span] for s in starts]
    by_len: dict[int, dict[str, list[Fidelity]]] = {}
    for n0 in args.histories:
        agg: dict[str, list[Fidelity]] = {}
        for text in texts:
            for off in KINDS:  # the order render() relies on: session-major, then resume kind
                n = n0 + off
                sweep = SWEEP if n0 == args.sweep_history else ()
                res = one_resume(model, text, n, args.steps, sorted({BOUNDED, exact_len(n), *sweep}))
                for name, f in res.items():
                    key = "bounded" if name == f"R={BOUNDED}" else "exact" if name == f"R={exact_len(n)}" else name
                    agg.setdefault(key, []).append(f)
                    if name != key and name in {f"R={r}" for r in sweep}:
                        agg.setdefault(name, []).append(f)
        by_len[n0] = agg
        print(f"history {n0}: bounded {pooled(agg['bounded'])}", flush=True)
    raw = {"weights": weights, "machine": machine(), "device": args.device, "wall_s": time.perf_counter() - t0,
           "sessions": args.sessions, "steps": args.steps, "sweep_history": args.sweep_history,
           "by_history": {n0: {k: [f.__dict__ for f in v] for k, v in agg.items()} for n0, agg in by_len.items()}}
    (RESULTS / "fidelity.json").write_text(json.dumps(raw, indent=1))
    return raw


def cpu_check(args: argparse.Namespace, history: int) -> dict:  # type: ignore[type-arg]
    """Bounded / exact / re-prefill at one history length on CPU float32, where the model's arithmetic does not
    depend on chunking: exact replay must be bit-identical, so bounded replay's error has no floor under it."""
    t0 = time.perf_counter()
    model, weights = load_model(args.checkpoint, device="cpu")
    held = list(split_bytes("heldout"))
    span = max(args.histories) + max(KINDS) + args.steps  # the same stretches as measure() with as many sessions
    starts = [i * (len(held) - span) // max(1, args.sessions - 1) for i in range(args.sessions)]
    agg: dict[str, list[Fidelity]] = {}
    for s in starts:
        for off in KINDS:
            n = history + off
            res = one_resume(model, held[s : s + span], n, args.steps, [BOUNDED, exact_len(n)])
            for name, f in res.items():
                agg.setdefault("bounded" if name == f"R={BOUNDED}" else "exact" if name.startswith("R=") else name,
                               []).append(f)
    return {"machine": machine(), "weights": weights, "history": history, "sessions": args.sessions,
            "steps": args.steps, "wall_s": time.perf_counter() - t0,
            "exact_bit_identical": all(f.max_abs_logit_err == 0.0 for f in agg["exact"]),
            "pooled": {k: pooled(v).__dict__ for k, v in agg.items()}}


def _cpu_section(c: dict | None) -> str:  # type: ignore[type-arg]
    if not c:
        return ""
    p = {k: Fidelity(**v) for k, v in c["pooled"].items()}
    rows = [[k, *cells(p[k])] for k in ("bounded", "exact", "re-prefill", "bounded vs re-prefill")]
    table = markdown_table(["resume", "mean KL", "max KL", "top-1 agreement", "bits/byte"], rows)
    same = "bit-identical to" if c["exact_bit_identical"] else "NOT bit-identical to"
    return f"""
## Cross-check on CPU (no floating-point floor)

{c["machine"]}, float32, {c["history"]:,}-token histories, the first and last of the held-out stretches above
({c["sessions"]} x 4 resume points, {c["steps"]} steps each; {c["wall_s"]:.0f} s). Here exact replay is **{same}**
the never-evicted session, so all of bounded replay's error is its own.

{table}
"""


def _overlap_section() -> str:
    committed = bench_overlap.COMMITTED
    return bench_overlap.section(json.loads(committed.read_text())) if committed.exists() else ""


def render(raw: dict, cal_path: Path) -> None:  # type: ignore[type-arg]
    """fidelity.md, fidelity.png and the calibration table from fidelity.json's numbers."""
    by_len = {int(n0): {k: [Fidelity(**f) for f in v] for k, v in agg.items()} for n0, agg in raw["by_history"].items()}
    sweep_h = raw.get("sweep_history", 4096)
    steps = raw.get("steps", 256)
    nk = len(KINDS)
    sessions = raw.get("sessions", len(by_len[sweep_h]["bounded"]) // nk)
    sw = {}
    for r in SWEEP:
        fs = by_len[sweep_h].get(f"R={r}") or (by_len[sweep_h]["bounded"] if r == BOUNDED else
                                                by_len[sweep_h]["exact"] if r == exact_len(sweep_h) else [])
        sw[r] = pooled(fs)
    if "sweep" in raw:  # fidelity.json of the first run kept the pooled sweep only
        sw = {int(r): Fidelity(**f) for r, f in raw["sweep"].items()}
    main_rows = []
    for n0, agg in by_len.items():
        for key, label in (("never evicted", "never evicted (reference)"), ("bounded", "bounded, R = 128"),
                           ("exact", f"exact, R = {exact_len(n0):,}"), ("re-prefill", "re-prefill (whole history)"),
                           ("bounded vs re-prefill", "bounded, against re-prefill")):
            main_rows.append([f"{n0:,}", label, *cells(pooled(agg[key]))])
    table = markdown_table(["history n0", "resume", "mean KL", "max KL", "top-1 agreement", "bits/byte"], main_rows)
    kinds = list(KINDS.values())
    by_kind = {k: [f for agg in by_len.values() for i, f in enumerate(agg["bounded"]) if i % nk == j]
               for j, k in enumerate(kinds)}
    kind_table = markdown_table(["resume point", "mean KL", "max KL", "top-1 agreement", "bits/byte"],
                                [[k, *cells(pooled(v))] for k, v in by_kind.items()])
    sweep_table = markdown_table(["replayed R", "mean KL", "max KL", "top-1 agreement", "bits/byte"],
                                 [[f"{r:,}", *cells(f)] for r, f in sorted(sw.items())])
    cal = Calibration(raw["weights"], sweep_h, sessions * nk,
                      tuple(CalibrationRow(r, f.mean_kl, f.max_kl, f.top1_agreement) for r, f in sorted(sw.items())))
    cal.save(cal_path)
    b = pooled([f for agg in by_len.values() for f in agg["bounded"]])
    bp = pooled([f for agg in by_len.values() for f in agg["bounded vs re-prefill"]])
    ex = pooled([f for agg in by_len.values() for f in agg["exact"]])
    per_len = [pooled(agg["bounded"]).mean_kl for agg in by_len.values()]
    first_ok = min((r for r, f in sw.items() if f.mean_kl <= TARGET_KL and f.top1_agreement >= TARGET_TOP1),
                   default=None)
    met_kl, met_top1 = b.mean_kl <= TARGET_KL, b.top1_agreement >= TARGET_TOP1
    verdict = ("**met**" if met_kl and met_top1 else
               f"**{'mean KL met' if met_kl else 'mean KL not met'}, {'top-1 met' if met_top1 else 'top-1 not met'}**")
    png = RESULTS / "fidelity.png"
    plot(sw, sweep_h, png, f"tiny-16 trained ({raw['weights'].split()[-1]}): replay length vs error, "
         f"{sweep_h:,}-token held-out histories")
    gpu = raw["device"] != "cpu"
    rises = _rises(by_len[sweep_h], sweep_h)
    floor = (f"""- **The floor on this device.** The exact rows are not zero: mean KL {ex.mean_kl:.2g}, top-1
  {ex.top1_agreement:.2%}. That is the GPU's floating point, not replay: cuBLAS picks other kernels for other
  chunk shapes, and an FP8/FP4 rounding flip somewhere in 16 layers follows. On CPU the same exact replays are
  bit-identical to the never-evicted session (tests/replay/test_fidelity.py;
  tests/replay/test_model.py). Read bounded replay's
  own loss as its error minus this floor: in top-1, about {ex.top1_agreement - b.top1_agreement:.2%} of next
  tokens."""
             if gpu else "- On CPU, exact replay is bit-identical to the never-evicted session.")
    body = f"""Machine: {raw["machine"]}, device {raw["device"]}, float32 (TF32 off). Weights: **{raw["weights"]}**
(replay/checkpoints/README.md). Sessions: {sessions} held-out stretches of the standard library (files the model
never trained on) per history length; each history = a prefill of n - {DECODED} tokens then {DECODED} decoded
tokens; at every resume point kind ({", ".join(kinds)}) the next {steps} held-out tokens are teacher-forced through
the resumed and the never-evicted session. KL(never evicted || resumed) in nats per step; top-1 agreement with the
never-evicted argmax; bits/byte of the resumed session on those {steps} tokens. Whole run: {raw["wall_s"]:.0f} s.

## Bounded vs exact replay vs re-prefill

{table}

"exact" replays (n - decoder_from) + 8 x 127 tokens (`replay.fidelity.exact_replay_length`; decoder_from =
n - 160 here): the decoder's whole run plus the encoder's receptive field below it, at most 128 + 15 x 127 = 2,033.
"re-prefill" recomputes the history from token 0, which runs the decoder over the last 128 tokens only: it is
**not** the never-evicted session when that session decoded, so it carries an error of its own.

**Target** (R = 128: top-1 >= 99.5% and mean KL <= 1e-3): over all {len(by_len)} history lengths and resume points,
bounded replay has mean KL **{b.mean_kl:.2g}** and top-1 **{b.top1_agreement:.2%}** against the never-evicted
session (mean KL {bp.mean_kl:.2g}, top-1 {bp.top1_agreement:.2%} against a re-prefill): {verdict}.
{f"The smallest replay length that meets both on the sweep is R = **{first_ok:,}**." if first_ok else ""}

## Bounded replay by resume point (all history lengths)

{kind_table}

## Error vs replay length ({sweep_h:,}-token histories; the checkpoint's calibration table)

{sweep_table}

![fidelity vs replay length](fidelity.png)
{_cpu_section(raw.get("cpu_check"))}{_overlap_section()}
## What these numbers say

- **A trained model loses little, not nothing.** With seeded random weights bounded replay left a mean KL of 0.2-0.3
  nats and agreed on 3-19% of next tokens (the earlier version of this page); on the trained checkpoint it leaves
  {b.mean_kl:.2g} nats and agrees on {b.top1_agreement:.1%}, and the held-out bits per byte of the resumed session
  are those of the never-evicted one to the third decimal. Near-uniform attention was what spread the error.
- **Why top-1 misses 99.5% at R = 128.** The first replayed tokens see truncated windows in every layer; a trained
  model attends sharply, so most of that error dies within a window, but not all: the worst single step reached a KL
  of {b.max_kl:.2g} nats (mean over steps is small because such steps are rare), and near-tied next-token choices
  flip. Doubling R to 256 brings mean KL to {sw[256].mean_kl:.2g} and top-1 to {sw[256].top1_agreement:.2%}.
- **No growth with history length or resume point.** Bounded replay's mean KL stays within
  {min(per_len):.2g}-{max(per_len):.2g} from 1K to 32K tokens of history: the persisted global KV covers everything
  before the replayed span exactly. The four resume-point kinds (a chunk boundary, an odd trailing token that no
  global entry holds yet, ...) are within noise of each other.
{floor}
- **Error is not monotone in R on a single resume**: {rises}. Below R = 128 the decoder, too, runs over only R
  tokens; near the floor, rounding noise dominates. The calibration table is pooled over resumes, and
  `Calibration.pick` only trusts a length from which every longer calibrated length also meets the budget.

Reproduce: `python benchmarks/fidelity/bench_fidelity.py --device cuda --sessions 6` (it ran on the `device` tool's
H200 in {raw["wall_s"]:.0f} s; the CPU needs hours for 32K histories). Raw numbers: `fidelity.json`; re-render this
page and the calibration table from them: `python benchmarks/fidelity/bench_fidelity.py --render-only`."""
    print(table, kind_table, sweep_table, sep="\n\n")
    print(f"wrote {write_result('fidelity.md', 'Resume fidelity on the trained tiny-16', body)}, {png}, {cal_path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--histories", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--sweep-history", type=int, default=4096)
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--calibration", default=None, help="where to write the calibration table (default: beside "
                    "the checkpoint)")
    ap.add_argument("--render-only", action="store_true", help="re-render from fidelity.json, measure nothing")
    ap.add_argument("--cpu-check", type=int, metavar="HISTORY", help="add a CPU cross-check at this history length "
                    "(over --sessions stretches) to fidelity.json, then re-render")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.cpu_check:
        torch.set_num_threads(1)
        raw = json.loads((RESULTS / "fidelity.json").read_text())
        raw["cpu_check"] = cpu_check(args, args.cpu_check)
        (RESULTS / "fidelity.json").write_text(json.dumps(raw, indent=1))
    else:
        raw = json.loads((RESULTS / "fidelity.json").read_text()) if args.render_only else measure(args)
    render(raw, Path(args.calibration) if args.calibration else Calibration.path_for(Path(args.checkpoint)))


if __name__ == "__main__":
    main()
