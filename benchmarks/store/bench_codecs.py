"""Codec throughput: GB/s of bf16 input (or output, for dequantize), median of repeats.

    python benchmarks/store/bench_codecs.py [--rows 65536] [--dim 512]

Compares the fused C kernel (what kvstore uses on CPU) with the vectorized torch path (what it
uses on CUDA and where the C build is absent), on the same tensor in the same run.
Targets on the 2-core CPU: quantize_main >= 0.5 GB/s, dequantize_main >= 1 GB/s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import machine, markdown_table, median_time, write_result
from kvstore.format import quant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    x = (torch.randn(args.rows, args.dim, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    gb = x.numel() * 2 / 1e9
    kernel = quant._fp4
    rows = []
    for fmt, q, dq in (("main (E4M3/16)", quant.quantize_main, quant.dequantize_main),
                       ("indexer (UE8M0/32)", quant.quantize_indexer, quant.dequantize_indexer)):
        res = {}
        for path in ("fused", "torch"):
            quant._fp4 = kernel if path == "fused" else None
            reps = args.repeats if path == "fused" else 3
            codes, scales = q(x)
            tq = median_time(lambda q=q: q(x), reps)
            tdq = median_time(lambda dq=dq, c=codes, s=scales: dq(c, s), reps)
            res[path] = (gb / tq, gb / tdq)
        quant._fp4 = kernel
        rows.append([fmt, f"{res['fused'][0]:.2f}", f"{res['fused'][1]:.2f}", f"{res['torch'][0]:.2f}",
                     f"{res['torch'][1]:.2f}", f"{res['fused'][0] / res['torch'][0]:.1f}x"])
    table = markdown_table(["format", "quantize GB/s", "dequantize GB/s", "torch quantize GB/s",
                            "torch dequantize GB/s", "quantize speedup"], rows)
    body = (f"Input: bf16 [{args.rows}, {args.dim}] ({gb * 1000:.0f} MB); GB/s of bf16 input for quantize and of "
            f"bf16 output for dequantize; median of {args.repeats} runs (torch path: 3).\n"
            f"Machine: {machine()}.\n\nTargets: quantize_main >= 0.5 GB/s, dequantize_main >= 1 GB/s.\n\n{table}\n\n"
            f"Reproduce: `python benchmarks/store/bench_codecs.py`")
    print(table)
    print(f"wrote {write_result('codecs.md', 'Codec throughput', body)}")


if __name__ == "__main__":
    main()
