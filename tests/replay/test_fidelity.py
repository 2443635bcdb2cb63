"""replay/fidelity.py: a resumed state built from the persisted globals plus replay, for sessions that decoded."""

from __future__ import annotations

import pytest
import torch

from replay.fidelity import compare, exact_replay_length, packed_copy, resumed_state, teacher_forced
from replay.model import ModelArgs, Transformer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def decoded() -> tuple[Transformer, list[int], torch.Tensor, object]:
    """tiny-8: a 700-token prefill, then 40 decoded tokens (the decoder's run began at 700 - 128)."""
    model = Transformer(ModelArgs.tiny8(), seed=0)
    toks = torch.randint(0, 256, (760,), generator=torch.Generator().manual_seed(3)).tolist()
    state = model.new_state()
    model.prefill(toks[:700], state)
    first = model.decode_tokens(toks[700:740], state)[-1]
    packed = packed_copy(model, state)
    return model, toks, teacher_forced(model, state, first, toks[740:760]), packed


@pytest.mark.parametrize("replay", ["whole", "exact"])
def test_replay_of_a_decoded_session_is_bit_identical(decoded, replay: str) -> None:  # type: ignore[no-untyped-def]
    model, toks, ref, packed = decoded
    n = 740
    r = n if replay == "whole" else exact_replay_length(n, packed.decoder_from, model.args)
    assert packed.decoder_from == 572 and (replay == "whole" or r == 40 + 128 + 4 * 127)
    state, logits = resumed_state(model, packed, toks[:n], r)
    f = compare(ref, teacher_forced(model, state, logits, toks[740:760]), r, toks[740:760])
    assert f.max_abs_logit_err == 0.0 and f.mean_kl == 0.0 and f.bpb > 0


def test_bounded_replay_of_a_decoded_session_is_close_but_not_exact(decoded) -> None:  # type: ignore[no-untyped-def]
    model, toks, ref, packed = decoded
    state, logits = resumed_state(model, packed, toks[:740], 128)
    f = compare(ref, teacher_forced(model, state, logits, toks[740:760]), 128)
    assert f.mean_kl > 0 and f.steps == 20
