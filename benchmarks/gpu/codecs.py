"""Codec kernels on CUDA against the device's own copy bandwidth (issue 11, item 1).

    python -c "from benchmarks.gpu.codecs import run; print(run()[0])"

For bf16 ``[1M, 512]``: each format (main, indexer, SWA) and direction through the public API
(``kvstore.format.quant`` on a CUDA tensor: the Triton kernel plus its one NaN/Inf check), and each
kernel alone over a small set of launch shapes. Effective bandwidth counts bytes read plus bytes
written; the ceiling is a large device-to-device ``copy_`` timed the same way in the same run.
Bit-exactness: the first 64K rows of every output against the CPU reference (kvstore.format.quant on CPU).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.common import markdown_table
from kvstore.cuda import codecs
from kvstore.cuda.codecs import KernelConfig
from kvstore.format import quant

ROWS, DIM = 1 << 20, 512
CHECK_ROWS = 1 << 16
TARGET = 0.7
CONFIGS = (KernelConfig(64, 4), KernelConfig(128, 4), KernelConfig(128, 8), KernelConfig(256, 4),
           KernelConfig(256, 8), KernelConfig(128, 4, div64=True))
Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Format:
    name: str
    block: int
    code_bytes: float  # per element
    api_q: Callable[[torch.Tensor], Pair]
    api_dq: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    kern_q: Callable[[torch.Tensor, KernelConfig], Pair]
    kern_dq: Callable[[torch.Tensor, torch.Tensor, KernelConfig], torch.Tensor]


FORMATS = (
    Format("main (FP4, E4M3/16)", 16, 0.5, quant.quantize_main, quant.dequantize_main,
           lambda x, c: codecs.quantize_fp4(x, 16, True, "q", c, check=False),
           lambda q, s, c: codecs.dequantize_fp4(q, s, 16, True, torch.bfloat16, c)),
    Format("indexer (FP4, UE8M0/32)", 32, 0.5, quant.quantize_indexer, quant.dequantize_indexer,
           lambda x, c: codecs.quantize_fp4(x, 32, False, "q", c, check=False),
           lambda q, s, c: codecs.dequantize_fp4(q, s, 32, False, torch.bfloat16, c)),
    Format("SWA (FP8 E4M3, UE8M0/32)", 32, 1.0, quant.quantize_swa, quant.dequantize_swa,
           lambda x, c: codecs.quantize_fp8(x, 32, "q", c, check=False),
           lambda q, s, c: codecs.dequantize_fp8(q, s, 32, torch.bfloat16, c)),
)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 25, warmup: int = 3) -> float:
    """Median of per-call times; CUDA events on a GPU (perf_counter elsewhere, for smoke runs)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_gbps(nbytes: int, device: torch.device) -> float:
    """The ceiling: a device-to-device copy of ``nbytes``, read + write counted."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), device) / 1e9


def _same(a: Pair | torch.Tensor, b: Pair | torch.Tensor) -> bool:
    a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    return all(torch.equal(x[:CHECK_ROWS].cpu().view(torch.uint8), y[:CHECK_ROWS].view(torch.uint8))
               for x, y in zip(a, b))


def _label(c: KernelConfig) -> str:
    return f"{c.blocks} blocks/{c.num_warps} warps{' f64' if c.div64 else ''}"


def measure(fmt: Format, x: torch.Tensor) -> list[dict]:
    """Both directions of one format: the API figure, the kernel sweep, bit-exactness."""
    device, n = x.device, x.numel()
    packed = n * fmt.code_bytes + n / fmt.block
    ref_q = fmt.api_q(x[:CHECK_ROWS].cpu())
    ref_dq = fmt.api_dq(*ref_q)
    codes, scales = fmt.api_q(x)
    directions = (("quantize", 2 * n + packed, ref_q, lambda: fmt.api_q(x), lambda c: fmt.kern_q(x, c)),
                  ("dequantize", packed + 2 * n, ref_dq, lambda: fmt.api_dq(codes, scales),
                   lambda c: fmt.kern_dq(codes, scales, c)))
    rows = []
    for direction, nbytes, ref, api, kern in directions:
        exact = _same(api(), ref) and all(_same(kern(c), ref) for c in CONFIGS)
        sweep = {_label(c): nbytes / median_seconds(lambda c=c, k=kern: k(c), device) / 1e9 for c in CONFIGS}
        best = max(sweep, key=sweep.__getitem__)
        rows.append({"format": fmt.name, "direction": direction, "bytes": nbytes, "gbps": sweep[_label(KernelConfig())],
                     "api_gbps": nbytes / median_seconds(api, device) / 1e9, "bit_exact": exact,
                     "best_kernel_gbps": sweep[best], "best_config": best, "sweep": sweep})
    return rows


def run(rows: int = ROWS, device: str = "cuda") -> tuple[str, dict]:
    """Markdown section and JSON-able figures; skips (saying why) without CUDA or triton."""
    if not codecs.available() or (device == "cuda" and not torch.cuda.is_available()):
        why = "triton is not installed" if not codecs.available() else "no CUDA device"
        return f"### FP4/FP8 codec kernels\n\nskipped: {why}\n", {"skipped": why}
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, DIM, generator=g, device=dev).to(torch.bfloat16)
    ceiling = copy_gbps(x.numel() * 2, dev)
    results = [r for fmt in FORMATS for r in measure(fmt, x)]
    for r in results:
        r["ratio"] = r["gbps"] / ceiling
        r["met"] = r["ratio"] >= TARGET
    table = markdown_table(
        ["format", "direction", "GB/s effective (read+written)", "device copy GB/s", "ratio", "target",
         "status", "bit-exact vs CPU", "via kvstore.format.quant (+ NaN check)", "best launch of the sweep"],
        [[r["format"], r["direction"], f"{r['gbps']:.0f}", f"{ceiling:.0f}", f"{r['ratio']:.2f}", f">= {TARGET}",
          "met" if r["met"] else "NOT met", "yes" if r["bit_exact"] else "NO", f"{r['api_gbps']:.0f} GB/s",
          f"{r['best_kernel_gbps']:.0f} GB/s ({r['best_config']})"] for r in results])
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter smoke run)"
    text = (f"### FP4/FP8 codec kernels (Triton), bf16 [{rows:,}, {DIM}] on {name}\n\n"
            f"Each kernel at the launch `kvstore.format.quant` uses ({KernelConfig()}), median of 25 calls; the "
            f"`kvstore.format.quant` column adds what a caller pays per call (allocation, and for quantize the one "
            f"host sync of the NaN/Inf flag). Ceiling: a {x.numel() * 2 / 2**30:.1f} GiB `copy_` in the same "
            f"run. Bit-exact: the first {CHECK_ROWS:,} rows, every launch shape, against the CPU path.\n\n{table}\n")
    return text, {"device": name, "shape": [rows, DIM], "dtype": "bfloat16", "copy_gbps": ceiling,
                  "target_ratio": TARGET, "default_config": vars(KernelConfig()), "results": results}
