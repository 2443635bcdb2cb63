"""The Triton codecs (kvstore.cuda) against the CPU reference: kvstore.format.quant on CPU tensors, itself
bit-exact with ml_dtypes (tests/format/test_quant.py). Every format, both directions, bit for bit.

Where to run: on a CUDA machine the kernels run on the GPU, in this process. Without one, the
same tests run on CPU tensors under Triton's interpreter in a child pytest: TRITON_INTERPRET is
read when ``@triton.jit`` decorates, i.e. when kvstore.cuda.kernels is first imported, which only
a fresh process guarantees. Without triton they skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvstore.cuda import codecs
from kvstore.format import quant

DEVICE_ENV = "KVSTORE_CODEC_TEST_DEVICE"
HAS_TRITON = codecs.available()
DEVICE = os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "")
on_device = pytest.mark.skipif(
    not (DEVICE and HAS_TRITON),
    reason="triton is not installed" if not HAS_TRITON else
    "no CUDA here: these run under Triton's interpreter, in test_kernels_under_interpreter")

TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
FORMATS: dict[str, tuple[int, Quantize, Quantize]] = {
    "main": (16, quant.quantize_main, lambda x: codecs.quantize_fp4(x, 16, True, "quantize_main")),
    "indexer": (32, quant.quantize_indexer, lambda x: codecs.quantize_fp4(x, 32, False, "quantize_indexer")),
    "swa": (32, quant.quantize_swa, lambda x: codecs.quantize_fp8(x, 32, "quantize_swa")),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_quantize_exact(x: torch.Tensor, fmt: str) -> None:
    """The kernel's codes and scales for ``x`` equal the CPU path's, and so do their dequantizations."""
    _, reference, kernel = FORMATS[fmt]
    codes, scales = kernel(x.to(DEVICE))
    ref_codes, ref_scales = reference(x.cpu())
    assert torch.equal(codes.cpu(), ref_codes), fmt
    assert torch.equal(scales.cpu(), ref_scales), fmt
    assert_dequantize_exact(ref_codes, ref_scales, fmt)


def assert_dequantize_exact(codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> None:
    block = FORMATS[fmt][0]
    for dtype in DTYPES:
        if fmt == "swa":
            ref = quant.dequantize_swa(codes, scales, dtype)
            out = codecs.dequantize_fp8(codes.to(DEVICE), scales.to(DEVICE), block, dtype)
        else:
            ref = (quant.dequantize_main if fmt == "main" else quant.dequantize_indexer)(codes, scales, dtype)
            out = codecs.dequantize_fp4(codes.to(DEVICE), scales.to(DEVICE), block, fmt == "main", dtype)
        assert out.dtype == dtype and out.shape == ref.shape
        assert torch.equal(_bits(out.cpu()), _bits(ref)), (fmt, dtype)


def finite_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = x.to(dtype)
    return torch.where(torch.isfinite(y), y, torch.zeros_like(y))


def edge_values(block: int) -> torch.Tensor:
    """float32 blocks that hit every rounding edge of the three formats."""
    e4m3 = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every positive scale
    ties = torch.tensor([*TIES, *(-t for t in TIES), 6.0, -0.0])
    pow2 = torch.tensor([2.0**k for k in range(-126, 127, 3)])
    rows = [ties * s for s in torch.cat([e4m3, pow2])]  # ties exactly on x / s, E4M3 subnormal scales too
    for r in list(rows[:: 7]):
        rb = r.view(torch.int32)
        rows += [(rb + 1).view(torch.float32), (rb - 1).view(torch.float32)]  # one ulp either side of each tie
    mid = torch.arange(0, 0x7E, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (mid[:-1] + mid[1:]) / 2  # E4M3 midpoints beside 448: SWA ties at scale 1
    specials = torch.tensor([448.0, -448.0, 480.0, -480.0, 2688.0, -3000.0, 0.0, -0.0, 1e-40, -1e-44,
                             1e-38, 3e38, -1e38, 1.5e-45, 65504.0, 6e-8])
    flat = torch.cat([*rows, mids, torch.tensor([448.0]), specials, torch.zeros(block), -torch.zeros(block)])
    flat = torch.cat([flat, torch.zeros(-flat.numel() % block)])
    return flat.reshape(-1, block)


@on_device
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_random_inputs_bit_exact(fmt: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(11)
    exps = torch.randint(-40, 40, (48, 1), generator=g).float() if dtype != torch.float16 else torch.zeros(48, 1)
    x = torch.randn(48, 256, generator=g) * torch.exp2(exps)
    assert_quantize_exact(finite_as(x, dtype), fmt)


@on_device
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_edge_inputs_bit_exact(fmt: str, dtype: torch.dtype) -> None:
    assert_quantize_exact(finite_as(edge_values(FORMATS[fmt][0]), dtype), fmt)


@on_device
@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
def test_main_float64_division_is_exact_too(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.cat([edge_values(16), torch.randn(64, 16, generator=g) * 100])
    x = finite_as(x, dtype)
    got = codecs.quantize_fp4(x.to(DEVICE), 16, True, "q", codecs.KernelConfig(div64=True))
    ref = quant.quantize_main(x)
    assert torch.equal(got[0].cpu(), ref[0]) and torch.equal(got[1].cpu(), ref[1])


@on_device
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_code_and_scale_dequantizes_exactly(fmt: str) -> None:
    g = torch.Generator().manual_seed(5)
    block = FORMATS[fmt][0]
    width = 64 if fmt == "swa" else 32
    codes = torch.randint(0, 256, (96, width), dtype=torch.uint8, generator=g)
    codes[0] = torch.arange(width, dtype=torch.uint8) * (256 // width) + torch.arange(width, dtype=torch.uint8) % 4
    n_scales = codes.shape[-1] * (1 if fmt == "swa" else 2) // block
    if fmt == "main":  # any E4M3 scale but NaN, negative ones included
        scales = torch.randint(0, 256, (96, n_scales), dtype=torch.uint8, generator=g)
        scales[(scales & 0x7F) == 0x7F] = 0x7E
    else:  # the UE8M0 bytes a quantizer can emit: 2^-126 ... 2^127
        scales = torch.randint(1, 255, (96, n_scales), dtype=torch.uint8, generator=g)
        scales[0, :2] = torch.tensor([1, 254], dtype=torch.uint8)
    if fmt == "swa":
        codes[(codes & 0x7F) == 0x7F] = 0x7E  # E4M3 NaN: bit patterns of NaN need not agree
    assert_dequantize_exact(codes, scales, fmt)


@on_device
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_raises_the_cpu_error(fmt: str, bad: float) -> None:
    _, reference, kernel = FORMATS[fmt]
    for dtype in DTYPES:
        x = torch.ones(3, 5, 64, dtype=dtype)
        x[2, 4, 63] = bad
        with pytest.raises(ValueError) as cpu:
            reference(x)
        with pytest.raises(ValueError, match="NaN or Inf") as dev:
            kernel(x.to(DEVICE))
        assert str(dev.value) == str(cpu.value)


@on_device
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_any_leading_shape_and_layout(fmt: str) -> None:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(64, 96, generator=g)
    for x in (base[0], base.reshape(2, 3, 2, 512)[:, 1], base.t(), base[:0]):
        assert_quantize_exact(x.contiguous() if x.shape[-1] % 32 else x, fmt)


@pytest.mark.skipif(DEVICE != "cuda" or not HAS_TRITON, reason="needs CUDA and triton")
@pytest.mark.parametrize("config", [codecs.KernelConfig(64, 4), codecs.KernelConfig(256, 8)])
def test_quant_dispatches_cuda_tensors_and_every_config_is_exact(config: codecs.KernelConfig) -> None:
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for q in (quant.quantize_main, quant.quantize_indexer, quant.quantize_swa):
        got = q(x.cuda())
        assert all(t.is_cuda for t in got) and all(torch.equal(a.cpu(), b) for a, b in zip(got, q(x)))
    for block, e4m3 in ((16, True), (32, False)):
        codes, scales = codecs.quantize_fp4(x.cuda(), block, e4m3, "q", config)
        back = codecs.dequantize_fp4(codes, scales, block, e4m3, torch.bfloat16, config)
        ref = quant._fp4_quantize(x, block, 0 if e4m3 else 1, "q")
        assert torch.equal(codes.cpu(), ref[0]) and torch.equal(scales.cpu(), ref[1])
        assert torch.equal(back.cpu(), quant._fp4_dequantize(*ref, block, 0 if e4m3 else 1, torch.bfloat16, "d"))
    codes, scales = codecs.quantize_fp8(x.cuda(), 32, "q", config)
    assert torch.equal(codecs.dequantize_fp8(codes, scales, 32, torch.bfloat16, config).cpu(),
                       quant.dequantize_swa(*quant.quantize_swa(x)))


@pytest.mark.skipif(bool(DEVICE) or not HAS_TRITON,
                    reason="the kernels run in this process" if DEVICE else "triton is not installed")
def test_kernels_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", DEVICE_ENV: "cpu"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]


def _e2m1_codes(y: np.ndarray) -> np.ndarray:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return np.clip(y, -6, 6).astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 7


def _e4m3_scales() -> np.ndarray:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return np.arange(1, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def test_main_division_shortcuts_are_exact() -> None:
    """The kernels' premises for x / s (s any positive E4M3 value), replayed in numpy:
    - 16-bit inputs: x * float32(1 / s), snapped to the quarter it rounds to when that quarter
      times s gives x back, has the E2M1 code of float32(x / s): for every bf16 and fp16 value;
    - float32 inputs: float32(float64(x) * float64(1 / s)) == float32(x / s), near every tie and at random."""
    bf16 = (np.arange(0, 0x7F80, dtype=np.uint32) << 16).view(np.float32)
    fp16 = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    rng = np.random.default_rng(0)
    big = np.float32(12582912.0)
    with np.errstate(over="ignore"):
        for s in _e4m3_scales():
            for x in (bf16, fp16):
                y = x * (np.float32(1) / s)
                quarter = ((y * np.float32(4) + big) - big) * np.float32(0.25)
                snapped = np.where(quarter * s == x, quarter, y)
                np.testing.assert_array_equal(_e2m1_codes(snapped), _e2m1_codes(x / s))
            near = ((np.array(TIES, np.float32) * s).view(np.int32)[:, None] + np.arange(-40, 41)).ravel()
            x32 = np.concatenate([near.view(np.float32), np.abs(rng.standard_normal(4000)).astype(np.float32) * s * 3])
            y64 = (x32.astype(np.float64) * (1.0 / np.float64(s))).astype(np.float32)
            np.testing.assert_array_equal(y64, x32 / s)
