"""How close a resumed tiny-16 session is to one that was never evicted, per replay length.

    python benchmarks/bench_fidelity.py [--history 4096] [--steps 64]

``replay.fidelity.sweep``: prefill a history of real text (byte tokens of the standard library's .py
sources, concatenated in sorted order), keep its persisted global KV, rebuild the SWA state by replaying
the last R tokens, then teacher-force the same N-token continuation through the resumed and the
never-evicted session and compare their next-token distributions at every step. R = 128 is SWA Bounded
Replay; R = 16 x 128 = 2,048 is the exact rebuild. Seeded random weights (seed 0): see the notes written
beside the table for what that does and does not show.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, machine, markdown_table, write_result
from replay.corpus import stdlib_tokens
from replay.fidelity import Fidelity, compare, resumed_state, sweep, teacher_forced
from replay.model import ModelArgs, SessionState, Transformer

BOUNDED, EXACT = 128, 16 * 128
REPLAYS = (1, 16, 32, 64, BOUNDED, 256, 512, 1024, 1144, EXACT)




class Reference:
    """The never-evicted run over one history and continuation, and the global KV a store would hold,
    for replay lengths outside the sweep's grid (the bisection) and for the re-prefill row."""

    def __init__(self, model: Transformer, history: list[int], continuation: list[int]) -> None:
        self.model, self.history, self.continuation = model, history, continuation
        state = model.new_state()
        first = model.prefill(history, state, chunk_size=512)
        self.packed = model.new_state()
        for c in model.args.layout.caches:
            self.packed.load_global(c.name, *state.global_entries(c.name, 0, state.n_entries(c.name)))
        self.logits = teacher_forced(model, state, first, continuation)
        logp = torch.log_softmax(self.logits.double(), -1)
        self.entropy = float(-(logp.exp() * logp).sum(-1).mean())  # nats; uniform over 256 = ln 256 = 5.55

    def replay(self, r: int) -> Fidelity:
        """As ``sweep`` measures R, but the continuation goes in as one prefill (every token's logits):
        the model's arithmetic does not depend on chunking, so this is bit-identical to decoding it one
        token at a time (main() checks that against sweep) and 40x faster."""
        state, logits = resumed_state(self.model, self.packed, self.history, r)
        rest = self.model.prefill(self.continuation[:-1], state, all_logits=True)
        return compare(self.logits, torch.cat([logits[None], rest]), r)

    def reprefill(self) -> Fidelity:
        """A fresh full prefill, chunked differently (256 vs 512): the ground truth, recomputed."""
        state: SessionState = self.model.new_state()
        first = self.model.prefill(self.history, state, chunk_size=256)
        return compare(self.logits, teacher_forced(self.model, state, first, self.continuation), len(self.history))


def exact(f: Fidelity) -> bool:
    return f.max_abs_logit_err == 0.0


def first_exact(ref: Reference, grid: list[Fidelity]) -> tuple[int, int, Fidelity]:
    """(T, B, fidelity at T - 1): every R in [T, the grid's first exact point] gives bit-identical logits
    (scanned down one by one), T - 1 does not; B is the smallest exact R that bisection finds between the
    grid's last inexact point and T (B < T: bit-identity also happens sporadically below T)."""
    top = min(f.replayed for f in grid if exact(f))
    t = top
    while exact(below := ref.replay(t - 1)):
        t -= 1
    lo, hi = max(f.replayed for f in grid if f.replayed < top), t
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if exact(ref.replay(mid)) else (mid, hi)
    return t, hi, below


def row(name: str, f: Fidelity, note: str = "") -> list[str]:
    err = "0 (bit-identical)" if exact(f) else f"{f.max_abs_logit_err:.3g}"
    return [name, f"{f.mean_kl:.3g}", f"{f.max_kl:.3g}", f"{f.top1_agreement:.1%}", err, note]


def plot(grid: list[Fidelity], r_star: int, history: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [f.replayed for f in grid]
    nonzero = [f for f in grid if f.mean_kl > 0]
    floor = min(f.mean_kl for f in nonzero) / 30
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8))
    for key, c, name in (("mean_kl", "tab:blue", "mean KL over the continuation"),
                         ("max_kl", "tab:red", "max KL over the continuation")):
        ys = [getattr(f, key) for f in grid]
        ax.plot(xs, [max(y, floor) for y in ys], marker="o", color=c, label=name)
    err = [f.max_abs_logit_err for f in grid]
    bx.plot(xs, [max(e, 1e-7) for e in err], marker="o", color="tab:purple", label="max |logit error|")
    for a, zero in ((ax, floor), (bx, 1e-7)):
        zs = [f.replayed for f in grid if exact(f)]
        a.scatter(zs, [zero] * len(zs), s=90, facecolors="none", edgecolors="black", zorder=5,
                  label="0: bit-identical to never evicted")
        for x, name, c in ((BOUNDED, "R = 128: bounded replay", "tab:green"),
                           (r_star, f"R >= {r_star:,}: bit-identical", "gray"),
                           (EXACT, "R = 2,048: exact (16 x 128)", "tab:orange")):
            a.axvline(x, color=c, ls="--", lw=1.2, label=name)
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        ticks = sorted({1, 16, 32, 64, 128, 256, 512, 1024, 2048, history})
        a.set_xticks(ticks, [f"{t:,}" for t in ticks], fontsize=8)
        a.set_xlabel("replayed tokens R (log scale)")
        a.grid(True, which="major", alpha=0.3)
        a.legend(fontsize=8, loc="lower left", framealpha=0.95)
    ax.set_ylabel("KL(never evicted || resumed), nats")
    ax.set_title(f"Next-token KL vs replay length ({history:,}-token history)")
    bx.set_ylabel("max |logit error|")
    bx.set_title("Largest logit error over the continuation")
    fig.suptitle("tiny-16, seeded random weights: fidelity of SWA replay (zeros drawn at the bottom)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=64, help="teacher-forced continuation tokens")
    ap.add_argument("--other-histories", type=int, nargs="+", default=[1024, 8192, 16384])
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    model = Transformer(ModelArgs.tiny16(), seed=0)
    text = stdlib_tokens(max([args.history, *args.other_histories]) + args.steps)
    history, cont = text[: args.history], text[args.history : args.history + args.steps]

    grid = sweep(model, history, cont, [*REPLAYS, args.history])
    print("sweep done", f"{time.perf_counter() - t0:.0f} s")
    ref = Reference(model, history, cont)
    if ref.replay(BOUNDED) != grid[REPLAYS.index(BOUNDED)] or not exact(ref.replay(EXACT)):
        raise AssertionError("the one-prefill continuation disagrees with sweep's token-by-token decode")
    reprefill = ref.reprefill()
    r_star, sporadic, below = first_exact(ref, grid)
    first_grid = min(f.replayed for f in grid if exact(f))
    print(f"exact from {r_star} on (R={r_star - 1}: max |err| {below.max_abs_logit_err:.3g}); sporadic: {sporadic}")

    notes = {1: "minimum (0 replayed is impossible: the logits need a token)", BOUNDED: "**bounded** (the paper's)",
             1144: "8 x 127 + 128 (see below)", EXACT: "**exact** (16 x 128)", args.history: "the whole history"}
    rows = [row(f"{f.replayed:,}", f, notes.get(f.replayed, "")) for f in grid]
    rows.append(row("re-prefill", reprefill, "reference check: a fresh prefill, chunked 256 instead of 512"))
    table = markdown_table(["replayed tokens R", "mean KL", "max KL", "top-1 agreement", "max abs logit error",
                            ""], rows)

    others = []
    for h in sorted({*args.other_histories, args.history}):
        if h == args.history:
            f = grid[REPLAYS.index(BOUNDED)]
        else:
            (f,) = sweep(model, text[:h], text[h : h + args.steps], [BOUNDED])
        others.append((h, f))
        print(f"history {h}: {f}")
    other = markdown_table(["history (tokens)", "mean KL", "max KL", "top-1 agreement", "max abs logit error"],
                           [row(f"{h:,}", f)[:5] for h, f in others])
    kl_spread = max(f.mean_kl for _, f in others) / min(f.mean_kl for _, f in others)
    info = math.log(256) - ref.entropy
    ups = [(a.replayed, c.replayed) for a, c in itertools.pairwise(grid) if c.mean_kl > a.mean_kl]
    why = (": with R < 128 the decoder, too, runs over only R tokens, so its own windows are truncated"
           if all(c <= BOUNDED for _, c in ups) else "")
    nonmono_text = (f"Error does not fall monotonically with R ({', '.join(f'R = {a} -> {c}' for a, c in ups)} "
                    f"makes it worse){why}."
                    if ups else "Error falls monotonically with R.")
    sporadic_text = (f"Below that it is sporadic: R = {sporadic:,} is bit-identical too, its neighbour "
                     f"R = {sporadic - 1:,} is not (found by bisection below {r_star:,})."
                     if sporadic < r_star else "Bisection below that found no other bit-identical R.")
    wall = time.perf_counter() - t0
    png = RESULTS / "fidelity.png"
    plot(grid, r_star, args.history, png)
    b = grid[REPLAYS.index(BOUNDED)]
    body = f"""Machine: {machine()}. Model: tiny-16, **seeded random weights (seed 0)**. History:
{args.history:,} byte tokens of real text (the standard library's .py sources, concatenated in sorted order);
continuation: the next {args.steps} tokens, teacher-forced through both sessions. Metrics over the {args.steps}
next-token distributions: KL(never evicted || resumed) in nats, top-1 agreement, largest absolute logit
error. "Resumed" = the persisted FP4 global KV of the history, then replay of its last R tokens
(`replay.fidelity.sweep`). Whole benchmark: {wall:.0f} s.

## Fidelity vs replay length ({args.history:,}-token history)

{table}

**First exact agreement** (bit-identical logits at all {args.steps} steps): on the grid, R = **{first_grid:,}**.
Scanning down one token at a time, every R from **{r_star:,}** to {first_grid:,} is bit-identical and
R = {r_star - 1:,} is not (max |logit error| {below.max_abs_logit_err:.3g}, mean KL {below.mean_kl:.3g}).
{sporadic_text}
Why 1,144 and not 2,048: prefill runs the decoder over the last 128 tokens only, and their decoder input
H_{{L/2}} depends on the 8 encoder layers' windows, 8 x 127 tokens further back, so 8 x 127 + 128 = 1,144
replayed tokens rebuild a session that only prefilled exactly (16 x 128 = 2,048 also covers a session whose
decoder ran over many decoded tokens). Below 1,144 a perturbation must cross every layer through the oldest
keys of each window, shrinking each time, and FP8 rounding of the SWA keys can swallow it entirely: so
bit-identity can arrive earlier on a given network and text, but only 1,144 is guaranteed.

## Bounded replay (R = 128) at other history lengths

{other}

Across {min(h for h, _ in others):,} to {max(h for h, _ in others):,} tokens of history, bounded replay's mean KL
stays within {min(f.mean_kl for _, f in others):.3g}-{max(f.mean_kl for _, f in others):.3g}
{"(no growth with the session's length)" if kl_spread < 2 else f"(a {kl_spread:.1f}x spread)"}: the persisted global
KV covers everything before the replayed span exactly, so the error comes only from the truncated windows at the
start of the replay, whose size does not depend on how long the session is.

## What these numbers are (random weights)

- These are **seeded random weights**; a trained checkpoint comes in its own issue. The numbers measure this
  network, not the real model: they show the mechanism and its scale here, not what DeepSeek's model loses.
- The error is **not** hidden by random weights here, contrary to the expectation in MINIATURE.md. Bounded replay
  leaves a mean KL of {b.mean_kl:.3g} nats, against {info:.3g} nats of information the reference's own predictions
  carry (ln 256 - its mean entropy of {ref.entropy:.2f} nats), and moves logits by up to {b.max_abs_logit_err:.3g}.
  The likely reason is near-uniform attention: the first replayed positions average over a handful of keys instead of
  128, so their outputs are much larger and noisier than the 128-key average they replace, and every layer above
  layer 0 keeps seeing those positions through its window during the whole {args.steps}-token continuation. A
  trained model that attends sharply to a few recent or matching tokens may lose much less; it could also lose
  more where it relies on exactly the keys the replay lacks. Only a trained checkpoint can say.
- Top-1 agreement ({b.top1_agreement:.1%} for bounded) overstates the damage: with predictions this flat, many
  logits are near-ties and tiny shifts reorder them. KL is the measure to read.
- {nonmono_text}
- What holds regardless of the weights: replay of 1,144 tokens or more (and the whole history, and a fresh
  re-prefill chunked differently) is bit-identical to the never-evicted session, so persisting the global KV
  as the FP4 bytes the model itself attends to loses nothing; all of the error above comes from rebuilding SWA
  from a truncated span.

![fidelity vs replay length](fidelity.png)

Reproduce: `python benchmarks/bench_fidelity.py`"""
    print(table)
    print(other)
    print(f"wall {wall:.0f} s")
    print(f"wrote {write_result('fidelity.md', 'Resume fidelity vs replay length (tiny-16)', body)} and {png}")


if __name__ == "__main__":
    main()
