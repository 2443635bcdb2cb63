"""One resume of a session, measured against the never-evicted one: what bench_fidelity.py and
bench_overlap.py share (the resume points, the replays, the pooling of their errors)."""

from __future__ import annotations

import statistics

import torch

from replay.fidelity import Fidelity, compare, packed_copy, resumed_state, teacher_forced
from replay.model import Transformer

BOUNDED = 128
KINDS = {0: "chunk boundary", 1: "odd token past a boundary", 100: "complete m=2 group in a chunk",
         157: "odd token in a chunk"}
DECODED = 32


def one_resume(model: Transformer, text: list[int], n: int, steps: int, replays: list[int]
               ) -> dict[str, Fidelity]:
    """Never-evicted session over text[:n] (prefill, then DECODED decoded tokens) vs every resume of it."""
    ref_state = model.new_state()
    model.prefill(text[: n - DECODED], ref_state, chunk_size=512)
    first = model.decode_tokens(text[n - DECODED : n], ref_state)[-1]
    packed = packed_copy(model, ref_state)
    cont = text[n : n + steps]
    ref = teacher_forced(model, ref_state, first, cont)
    out: dict[str, Fidelity] = {"never evicted": compare(ref, ref, n, cont)}
    logits: dict[str, torch.Tensor] = {}
    for r in replays:
        state, lg = resumed_state(model, packed, text[:n], r)
        logits[f"R={r}"] = teacher_forced(model, state, lg, cont)
        out[f"R={r}"] = compare(ref, logits[f"R={r}"], min(r, n), cont)
    state = model.new_state()
    lg = model.prefill(text[:n], state, chunk_size=512)
    rep = teacher_forced(model, state, lg, cont)
    out["re-prefill"] = compare(ref, rep, n, cont)
    if f"R={BOUNDED}" in logits:
        out["bounded vs re-prefill"] = compare(rep, logits[f"R={BOUNDED}"], BOUNDED, cont)
    return out


def pooled(fs: list[Fidelity]) -> Fidelity:
    return Fidelity(fs[0].replayed, sum(f.steps for f in fs), statistics.fmean(f.mean_kl for f in fs),
                    max(f.max_kl for f in fs), statistics.fmean(f.top1_agreement for f in fs),
                    max(f.max_abs_logit_err for f in fs), statistics.fmean(f.bpb for f in fs))
