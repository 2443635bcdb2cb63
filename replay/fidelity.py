"""How close a resumed session is to one that was never evicted.

After a resume, feed the same N-token continuation to both sessions (teacher forcing) and compare the
next-token distributions step by step: KL(reference || resumed), top-1 agreement, the largest absolute
logit error, and the resumed session's own bits per byte on the continuation. The resumed state is built
the way the store rebuilds it: the packed global entries as persisted, then replay of the last R tokens
with the decoder starting where the saved session's decoder run began (``decoder_from``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from replay.model import ModelArgs, SessionState, Transformer


@dataclass(frozen=True)
class Fidelity:
    replayed: int
    steps: int
    mean_kl: float
    max_kl: float
    top1_agreement: float
    max_abs_logit_err: float
    bpb: float = math.nan  # the resumed session's bits per byte on the continuation (when targets are given)


def compare(ref: torch.Tensor, got: torch.Tensor, replayed: int, targets: Sequence[int] | None = None) -> Fidelity:
    """ref, got: [N, V] logits for the same N positions; targets: the N tokens that followed them."""
    lp, lq = F.log_softmax(ref.double(), -1), F.log_softmax(got.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    bpb = math.nan
    if targets is not None:
        t = torch.as_tensor(list(targets), device=lq.device)
        bpb = float(-lq.gather(1, t[:, None]).mean()) / math.log(2)
    return Fidelity(replayed, ref.shape[0], float(kl.mean()), float(kl.max()),
                    float((ref.argmax(-1) == got.argmax(-1)).double().mean()), float((ref - got).abs().max()), bpb)


def teacher_forced(model: Transformer, state: SessionState, first: torch.Tensor, continuation: Sequence[int]
                   ) -> torch.Tensor:
    """Logits [N, V]: ``first`` (after the history), then one row per fed continuation token but the last."""
    if len(continuation) <= 1:
        return first[None]
    return torch.cat([first[None], model.decode_tokens(list(continuation[:-1]), state)])


def packed_copy(model: Transformer, state: SessionState) -> SessionState:
    """A fresh state holding only ``state``'s persisted global entries (what the store would give back)."""
    packed = model.new_state()
    for c in model.args.layout.caches:
        packed.load_global(c.name, *state.global_entries(c.name, 0, state.n_entries(c.name)))
    packed.decoder_from = state.decoder_from
    return packed


def exact_replay_length(n: int, decoder_from: int, args: ModelArgs) -> int:
    """Tokens whose replay rebuilds a session exactly: the decoder's run (n - decoder_from) plus the encoder
    layers' receptive field below it, n_encoder x (window - 1); never more than the last layer's ring needs,
    window + (n_layers - 1) x (window - 1) (2,033 for tiny-16), nor than the session holds."""
    w = args.window
    return min(n, n - decoder_from + args.n_encoder * (w - 1), w + (args.n_layers - 1) * (w - 1))


def resumed_state(model: Transformer, packed: SessionState, history: Sequence[int], replay: int,
                  decoder_from: int | None = None) -> tuple[SessionState, torch.Tensor]:
    """A fresh state holding ``packed``'s persisted global entries, SWA rebuilt by replaying the last ``replay``
    tokens of ``history`` with the decoder from ``decoder_from`` (default: ``packed.decoder_from``, which
    ``packed_copy`` keeps); returns it and the last replayed token's logits."""
    state = model.new_state()
    for c in model.args.layout.caches:
        state.load_global(c.name, *packed.global_entries(c.name, 0, packed.n_entries(c.name)))
    n = len(history)
    r = min(n, replay)
    dec = packed.decoder_from if decoder_from is None else decoder_from
    logits = model.replay(state, list(history[n - r :]), start_pos=n - r, decoder_from=min(dec, n - 1))
    state.decoder_from = dec
    return state, logits
