"""The cache codecs of kvstore.format.quant, bit for bit, in a form a CUDA graph can capture.

kvstore.format.quant checks every input for NaN/Inf with a host sync (``bool(tensor)``) and builds its E2M1
lookup table from a Python tuple (a host-to-device copy): neither may run while a graph is captured.
These functions take their device constants from a ``GraphCodecs`` built once, outside any capture, and
never look at values on the host, so a non-finite input is not refused here: it yields garbage codes
(the eager path, which checks, is the one to use where inputs are not trusted). tests/replay/test_fast_decode.py
checks them against kvstore.format.quant on random and edge-case inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvstore.format.quant import E2M1_MAX, E4M3_MAX, INDEX_BLOCK, MAIN_BLOCK, SWA_BLOCK

_E2M1_MAGS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; 8-15 are the negatives
_E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between neighbours; odd ones round up to the even code


def _ue8m0_ceil(t: Tensor) -> Tensor:
    """2^ceil(log2 t) as exponent bytes (bias 127), exactly (frexp, as kvstore.format.quant)."""
    mant, exp = torch.frexp(t)
    return (torch.where(mant == 0.5, exp - 1, exp) + 127).to(torch.uint8)


def _ue8m0_value(s: Tensor) -> Tensor:
    return torch.ldexp(torch.ones_like(s, dtype=torch.float32), s.to(torch.int32) - 127)


class GraphCodecs:
    """The FP4 / FP8 codecs (main, indexer, SWA) with their lookup tables resident on ``device``."""

    def __init__(self, device: torch.device) -> None:
        mags = torch.tensor(_E2M1_MAGS, dtype=torch.float32)
        self.lut = torch.cat([mags, -mags]).to(device)  # code -> E2M1 value
        # E2M1 magnitude code = how many thresholds lie strictly below |y|: the odd thresholds round ties up,
        # so they move down one float32 step (|y| >= t  <=>  |y| > nextafter(t, -inf)).
        ties = torch.tensor(_E2M1_TIES, dtype=torch.float32)
        down = torch.nextafter(ties, torch.full_like(ties, float("-inf")))
        self.bounds = torch.where(torch.arange(len(_E2M1_TIES)) % 2 == 1, down, ties).to(device)
        self.ue8m0 = _ue8m0_value(torch.arange(256, dtype=torch.uint8)).to(device)  # exponent byte -> 2^(b-127)

    def _fp4_quantize(self, x: Tensor, block: int, e4m3_scale: bool) -> tuple[Tensor, Tensor]:
        lead, d = tuple(x.shape[:-1]), x.shape[-1]
        xb = x.float().reshape(*lead, d // block, block)
        amax = xb.abs().amax(-1)
        if e4m3_scale:
            s8 = (amax.clamp_min(E2M1_MAX * 2.0**-9) / E2M1_MAX).clamp_max(E4M3_MAX).to(torch.float8_e4m3fn)
            scales, s = s8.view(torch.uint8), s8.float()
        else:
            scales = _ue8m0_ceil(amax.clamp_min(E2M1_MAX * 2.0**-126) / E2M1_MAX)
            s = self.ue8m0[scales.long()]
        y = (xb / s.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX).reshape(*lead, d)
        codes = torch.bucketize(y.abs(), self.bounds).to(torch.uint8) | (torch.signbit(y).to(torch.uint8) << 3)
        return codes[..., 0::2] | (codes[..., 1::2] << 4), scales

    def _fp4_dequantize(self, codes: Tensor, scales: Tensor, block: int, e4m3_scale: bool,
                        dtype: torch.dtype) -> Tensor:
        lead, d = tuple(codes.shape[:-1]), codes.shape[-1] * 2
        s = scales.view(torch.float8_e4m3fn).float() if e4m3_scale else self.ue8m0[scales.long()]
        vals = torch.stack([self.lut[(codes & 15).long()], self.lut[(codes >> 4).long()]], -1)
        return (vals.reshape(*lead, d // block, block) * s.unsqueeze(-1)).reshape(*lead, d).to(dtype)

    def quantize_main(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self._fp4_quantize(x, MAIN_BLOCK, True)

    def dequantize_main(self, codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
        return self._fp4_dequantize(codes, scales, MAIN_BLOCK, True, dtype)

    def quantize_indexer(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self._fp4_quantize(x, INDEX_BLOCK, False)

    def dequantize_indexer(self, codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
        return self._fp4_dequantize(codes, scales, INDEX_BLOCK, False, dtype)

    def quantize_swa(self, x: Tensor) -> tuple[Tensor, Tensor]:
        lead, d = tuple(x.shape[:-1]), x.shape[-1]
        xb = x.float().reshape(*lead, d // SWA_BLOCK, SWA_BLOCK)
        scales = _ue8m0_ceil(xb.abs().amax(-1).clamp_min(1e-4) / E4M3_MAX)
        y = (xb / self.ue8m0[scales.long()].unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
        return y.to(torch.float8_e4m3fn).view(torch.uint8).reshape(*lead, d), scales

    def dequantize_swa(self, codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
        lead, d = tuple(codes.shape[:-1]), codes.shape[-1]
        v = codes.view(torch.float8_e4m3fn).float().reshape(*lead, d // SWA_BLOCK, SWA_BLOCK)
        return (v * self.ue8m0[scales.long()].unsqueeze(-1)).reshape(*lead, d).to(dtype)
