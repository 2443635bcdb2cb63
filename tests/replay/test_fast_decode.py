"""replay/fast_decode.py and replay/graph_codecs.py: the static-shape, sync-free step equals the eager path
bit for bit on CPU (logits, packed global caches, SWA rings, pending tokens); CUDA graphs where there is CUDA."""

from __future__ import annotations

import pytest
import torch

from kvstore.format import quant
from replay.cache import SessionState
from replay.fast_decode import FastDecodeConfig, FastDecoder
from replay.graph_codecs import GraphCodecs
from replay.model import ModelArgs, Transformer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def assert_same(a: SessionState, b: SessionState) -> None:
    assert (a.pos, a.decoder_from) == (b.pos, b.decoder_from)
    for name, ca in a.caches.items():
        cb = b.caches[name]
        assert ca.n == cb.n, name
        for x, y in ((ca.codes, cb.codes), (ca.scales, cb.scales), (ca.values, cb.values)):
            assert torch.equal(x[:ca.n], y[:cb.n]), name
    for i, (ra, rb) in enumerate(zip(a.rings, b.rings, strict=True)):
        assert (ra.lo, ra.hi) == (rb.lo, rb.hi), f"layer {i}"
        assert all(torch.equal(x, y) for x, y in zip(ra.entries(), rb.entries(), strict=True)), f"layer {i}"
    assert a.pending.keys() == b.pending.keys()
    for layer, (kv, z, p) in a.pending.items():
        kv2, z2, p2 = b.pending[layer]
        assert p == p2 and torch.equal(kv, kv2) and torch.equal(z, z2), f"layer {layer}"


def load(model: Transformer, src: SessionState, dst: SessionState, upto: int) -> None:
    for spec in model.args.layout.caches:
        dst.load_global(spec.name, *src.global_entries(spec.name, 0, upto // spec.m))


@pytest.mark.parametrize("fmt", ["main", "indexer", "swa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_codecs_match_kvstore_quant(fmt: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=gen) * torch.logspace(-9, 3, 256)[:, None]
    edges = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0, -0.0, 448.0, -448.0, 1e-40, -3.0, 7.0, 1.0])
    x = torch.cat([x, edges.repeat(8)[None] * 2.0 ** torch.arange(-12, 12)[:, None]]).to(dtype)
    g = GraphCodecs(torch.device("cpu"))
    q, dq = getattr(quant, f"quantize_{fmt}"), getattr(quant, f"dequantize_{fmt}")
    gq, gdq = getattr(g, f"quantize_{fmt}"), getattr(g, f"dequantize_{fmt}")
    want, got = q(x), gq(x)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert torch.equal(dq(*want, torch.float32), gdq(*got, torch.float32))


@pytest.mark.parametrize(("args", "n0"), [(ModelArgs.tiny16(), 261), (ModelArgs.tiny16(exclude_in_window=True), 3),
                                          (ModelArgs.tiny8(top_k=8, pool_blocks=4), 0)])
def test_decode_equals_eager(args: ModelArgs, n0: int) -> None:
    """Prefilled eagerly (an odd length leaves a pending token), then decoded token by token, across
    ring wrap-around, the first complete pool and m=2 group boundaries: identical at every step."""
    model = Transformer(args, seed=1)
    fast = FastDecoder(model, FastDecodeConfig(max_len=512, graphs=False))
    toks = tokens(n0 + 40, seed=2)
    eager, state = model.new_state(), fast.new_state()
    if n0:
        model.prefill(toks[:n0], eager)
        model.prefill(toks[:n0], state)
    for t in toks[n0:].tolist():
        assert torch.equal(model.decode_one_token(t, eager), fast.decode_one_token(t, state))
        assert_same(eager, state)


@pytest.mark.parametrize(("replayed", "loaded"), [(128, 300), (128, 256), (131, 256), (300, 256), (40, 300)])
def test_replay_equals_eager(replayed: int, loaded: int) -> None:
    """Bounded, exact-length and partly-loaded replays (in steps of 128 and a remainder), then decoding."""
    model = Transformer(ModelArgs.tiny16(), seed=0)
    fast = FastDecoder(model, FastDecodeConfig(max_len=1024, graphs=False))
    toks = tokens(300, seed=1)
    saved = model.new_state()
    model.prefill(toks, saved)
    eager, state = model.new_state(), fast.new_state()
    load(model, saved, eager, loaded)
    load(model, saved, state, loaded)
    span = toks[300 - replayed:]
    assert torch.equal(model.replay(eager, span, 300 - replayed), fast.replay(state, span, 300 - replayed))
    assert_same(eager, state)
    for t in (7, 8, 9):
        assert torch.equal(model.decode_one_token(t, eager), fast.decode_one_token(t, state))
    assert_same(eager, state)


def test_gemv_projections_stay_close_to_eager() -> None:
    """exact_gemm=False: one token's projections unpadded, so their sums go in another order (and now and
    then an FP4/FP8 code flips): close to the eager path, not identical."""
    model = Transformer(ModelArgs.tiny16(), seed=0)
    fast = FastDecoder(model, FastDecodeConfig(max_len=512, graphs=False, exact_gemm=False))
    toks = tokens(280, seed=1)
    eager, state = model.new_state(), fast.new_state()
    model.prefill(toks[:261], eager)
    model.prefill(toks[:261], state)
    for t in toks[261:].tolist():
        torch.testing.assert_close(fast.decode_one_token(t, state), model.decode_one_token(t, eager),
                                   rtol=0, atol=1e-2)


def test_only_its_own_state_and_capacity() -> None:
    model = Transformer(ModelArgs.tiny8(), seed=0)
    fast = FastDecoder(model, FastDecodeConfig(max_len=64, graphs=False))
    with pytest.raises(ValueError, match="own state"):
        fast.decode_one_token(1, model.new_state())
    state = fast.new_state()
    model.prefill(tokens(63, seed=0), state)
    fast.decode_one_token(1, state)
    with pytest.raises(ValueError, match="tokens"):
        fast.decode_one_token(1, state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_equal_eager_on_the_gpu() -> None:
    """Graph replay equals the same static step run eagerly, and stays close to the eager model path
    (cuBLAS may pick other kernels for other shapes); a device token needs no host round trip."""
    model = Transformer(ModelArgs.tiny16(), seed=0, device="cuda")
    toks = tokens(700, seed=3).cuda()
    runs = []
    for graphs in (False, True):
        fast = FastDecoder(model, FastDecodeConfig(max_len=1024, graphs=graphs))
        state = fast.new_state()
        model.prefill(toks[:600], state)
        logits = [fast.replay(state, toks[600 - 128:600], 600 - 128)]
        logits += [fast.decode_one_token(t, state) for t in toks[600:700]]
        runs.append(torch.stack(logits))
    assert torch.equal(runs[0], runs[1])
    eager = model.new_state()
    model.prefill(toks[:600], eager)
    want = torch.stack([model.replay(eager, toks[600 - 128:600], 600 - 128)]
                       + [model.decode_one_token(t, eager) for t in toks[600:700]])
    torch.testing.assert_close(runs[1], want, rtol=1e-3, atol=1e-3)
