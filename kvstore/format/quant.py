"""Bit-exact codecs for the cache formats of ../shared/PAPER.md.

- main KV:   FP4 E2M1, one float8_e4m3fn scale per 16 channels  (``quantize_main``)
- indexer K: FP4 E2M1, one UE8M0 exponent byte per 32 channels  (``quantize_indexer``)
- SWA KV:    FP8 E4M3, one UE8M0 exponent byte per 32 channels  (``quantize_swa``)

Codes are packed two per byte, even element in the low nibble. Every function takes tensors of any
leading shape (bf16/fp16/fp32, CPU or CUDA). Contiguous CPU bf16/fp32 input goes through the fused
C kernel (``kvstore.format._fp4``) when it was built; CUDA tensors through the Triton kernels of
``kvstore.cuda.codecs`` when triton is installed; everything else through the vectorized torch path.
All are bit-exact with each other and with ml_dtypes (tests/format/test_quant.py, tests/format/test_cuda_codecs.py).
"""

from __future__ import annotations

from types import ModuleType

import torch

try:  # the fused kernel is optional: built by `pip install`, absent on exotic platforms
    import kvstore.format._fp4 as _fp4
except ImportError:  # pragma: no cover - exercised only where the C build failed
    _fp4 = None

E2M1_MAX = 6.0
E4M3_MAX = 448.0
MAIN_BLOCK = 16
INDEX_BLOCK = 32
SWA_BLOCK = 32

# E2M1 magnitudes of codes 0-7; 8-15 are the negatives. Thresholds between neighbours: a value
# strictly above a threshold moves up one code; a value equal to it rounds to the even code.
_E2M1_MAGS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _lut(device: torch.device) -> torch.Tensor:
    mags = torch.tensor(_E2M1_MAGS, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def _check(x: torch.Tensor, block: int, what: str) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{what}: expected a bf16/fp16/fp32 tensor, got {x.dtype}")
    if x.ndim == 0 or x.shape[-1] % block:
        raise ValueError(f"{what}: last dim {tuple(x.shape)[-1:]} is not a multiple of {block}")


def _nonfinite(what: str) -> ValueError:
    return ValueError(f"{what}: input holds NaN or Inf")


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """float32 ``y`` with |y| <= 6 -> uint8 E2M1 codes (sign in bit 3), ties to even."""
    v = y.abs()
    mag = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for i, t in enumerate(_E2M1_TIES):
        # odd thresholds (index 1, 3, 5) are ties that round *up* to the even code above them
        mag += (v >= t) if i % 2 else (v > t)
    return mag | (torch.signbit(y).to(torch.uint8) << 3)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_values(packed: torch.Tensor) -> torch.Tensor:
    lut = _lut(packed.device)
    lo = lut[(packed & 15).long()]
    hi = lut[(packed >> 4).long()]
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def _ue8m0_ceil(t: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 t) as exponent bytes (bias 127), exactly: frexp instead of a rounded log2."""
    mant, exp = torch.frexp(t)  # t = mant * 2^exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)
    return (e + 127).to(torch.uint8)


def _ue8m0_value(s: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(s, dtype=torch.float32), s.to(torch.int32) - 127)


def _cuda_codecs(t: torch.Tensor) -> ModuleType | None:
    """The Triton kernels for a CUDA tensor when triton is installed, else None (torch path)."""
    if t.device.type != "cuda":
        return None
    from kvstore.cuda import codecs

    return codecs if codecs.available() else None


def _use_kernel(x: torch.Tensor) -> bool:
    return _fp4 is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)


def _fp4_quantize(x: torch.Tensor, block: int, scale_kind: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, block, what)
    lead, d = tuple(x.shape[:-1]), x.shape[-1]
    if (cuda := _cuda_codecs(x)) is not None:
        return cuda.quantize_fp4(x, block, scale_kind == 0, what)
    if _use_kernel(x):
        x = x.contiguous()
        codes = torch.empty((*lead, d // 2), dtype=torch.uint8)
        scales = torch.empty((*lead, d // block), dtype=torch.uint8)
        ok = _fp4.quantize(x.data_ptr(), int(x.dtype == torch.bfloat16), x.numel() // block, block,
                           scale_kind, codes.data_ptr(), scales.data_ptr(), torch.get_num_threads())
        if not ok:
            raise _nonfinite(what)
        return codes, scales
    xb = x.float().reshape(*lead, d // block, block)
    amax = xb.abs().amax(-1)
    if not bool(torch.isfinite(amax).all()):
        raise _nonfinite(what)
    if scale_kind == 0:
        t = (amax.clamp_min(E2M1_MAX * 2.0**-9) / E2M1_MAX).clamp_max(E4M3_MAX)
        s8 = t.to(torch.float8_e4m3fn)
        scales, s = s8.view(torch.uint8), s8.float()
    else:
        scales = _ue8m0_ceil(amax.clamp_min(E2M1_MAX * 2.0**-126) / E2M1_MAX)
        s = _ue8m0_value(scales)
    y = (xb / s.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    return _pack(_e2m1_codes(y).reshape(*lead, d)), scales


def _fp4_dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int, scale_kind: int,
                    dtype: torch.dtype, what: str) -> torch.Tensor:
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{what}: codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    d = codes.shape[-1] * 2
    if d % block or scales.shape[-1] != d // block or codes.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"{what}: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not "
                         f"describe blocks of {block}")
    lead = tuple(codes.shape[:-1])
    if (cuda := _cuda_codecs(codes)) is not None and dtype in cuda.DTYPES:
        return cuda.dequantize_fp4(codes, scales, block, scale_kind == 0, dtype)
    if _fp4 is not None and codes.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        codes, scales = codes.contiguous(), scales.contiguous()
        out = torch.empty((*lead, d), dtype=dtype)
        _fp4.dequantize(codes.data_ptr(), scales.data_ptr(), out.numel() // block, block, scale_kind,
                        out.data_ptr(), int(dtype == torch.bfloat16), torch.get_num_threads())
        return out
    if scale_kind == 0:
        s = scales.view(torch.float8_e4m3fn).float()
    else:
        s = _ue8m0_value(scales)
    vals = _unpack_values(codes).reshape(*lead, d // block, block) * s.unsqueeze(-1)
    return vals.reshape(*lead, d).to(dtype)


def quantize_main(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Main KV: ``x [..., D]`` -> (codes ``uint8 [..., D/2]``, scales ``uint8 [..., D/16]`` E4M3 bits)."""
    return _fp4_quantize(x, MAIN_BLOCK, 0, "quantize_main")


def dequantize_main(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`quantize_main`: ``value(code) * scale`` in ``dtype``."""
    return _fp4_dequantize(codes, scales, MAIN_BLOCK, 0, dtype, "dequantize_main")


def quantize_indexer(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer K: ``x [..., D]`` -> (codes ``uint8 [..., D/2]``, UE8M0 scales ``uint8 [..., D/32]``)."""
    return _fp4_quantize(x, INDEX_BLOCK, 1, "quantize_indexer")


def dequantize_indexer(codes: torch.Tensor, scales: torch.Tensor,
                       dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`quantize_indexer`."""
    return _fp4_dequantize(codes, scales, INDEX_BLOCK, 1, dtype, "dequantize_indexer")


def quantize_swa(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SWA KV: ``x [..., D]`` -> (FP8 E4M3 codes ``uint8 [..., D]``, UE8M0 scales ``uint8 [..., D/32]``)."""
    _check(x, SWA_BLOCK, "quantize_swa")
    if (cuda := _cuda_codecs(x)) is not None:
        return cuda.quantize_fp8(x, SWA_BLOCK, "quantize_swa")
    lead, d = tuple(x.shape[:-1]), x.shape[-1]
    xb = x.float().reshape(*lead, d // SWA_BLOCK, SWA_BLOCK)
    amax = xb.abs().amax(-1)
    if not bool(torch.isfinite(amax).all()):
        raise _nonfinite("quantize_swa")
    scales = _ue8m0_ceil(amax.clamp_min(1e-4) / E4M3_MAX)
    y = (xb / _ue8m0_value(scales).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8).reshape(*lead, d), scales


def dequantize_swa(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`quantize_swa`."""
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError("dequantize_swa: codes and scales must be uint8")
    lead, d = tuple(codes.shape[:-1]), codes.shape[-1]
    if d % SWA_BLOCK or scales.shape[-1] != d // SWA_BLOCK:
        raise ValueError(f"dequantize_swa: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} "
                         f"do not describe blocks of {SWA_BLOCK}")
    if (cuda := _cuda_codecs(codes)) is not None and dtype in cuda.DTYPES:
        return cuda.dequantize_fp8(codes, scales, SWA_BLOCK, dtype)
    v = codes.view(torch.float8_e4m3fn).float().reshape(*lead, d // SWA_BLOCK, SWA_BLOCK)
    return (v * _ue8m0_value(scales).unsqueeze(-1)).reshape(*lead, d).to(dtype)


def has_fused_kernel() -> bool:
    """Whether the fused C kernels were built (the torch path is used otherwise)."""
    return _fp4 is not None
