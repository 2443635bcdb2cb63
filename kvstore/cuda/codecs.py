"""Python side of the Triton codecs: allocation, launch, and the one NaN/Inf check per call.

``kvstore.format.quant`` sends CUDA tensors here when :func:`available`. Triton is imported only when a
kernel is launched, so this module (and ``kvstore.format.quant``) imports on machines without it. Inputs
of any leading shape are flattened to blocks; each program handles ``KernelConfig.blocks`` blocks.

The NaN/Inf check costs one host sync per call, not per block: every program that sees a
non-finite amax writes 1 to a device flag, read once after the launch.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

# how each dtype travels: float32 as int32 bits, 16-bit dtypes as one int32 per pair of elements
_SRC = {torch.float32: (0, torch.int32), torch.bfloat16: (1, torch.int32), torch.float16: (2, torch.int32)}
DTYPES = tuple(_SRC)


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape: ``blocks`` (quantization blocks, a power of two) per program, ``num_warps`` per
    program; ``div64``: the main format divides 16-bit inputs in float64 instead of by a checked
    reciprocal (both exact). Defaults: the best of the sweep in benchmarks/gpu/codecs.py on an H200."""

    blocks: int = 128
    num_warps: int = 4
    div64: bool = False


def available() -> bool:
    """Whether triton is importable (the kernels themselves are compiled on first use)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or shadowed install counts as absent
        return False


def _nonfinite_check(flag: torch.Tensor, what: str) -> None:
    if bool(flag.item()):
        raise ValueError(f"{what}: input holds NaN or Inf")


def _check_scales(codes: torch.Tensor, scales: torch.Tensor, n_blocks: int) -> None:
    if scales.numel() != n_blocks or codes.device != scales.device:
        raise ValueError(f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} ({scales.device}) "
                         f"do not describe {n_blocks} blocks on {codes.device}")


def _grid(n_blocks: int, rows: int) -> tuple[int]:
    return ((n_blocks + rows - 1) // rows,)


def quantize_fp4(x: torch.Tensor, block: int, e4m3: bool, what: str,
                 config: KernelConfig = KernelConfig(), check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (packed E2M1 ``uint8 [..., D/2]``, scale bytes ``uint8 [..., D/block]``).

    ``e4m3`` picks the main format's E4M3 scales, else UE8M0 exponents (indexer). Raises
    ``ValueError`` on NaN/Inf like the CPU path; ``check=False`` skips that sync (benchmarks).
    """
    from kvstore.cuda import kernels

    x = x.contiguous()
    lead, d = tuple(x.shape[:-1]), x.shape[-1]
    codes = torch.empty((*lead, d // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*lead, d // block), dtype=torch.uint8, device=x.device)
    flag = torch.zeros(1, dtype=torch.int32, device=x.device)
    n_blocks, rows = x.numel() // block, config.blocks
    if n_blocks:
        src, view = _SRC[x.dtype]
        kernels.fp4_quantize[_grid(n_blocks, rows)](
            x.view(view), codes, scales, flag, n_blocks,
            BLOCK=block, E4M3=e4m3, SRC=src, ROWS=rows, DIV64=config.div64, num_warps=config.num_warps)
    if check:
        _nonfinite_check(flag, what)
    return codes, scales


def dequantize_fp4(codes: torch.Tensor, scales: torch.Tensor, block: int, e4m3: bool, dtype: torch.dtype,
                   config: KernelConfig = KernelConfig()) -> torch.Tensor:
    """Inverse of :func:`quantize_fp4` into ``dtype`` (float32, bfloat16 or float16)."""
    from kvstore.cuda import kernels

    codes, scales = codes.contiguous(), scales.contiguous()
    d = codes.shape[-1] * 2
    dst, view = _SRC[dtype]
    out = torch.empty((*codes.shape[:-1], d), dtype=dtype, device=codes.device)
    n_blocks, rows = out.numel() // block, config.blocks
    _check_scales(codes, scales, n_blocks)
    if n_blocks:
        kernels.fp4_dequantize[_grid(n_blocks, rows)](
            codes, scales, out.view(view), n_blocks,
            BLOCK=block, E4M3=e4m3, DST=dst, ROWS=rows, num_warps=config.num_warps)
    return out


def quantize_fp8(x: torch.Tensor, block: int, what: str, config: KernelConfig = KernelConfig(),
                 check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """SWA: ``x [..., D]`` -> (E4M3 codes ``uint8 [..., D]``, UE8M0 bytes ``uint8 [..., D/block]``)."""
    from kvstore.cuda import kernels

    x = x.contiguous()
    lead, d = tuple(x.shape[:-1]), x.shape[-1]
    codes = torch.empty((*lead, d), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*lead, d // block), dtype=torch.uint8, device=x.device)
    flag = torch.zeros(1, dtype=torch.int32, device=x.device)
    n_blocks, rows = x.numel() // block, config.blocks
    if n_blocks:
        src, view = _SRC[x.dtype]
        kernels.fp8_quantize[_grid(n_blocks, rows)](
            x.view(view), codes.view(torch.int16), scales, flag, n_blocks, BLOCK=block, SRC=src, ROWS=rows,
            num_warps=config.num_warps)
    if check:
        _nonfinite_check(flag, what)
    return codes, scales


def dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype,
                   config: KernelConfig = KernelConfig()) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8` into ``dtype`` (float32, bfloat16 or float16)."""
    from kvstore.cuda import kernels

    codes, scales = codes.contiguous(), scales.contiguous()
    dst, view = _SRC[dtype]
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    n_blocks, rows = out.numel() // block, config.blocks
    _check_scales(codes, scales, n_blocks)
    if n_blocks:
        kernels.fp8_dequantize[_grid(n_blocks, rows)](
            codes.view(torch.int16), scales, out.view(view), n_blocks,
            BLOCK=block, DST=dst, ROWS=rows, num_warps=config.num_warps)
    return out
