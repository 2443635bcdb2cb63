"""The reference model (replay/model.py): chunking, CSA2 visibility, Reuse layers, replay, packed caches."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
import torch

from replay.model import ModelArgs, SessionState, Transformer, attend, block_pool, select_top_k

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny8() -> Transformer:
    return Transformer(ModelArgs.tiny8(), seed=0)


@pytest.fixture(scope="module")
def small() -> Transformer:
    """tiny-8 with a small top-k and pool, so selection and the block pool bite on short sequences."""
    return Transformer(ModelArgs.tiny8(top_k=8, pool_blocks=4), seed=1)


@pytest.fixture(scope="module")
def tiny16() -> Transformer:
    return Transformer(ModelArgs.tiny16(), seed=0)


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def run(model: Transformer, toks: torch.Tensor, **kw: object) -> tuple[torch.Tensor, SessionState]:
    state = model.new_state()
    return model.prefill(toks, state, **kw), state  # type: ignore[arg-type]


def assert_globals_equal(a: SessionState, b: SessionState) -> None:
    for name in a.caches:
        assert a.n_entries(name) == b.n_entries(name), name
        for x, y in zip(a.global_entries(name, 0, a.n_entries(name)),
                        b.global_entries(name, 0, b.n_entries(name)), strict=True):
            assert torch.equal(x, y), name


def assert_rings_equal(a: SessionState, b: SessionState, layers: range | None = None) -> None:
    for i in layers or range(len(a.rings)):
        ra, rb = a.rings[i], b.rings[i]
        assert (ra.lo, ra.hi) == (rb.lo, rb.hi), f"layer {i}"
        for x, y in zip(ra.entries(), rb.entries(), strict=True):
            assert torch.equal(x, y), f"layer {i}"


def assert_states_equal(a: SessionState, b: SessionState) -> None:
    assert a.pos == b.pos
    assert_globals_equal(a, b)
    assert_rings_equal(a, b)
    assert a.pending.keys() == b.pending.keys()
    for layer, (kv, z, p) in a.pending.items():
        kv2, z2, p2 = b.pending[layer]
        assert p == p2 and torch.equal(kv, kv2) and torch.equal(z, z2)


def resumed(model: Transformer, saved: SessionState, upto: int | None = None) -> SessionState:
    """A fresh state holding saved's global caches as the store would return them (packed bytes)."""
    state = model.new_state()
    for spec in model.args.layout.caches:
        end = saved.n_entries(spec.name) if upto is None else upto // spec.m
        state.load_global(spec.name, *saved.global_entries(spec.name, 0, end))
    return state


def naive_attend(q: torch.Tensor, pos: list[int], keys: torch.Tensor, lo: int, glob: torch.Tensor,
                 glob_ok: torch.Tensor, window: int) -> torch.Tensor:
    """One query at a time: softmax over keys[max(lo, p-window+1) .. p] and the valid global entries."""
    out = []
    for i, p in enumerate(pos):
        kv = torch.cat([keys[max(lo, p - window + 1):p + 1], glob[i][glob_ok[i]]])
        out.append(torch.softmax(q[i] @ kv.T / q.shape[-1] ** 0.5, -1) @ kv)
    return torch.stack(out)


@pytest.mark.parametrize("pos0, t, lo", [(0, 5, 0), (21, 11, 5), (7, 10, 5), (30, 1, 0), (13, 40, 13)])
def test_attend_matches_naive_window_plus_selection(pos0: int, t: int, lo: int) -> None:
    g, window = torch.Generator().manual_seed(pos0), 8
    keys = torch.randn(pos0 + t, 32, generator=g)
    q = torch.randn(t, 2, 32, generator=g)
    glob = torch.randn(t, 3, 32, generator=g)
    glob_ok = torch.rand(t, 3, generator=g) > 0.3
    e0 = max(lo, pos0 - window + 1)
    pos = list(range(pos0, pos0 + t))
    got = attend(q, torch.tensor(pos), keys[e0:], e0, glob, glob_ok, window)
    torch.testing.assert_close(got, naive_attend(q, pos, keys, lo, glob, glob_ok, window))


def test_top_k_is_canonical_and_breaks_ties_toward_the_newest() -> None:
    ranked = torch.tensor([[0.0, 5.0, 0.0, 0.0, -1.0, float("-inf")]]) + torch.arange(6) * 1e-30
    sel, ok = select_top_k(ranked, torch.arange(6)[None], 3)
    assert sel.tolist() == [[1, 2, 3]] and ok.all()
    sel, ok = select_top_k(ranked, torch.arange(6)[None], 8)  # fewer candidates than k
    assert sel[ok].tolist() == [0, 1, 2, 3, 4] and ok.sum() == 5


def test_block_pool_keeps_the_newest_block() -> None:
    args = ModelArgs.tiny8(pool_blocks=2)
    ranked = torch.arange(80.0)[None].clone()
    ranked[0, 72:] = -100.0  # the newest block (entries 72-76 visible) scores worst
    ranked[0, 77:] = float("-inf")
    pool, ok = block_pool(ranked, torch.tensor([77]), args)
    assert sorted(pool[ok].tolist()) == [*range(64, 77)]


def test_presets_match_their_layouts() -> None:
    for args, name, layers in ((ModelArgs.tiny16(), "tiny-16", 16), (ModelArgs.tiny8(), "tiny-8", 8)):
        assert (args.layout_name, args.n_layers, args.layout.name) == (name, layers, name)
    with pytest.raises(ValueError):
        ModelArgs.tiny8(modes=("S", "S", "F", "U", "F", "U", "X", "U"))
    with pytest.raises(ValueError):
        ModelArgs.tiny16(layout_name="tiny-8")


@pytest.mark.parametrize("model_name, per_token", [("tiny16", Fraction(445, 2)), ("tiny8", Fraction(267, 2))])
def test_global_bytes_per_token_match_layout(request: pytest.FixtureRequest, model_name: str,
                                             per_token: Fraction) -> None:
    model: Transformer = request.getfixturevalue(model_name)
    _, state = run(model, tokens(64))
    assert model.args.layout.bytes_per_token == per_token
    assert Fraction(state.global_nbytes(), 64) == per_token
    src = model.args.n_encoder
    codes, scales = state.global_entries(f"main.L{src}", 0, 64)
    assert (codes.shape, scales.shape, codes.dtype) == ((64, 64), (64, 8), torch.uint8)
    codes, scales = state.global_entries("index.L2", 0, 32)
    assert (codes.shape, scales.shape) == ((32, 16), (32, 1))


@pytest.mark.parametrize("chunk", [1, 3, 7, 128])
def test_chunked_prefill_equals_one_shot(small: Transformer, chunk: int) -> None:
    toks = tokens(151)  # odd: a pending half pair; > window: the decoder runs over the last 128 only
    ref, ref_state = run(small, toks, chunk_size=1024, all_logits=True)
    out, state = run(small, toks, chunk_size=chunk, all_logits=True)
    assert out.shape == (128, 256)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    assert_states_equal(state, ref_state)
    assert (state.decoder_from, state.rings[4].lo, state.rings[0].lo) == (23, 23, 23)


@pytest.mark.parametrize("chunk", [7, 100])
def test_chunked_prefill_equals_one_shot_default_selection(tiny8: Transformer, chunk: int) -> None:
    toks = tokens(300, seed=1)  # > 32 decoder blocks of 8 and > 32 encoder entries: pool and top-k bite
    ref, ref_state = run(tiny8, toks)
    out, state = run(tiny8, toks, chunk_size=chunk)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    assert_states_equal(state, ref_state)


def test_decode_after_prefill_equals_longer_prefill(small: Transformer) -> None:
    toks = tokens(100, seed=2)
    ref, ref_state = run(small, toks, all_logits=True)  # <= window: the decoder runs everywhere
    state = small.new_state()
    small.prefill(toks[:90], state, chunk_size=16)
    for i in range(90, 100):
        torch.testing.assert_close(small.decode_one_token(int(toks[i]), state), ref[i], rtol=0, atol=1e-6)
    assert_states_equal(state, ref_state)


def test_decode_after_long_prefill_keeps_encoder_and_globals(small: Transformer) -> None:
    # Past the window the decoder's SWA depends on where it started running (CED prefill skips it), so
    # only the encoder side and the global caches must match a one-shot prefill of the longer sequence.
    toks = tokens(203, seed=3)
    _, ref_state = run(small, toks)
    _, state = run(small, toks[:200])
    for t in toks[200:]:
        small.decode_one_token(int(t), state)
    assert_globals_equal(state, ref_state)
    assert_rings_equal(state, ref_state, range(small.args.n_encoder))
    assert (state.decoder_from, ref_state.decoder_from) == (72, 75)


def test_groups_become_visible_exactly_when_complete(small: Transformer) -> None:
    toks = tokens(60, seed=4)
    state = small.new_state()
    for i, t in enumerate(toks):
        small.decode_one_token(int(t), state)
        assert state.n_entries("main.L2") == state.n_entries("index.L2") == (i + 1) // 2
        assert state.n_entries("main.L4") == i + 1
        assert (2 in state.pending) == (i % 2 == 0)  # a trailing odd token waits for its pair
    # One shot: later groups are already in the cache while earlier queries run; they must stay hidden.
    every, _ = run(small, toks, all_logits=True)
    for p in (0, 1, 10, 11, 40, 41):
        torch.testing.assert_close(every[p], run(small, toks[:p + 1])[0], rtol=0, atol=1e-6)



def test_group_is_visible_to_the_token_that_completes_it(tiny8: Transformer) -> None:
    toks = tokens(30, seed=4)  # <= 32 entries per cache: every visible entry is selected
    _, state = run(tiny8, toks)
    for name, entry in (("main.L2", 14), ("main.L4", 29)):  # completed by token 29
        clean, dirty = resumed(tiny8, state), resumed(tiny8, state)
        codes, scales = dirty.global_entries(name, entry, entry + 1)
        dirty.load_global(name, codes ^ 0x77, scales, start=entry)
        assert not torch.equal(tiny8.replay(clean, toks[29:], 29), tiny8.replay(dirty, toks[29:], 29))


def test_reuse_layers_run_no_indexer(small: Transformer) -> None:
    state = run(small, tokens(70))[1]
    calls: list[tuple[int, tuple[int, ...]]] = []  # (layer, shape of the keys its indexer scored)
    selections: dict[int, object] = {}
    hooks = []
    for i, layer in enumerate(small.layers):
        attn = layer.attention
        if attn.indexer is not None:
            hooks.append(attn.indexer.register_forward_hook(
                lambda _m, args, _o, i=i: calls.append((i, tuple(args[2].shape)))))
        hooks.append(attn.register_forward_hook(
            lambda _m, args, _o, i=i: selections.__setitem__(i, args[4].get("topk"))))
    try:
        small.decode_one_token(5, state)
    finally:
        for h in hooks:
            h.remove()
    modes = small.args.modes
    assert [i for i, _ in calls] == [i for i, mode in enumerate(modes) if mode in ("F", "F*", "X")]
    # Full layers score every entry of their cache; the Reindex layer only the decoder pool.
    assert calls == [(2, (35, 32)), (4, (71, 32)), (6, (1, 4 * 8, 32))]
    for i, mode in enumerate(modes):
        if mode == "U":
            assert small.layers[i].attention.indexer is None
            assert selections[i] is selections[i - 1]  # the latest top-k, taken as it is
        elif mode != "S":
            assert selections[i] is not selections[i - 1]


def test_exact_replay_tiny16_reproduces_never_evicted(tiny16: Transformer) -> None:
    n, r = 2101, 16 * 128  # odd n: the pending half pair is rebuilt; odd start: a straddling pair
    toks = tokens(n, seed=5)
    ref, ref_state = run(tiny16, toks)
    state = resumed(tiny16, ref_state)
    out = tiny16.replay(state, toks[n - r:], n - r)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert_states_equal(state, ref_state)
    for t in (7, 8):  # decoding completes the pair from the rebuilt pending token
        torch.testing.assert_close(tiny16.decode_one_token(t, state), tiny16.decode_one_token(t, ref_state),
                                   rtol=0, atol=1e-5)
    assert_states_equal(state, ref_state)


def test_exact_replay_tiny8_after_decoding_and_partial_load(tiny8: Transformer) -> None:
    n, r = 1100, 8 * 128
    toks = tokens(n + 5, seed=6)
    _, ref_state = run(tiny8, toks[:n])
    ref = [tiny8.decode_one_token(int(t), ref_state) for t in toks[n:]][-1]
    # The store holds entries for tokens [0, 900) only; replay writes the rest, keeps what was loaded.
    state = resumed(tiny8, ref_state, upto=900)
    out = tiny8.replay(state, toks[-r:], n + 5 - r, decoder_from=ref_state.decoder_from)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert_states_equal(state, ref_state)


def test_bounded_replay_equals_exact_for_short_sessions(tiny8: Transformer) -> None:
    for n in (100, 127):
        toks = tokens(n, seed=n)
        ref, ref_state = run(tiny8, toks)
        bounded, exact = resumed(tiny8, ref_state), resumed(tiny8, ref_state)
        b_out = tiny8.replay(bounded, toks[-128:], max(0, n - 128))
        e_out = tiny8.replay(exact, toks[-1024:], max(0, n - 1024))
        assert torch.equal(b_out, e_out)
        torch.testing.assert_close(b_out, ref, rtol=0, atol=1e-6)
        assert_states_equal(bounded, exact)
        assert_states_equal(bounded, ref_state)


def test_bounded_replay_is_truncated_and_writes_no_globals(tiny8: Transformer) -> None:
    toks = tokens(400, seed=7)
    ref, ref_state = run(tiny8, toks)
    state = resumed(tiny8, ref_state)
    out = tiny8.replay(state, toks[-128:], 272)
    assert not torch.equal(out, ref)  # the first replayed tokens see a truncated window
    assert all((ring.lo, ring.hi) == (272, 400) for ring in state.rings)
    assert_globals_equal(state, ref_state)
    # An entry inside the replayed span is kept as loaded, never re-encoded.
    dirty = resumed(tiny8, ref_state)
    codes, scales = dirty.global_entries("main.L2", 150, 151)
    dirty.load_global("main.L2", codes ^ 0x11, scales, start=150)
    tiny8.replay(dirty, toks[-128:], 272)
    assert torch.equal(dirty.global_entries("main.L2", 150, 151)[0], codes ^ 0x11)


def test_replay_and_load_reject_bad_input(tiny8: Transformer) -> None:
    toks = tokens(200, seed=8)
    _, ref_state = run(tiny8, toks)
    with pytest.raises(ValueError, match="entries loaded"):
        tiny8.replay(resumed(tiny8, ref_state, upto=40), toks[-128:], 72)  # entries [36, 72) missing
    state = tiny8.new_state()
    codes, scales = ref_state.global_entries("main.L2", 0, 10)
    with pytest.raises(ValueError, match="hole"):
        state.load_global("main.L2", codes, scales, start=5)
    with pytest.raises(ValueError, match="expected codes"):
        state.load_global("main.L2", codes[:, :32], scales)
    with pytest.raises(ValueError, match="unknown cache"):
        state.load_global("main.L3", codes, scales)
    with pytest.raises(ValueError):
        ref_state.global_entries("main.L2", 0, 101)


def test_checkpoint_round_trip(tiny8: Transformer, tmp_path: Path) -> None:
    toks = tokens(50, seed=9)
    path = tmp_path / "tiny8.safetensors"
    tiny8.save_checkpoint(path)
    loaded = Transformer.load_checkpoint(path)
    assert loaded.args == tiny8.args
    assert torch.equal(run(loaded, toks)[0], run(tiny8, toks)[0])
    assert torch.equal(run(Transformer(ModelArgs.tiny8(), seed=0), toks)[0], run(tiny8, toks)[0])
    assert not torch.equal(run(Transformer(ModelArgs.tiny8(), seed=1), toks)[0], run(tiny8, toks)[0])
