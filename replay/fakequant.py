"""Straight-through fake quantization: the cache formats of ../shared/PAPER.md as float round trips.

Each function returns exactly ``dequantize(quantize(x))`` of ``kvstore.format.quant`` (tests/replay/test_train.py checks
it bit for bit) without packing codes, and lets the gradient through unchanged (straight-through estimator),
so the training forward (replay/dense.py) sees the same numbers the inference caches hold.
"""

from __future__ import annotations

import torch
from torch import Tensor

_E2M1_MAGS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # odd ones round *up* to the even code above


def _e2m1(y: Tensor) -> Tensor:
    """float32 y with |y| <= 6 -> the nearest E2M1 value, ties to even (quant._e2m1_codes' rule)."""
    v = y.abs()
    idx = torch.zeros(v.shape, dtype=torch.long, device=v.device)
    for i, t in enumerate(_E2M1_TIES):
        idx += (v >= t) if i % 2 else (v > t)
    mags = torch.tensor(_E2M1_MAGS, dtype=torch.float32, device=y.device)[idx]
    return torch.where(torch.signbit(y), -mags, mags)


def _ue8m0_ceil(t: Tensor) -> Tensor:
    """2^ceil(log2 t), exactly (frexp, as quant._ue8m0_ceil)."""
    mant, exp = torch.frexp(t)
    e = torch.where(mant == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(t), e)


def _blocks(x: Tensor, block: int) -> Tensor:
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _ste(x: Tensor, q: Tensor) -> Tensor:
    q = q.reshape(x.shape).to(x.dtype)
    return x + (q - x).detach() if x.requires_grad else q


def fq_main(x: Tensor) -> Tensor:
    """Main KV: FP4 E2M1, one E4M3 scale per 16 channels. x: [..., D]."""
    xb = _blocks(x, 16)
    t = (xb.abs().amax(-1).clamp_min(6.0 * 2.0**-9) / 6.0).clamp_max(448.0)
    s = t.to(torch.float8_e4m3fn).float().unsqueeze(-1)
    return _ste(x, _e2m1((xb / s).clamp(-6.0, 6.0)) * s)


def fq_indexer(x: Tensor) -> Tensor:
    """Indexer K: FP4 E2M1, one UE8M0 scale per 32 channels. x: [..., D]."""
    xb = _blocks(x, 32)
    s = _ue8m0_ceil(xb.abs().amax(-1).clamp_min(6.0 * 2.0**-126) / 6.0).unsqueeze(-1)
    return _ste(x, _e2m1((xb / s).clamp(-6.0, 6.0)) * s)


def fq_swa(x: Tensor) -> Tensor:
    """SWA KV: FP8 E4M3, one UE8M0 scale per 32 channels. x: [..., D]."""
    xb = _blocks(x, 32)
    s = _ue8m0_ceil(xb.abs().amax(-1).clamp_min(1e-4) / 448.0).unsqueeze(-1)
    return _ste(x, (xb / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s)
