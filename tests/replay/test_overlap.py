"""ModelArgs.exclude_in_window (docs/MODEL.md): global entries whose tokens all lie inside the query's own SWA
window are dropped from the indexer's candidates, the same way in the inference model and the training forward."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from replay import dense
from replay.fidelity import exact_replay_length, packed_copy, resumed_state, teacher_forced
from replay.model import Attention, ModelArgs, Transformer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARGS = ModelArgs.tiny8(top_k=8, pool_blocks=4, exclude_in_window=True)  # selection and pool bite at T = 300


@pytest.fixture(autouse=True)
def grad_enabled() -> Iterator[None]:
    with torch.enable_grad():
        yield


def _tokens(b: int, t: int, seed: int = 0) -> Tensor:
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def test_dense_forward_matches_run_bit_for_bit_with_exclusion() -> None:
    model = Transformer(ARGS, seed=1)
    toks, dfrom = _tokens(2, 300), [0, 170]
    with torch.no_grad():
        out = dense.forward(model, toks, torch.tensor(dfrom)).logits
    for b, d in enumerate(dfrom):
        ref = model.decode_tokens(toks[b], model.new_state(), decoder_from=d, chunk_size=512)
        assert torch.equal(out[b, d:], ref)
    same = Transformer(ModelArgs.tiny8(top_k=8, pool_blocks=4), seed=1)  # the same weights, the spec's rule
    with torch.no_grad():
        assert not torch.equal(dense.forward(same, toks, torch.tensor(dfrom)).logits[0], out[0])


def test_no_selected_entry_lies_wholly_inside_the_querys_window(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Transformer(ARGS, seed=2)
    seen: list[tuple[int, Tensor, Tensor, Tensor, Tensor]] = []
    select = Attention.select

    def spy(self: Attention, h: Tensor, pos: Tensor, cs: Tensor, keys: Tensor, win_lo: Tensor,
            ctx: dict[str, tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        sel, ok = select(self, h, pos, cs, keys, win_lo, ctx)
        seen.append((self.args.m[self.src], pos, win_lo, sel, ok))
        return sel, ok

    monkeypatch.setattr(Attention, "select", spy)
    state = model.new_state()
    model.prefill(_tokens(1, 400)[0].tolist(), state, chunk_size=96)  # the decoder's SWA starts at 272
    model.decode_tokens(_tokens(1, 40, 1)[0].tolist(), state)
    assert {m for m, *_ in seen} == {1, 2}
    for m, pos, win_lo, sel, ok in seen:
        first = torch.maximum(pos - ARGS.window + 1, win_lo)[:, None]  # the window's first position
        assert bool((sel[ok] * m < first.expand_as(sel)[ok]).all())  # a token of each selected entry precedes it
    assert any(bool(ok.any()) for *_, ok in seen)


def test_exact_replay_stays_bit_identical_with_exclusion() -> None:
    model = Transformer(ARGS, seed=3)
    text = _tokens(1, 700, 2)[0].tolist()
    n, cont = 600, text[600:660]
    ref_state = model.new_state()
    model.prefill(text[: n - 20], ref_state, chunk_size=128)
    first = model.decode_tokens(text[n - 20 : n], ref_state)[-1]
    packed = packed_copy(model, ref_state)
    ref = teacher_forced(model, ref_state, first, cont)
    r = exact_replay_length(n, packed.decoder_from, model.args)
    state, lg = resumed_state(model, packed, text[:n], r)
    assert torch.equal(teacher_forced(model, state, lg, cont), ref)
    state, lg = resumed_state(model, packed, text[:n], 128)  # bounded replay runs; its error is measured elsewhere
    assert teacher_forced(model, state, lg, cont).isfinite().all()
