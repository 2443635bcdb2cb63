"""Codecs against an independent reference built on ml_dtypes (float4_e2m1fn, float8_e4m3fn)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvstore.format import quant

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def ref_fp4(x: torch.Tensor, block: int, e4m3_scale: bool) -> tuple[np.ndarray, np.ndarray]:
    """The paper's reference quantizer, written on numpy + ml_dtypes (no kvstore code)."""
    xs = x.float().numpy().reshape(-1, block)
    amax = np.abs(xs).max(-1)
    if e4m3_scale:
        t = np.minimum(np.maximum(amax, np.float32(6 * 2.0**-9)) / np.float32(6), np.float32(448))
        s8 = t.astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
        sbytes, s = s8.view(np.uint8), s8.astype(np.float32)
    else:
        t = (np.maximum(amax, np.float32(6 * 2.0**-126)) / np.float32(6)).astype(np.float32)
        m, e = np.frexp(t)
        e = np.where(m == 0.5, e - 1, e)
        sbytes, s = (e + 127).astype(np.uint8), np.ldexp(np.float32(1), e).astype(np.float32)
    y = np.clip(xs / s[:, None], -6, 6).astype(np.float32)
    q = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 15
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed.reshape(*x.shape[:-1], -1), sbytes.reshape(*x.shape[:-1], -1)


@pytest.fixture(params=["fused", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run every codec test on the fused C kernel and on the pure-torch path."""
    if request.param == "torch":
        monkeypatch.setattr(quant, "_fp4", None)
    return request.param


def test_fused_kernel_is_built() -> None:
    # CI builds the extension; a silent fallback would hide a 5x slowdown.
    assert quant.has_fused_kernel()


@pytest.mark.parametrize("scale", [1e-7, 1e-3, 0.1, 1.0, 37.0, 1e4, 1e6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_main_and_indexer_bit_exact(path: str, scale: float, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(int(scale * 1000) % 2**31)
    x = (torch.randn(64, 3, 256, generator=g) * scale).to(dtype)
    if not torch.isfinite(x).all():
        pytest.skip("scale overflows this dtype")
    codes, scales = quant.quantize_main(x)
    rc, rs = ref_fp4(x, 16, True)
    assert codes.shape == (64, 3, 128) and scales.shape == (64, 3, 16)
    np.testing.assert_array_equal(codes.numpy(), rc)
    np.testing.assert_array_equal(scales.numpy(), rs)
    codes, scales = quant.quantize_indexer(x)
    rc, rs = ref_fp4(x, 32, False)
    np.testing.assert_array_equal(codes.numpy(), rc)
    np.testing.assert_array_equal(scales.numpy(), rs)


def _ties_block() -> torch.Tensor:
    # a block whose amax is exactly 6 * s for s = 1: every E2M1 tie lands exactly on x / s
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    vals = ties + [-t for t in ties] + [6.0, -0.0]
    return torch.tensor(vals, dtype=torch.float32)


def test_every_e2m1_tie_rounds_to_even(path: str) -> None:
    x = _ties_block()
    codes, scales = quant.quantize_main(x)
    assert scales.view(torch.float8_e4m3fn).float().item() == 1.0
    rc, _ = ref_fp4(x, 16, True)
    np.testing.assert_array_equal(codes.numpy(), rc)
    values = quant.dequantize_main(codes, scales, torch.float32)
    expect = [0, 1, 1, 2, 2, 4, 4, -0.0, -1, -1, -2, -2, -4, -4, 6, -0.0]
    assert values.tolist() == expect


@pytest.mark.parametrize("special", ["zeros", "subnormal", "448", "480", "neg480", "tiny_neg"])
def test_edge_blocks(path: str, special: str) -> None:
    x = torch.randn(4, 32)
    if special == "zeros":
        x = torch.zeros(4, 32)
    elif special == "subnormal":  # amax/6 below E4M3's smallest normal (2^-6): subnormal scale
        x = x / x.abs().max() * 0.05
    elif special == "448":
        x[:, 0] = 448.0
    elif special == "480":
        x[:, 3] = 480.0
    elif special == "neg480":
        x = x * 1e3
        x[:, 5] = -480.0
    elif special == "tiny_neg":
        x = -torch.rand(4, 32) * 1e-30
    for block, e4m3 in ((16, True), (32, False)):
        fn = quant.quantize_main if e4m3 else quant.quantize_indexer
        codes, scales = fn(x)
        rc, rs = ref_fp4(x, block, e4m3)
        np.testing.assert_array_equal(codes.numpy(), rc)
        np.testing.assert_array_equal(scales.numpy(), rs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_raises(path: str, bad: float) -> None:
    x = torch.randn(2, 64)
    x[1, 7] = bad
    for fn in (quant.quantize_main, quant.quantize_indexer, quant.quantize_swa):
        with pytest.raises(ValueError, match="NaN or Inf"):
            fn(x)


def test_shape_that_does_not_divide_raises(path: str) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        quant.quantize_main(torch.randn(3, 24))
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_indexer(torch.randn(3, 48))
    with pytest.raises(ValueError, match="blocks of 16"):
        quant.dequantize_main(torch.zeros(3, 8, dtype=torch.uint8), torch.zeros(3, 2, dtype=torch.uint8))


def test_swa_bit_exact() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 256, generator=g) * torch.logspace(-3, 3, 16).unsqueeze(1)
    codes, scales = quant.quantize_swa(x)
    xs = x.numpy().reshape(-1, 32)
    amax = np.abs(xs).max(-1)
    t = (np.maximum(amax, np.float32(1e-4)) / np.float32(448)).astype(np.float32)
    m, e = np.frexp(t)
    e = np.where(m == 0.5, e - 1, e)
    s = np.ldexp(np.float32(1), e).astype(np.float32)
    q = np.clip(xs / s[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(codes.numpy().reshape(-1, 32), q)
    np.testing.assert_array_equal(scales.numpy().reshape(-1), (e + 127).astype(np.uint8))
    back = quant.dequantize_swa(codes, scales, torch.float32)
    # E4M3 rounds to 3 mantissa bits (relative error <= 2^-4); below 2^-6 * s it is subnormal, with a
    # fixed step of 2^-9 * s, so a small value in a block with a large one may lose more than 7%
    err = (back - x).abs().numpy().reshape(-1, 32)
    assert (err <= np.abs(xs) * 2.0**-4 + s[:, None] * 2.0**-10).all()


finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=32, max_size=32), st.sampled_from(["main", "indexer"]))
@example([0.0] * 31 + [49.0], "indexer")
def test_requantize_is_a_fixed_point_and_error_bounded(vals: list[float], kind: str) -> None:
    x = torch.tensor(vals, dtype=torch.float32)
    q, dq = ((quant.quantize_main, quant.dequantize_main) if kind == "main"
             else (quant.quantize_indexer, quant.dequantize_indexer))
    codes, scales = q(x)
    x_hat = dq(codes, scales, torch.float32)
    codes2, scales2 = q(x_hat)
    # a dequantized block is a fixed point: quantizing it again gives back the same values. For main
    # (E4M3 scale of amax/6) the block's largest code is always 6, so the codes and scale repeat too;
    # the indexer's UE8M0 scale is 2^ceil(log2(amax/6)) (PAPER.md), so a block whose largest code is 3
    # or 4 (49 -> 48 = 3 * 16) requantizes to a smaller scale and other codes of the same values.
    assert torch.equal(dq(codes2, scales2, torch.float32), x_hat)
    if kind == "main":
        assert torch.equal(codes, codes2) and torch.equal(scales, scales2)
    # per-block bound: half the widest E2M1 step (2) times the scale, plus scale rounding headroom
    block = 16 if kind == "main" else 32
    s = dq(torch.full_like(codes, 0x22), scales, torch.float32).view(-1, block)[:, 0]  # value 1.0 * s
    err = (x - x_hat).abs().view(-1, block).amax(-1)
    amax = x.abs().view(-1, block).amax(-1)
    assert bool((err <= torch.maximum(s, amax - 6 * s) + 1e-30).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_paths_agree(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(128, 512) * 3
    codes, scales = quant.quantize_main(x)
    fused = quant.dequantize_main(codes, scales, dtype)
    monkeypatch.setattr(quant, "_fp4", None)
    assert torch.equal(fused, quant.dequantize_main(codes, scales, dtype))
    ref = torch.tensor(E2M1)[torch.stack([codes & 15, codes >> 4], -1).long()].view(128, 32, 16)
    ref = ref * scales.view(torch.float8_e4m3fn).float().unsqueeze(-1)
    assert torch.equal(fused.float(), ref.view(128, 512))
