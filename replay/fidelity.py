"""How close a resumed session is to one that was never evicted.

After a resume, decode N tokens with teacher forcing (the same continuation for both) and compare
the next-token distributions step by step: KL(reference || resumed), top-1 agreement, and the
largest absolute logit error. The resumed state here is built the way the store rebuilds it: the
packed global entries as persisted, then replay of the last R tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from replay.model import SessionState, Transformer


@dataclass(frozen=True)
class Fidelity:
    replayed: int
    steps: int
    mean_kl: float
    max_kl: float
    top1_agreement: float
    max_abs_logit_err: float


def compare(ref: torch.Tensor, got: torch.Tensor, replayed: int) -> Fidelity:
    """ref, got: [N, V] logits for the same N positions."""
    lp, lq = F.log_softmax(ref.double(), -1), F.log_softmax(got.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return Fidelity(replayed, ref.shape[0], float(kl.mean()), float(kl.max()),
                    float((ref.argmax(-1) == got.argmax(-1)).double().mean()), float((ref - got).abs().max()))


def teacher_forced(model: Transformer, state: SessionState, first: torch.Tensor, continuation: Sequence[int]
                   ) -> torch.Tensor:
    """Logits [N, V]: ``first`` (after the history), then one row per fed continuation token but the last."""
    rows = [first]
    for tok in continuation[:-1]:
        rows.append(model.decode_one_token(int(tok), state))
    return torch.stack(rows)


def resumed_state(model: Transformer, packed: SessionState, history: Sequence[int], replay: int
                  ) -> tuple[SessionState, torch.Tensor]:
    """A fresh state holding ``packed``'s persisted global entries, SWA rebuilt by replaying the last
    ``replay`` tokens of ``history``; returns it and the last replayed token's logits."""
    state = model.new_state()
    for c in model.args.layout.caches:
        codes, scales = packed.global_entries(c.name, 0, packed.n_entries(c.name))
        state.load_global(c.name, codes, scales)
    r = min(len(history), replay)
    logits = model.replay(state, list(history[len(history) - r :]), start_pos=len(history) - r)
    return state, logits


def sweep(model: Transformer, history: Sequence[int], continuation: Sequence[int],
          replays: Sequence[int]) -> list[Fidelity]:
    """Fidelity of resuming after ``history`` for each replay length, against the never-evicted run."""
    ref_state = model.new_state()
    first = model.prefill(list(history), ref_state, chunk_size=512)
    packed = model.new_state()  # what the store holds: the global entries right after the history
    for c in model.args.layout.caches:
        codes, scales = ref_state.global_entries(c.name, 0, ref_state.n_entries(c.name))
        packed.load_global(c.name, codes, scales)
    ref = teacher_forced(model, ref_state, first, continuation)
    out = []
    for r in replays:
        state, logits = resumed_state(model, packed, history, r)
        out.append(compare(ref, teacher_forced(model, state, logits, continuation), min(r, len(history))))
    return out
