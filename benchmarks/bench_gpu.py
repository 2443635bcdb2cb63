"""GPU numbers (run on a CUDA machine; skips cleanly without one).

    python benchmarks/bench_gpu.py            # -> benchmarks/results/gpu.md

- codec throughput on CUDA (the torch path; the fused C kernel is CPU-only), bit-exact vs CPU;
- HBM tier put/get of 229 KB deepseek-v4.1-flash chunks vs the host tier, and get_tensor (no copy);
- a whole session resumed onto the GPU: 64 MiB of chunks from the HBM tier into device tensors;
- the tiny-16 model on the GPU: prefill 8K tokens, bounded replay (128), exact replay (2048), decode.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import markdown_table, median_time, write_result
from kvstore import quant
from kvstore.tiers import HbmTierConfig, HostTierConfig, make_tier


def sync_time(fn: object, repeats: int = 9) -> float:
    def run() -> None:
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()

    return median_time(run, repeats)


def codecs() -> str:
    x = torch.randn(65536, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    gb = x.numel() * 2 / 1e9
    xc = x.cuda()
    rows = []
    for name, q, dq in (("main (E4M3/16)", quant.quantize_main, quant.dequantize_main),
                        ("indexer (UE8M0/32)", quant.quantize_indexer, quant.dequantize_indexer)):
        codes, scales = q(xc)
        ref_c, ref_s = q(x)
        exact = torch.equal(codes.cpu(), ref_c) and torch.equal(scales.cpu(), ref_s)
        back_exact = torch.equal(dq(codes, scales).cpu(), dq(ref_c, ref_s))
        tq = sync_time(lambda q=q: q(xc))
        tdq = sync_time(lambda dq=dq, c=codes, s=scales: dq(c, s))
        rows.append([name, f"{gb / tq:.1f}", f"{gb / tdq:.1f}", "yes" if exact and back_exact else "NO"])
    return markdown_table(["format", "quantize GB/s", "dequantize GB/s", "bit-exact vs CPU"], rows)


def tiers() -> str:
    size, n = 229_376, 280  # one deepseek-v4.1-flash chunk of 256 tokens; 280 of them = 64 MiB
    blobs = [torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes() for _ in range(n)]
    keys = [i.to_bytes(16, "big") for i in range(n)]
    total = size * n / 1e9
    rows = []
    for label, cfg in (("host (pinned)", HostTierConfig()), ("hbm", HbmTierConfig(capacity_bytes=1 << 30))):
        tier = make_tier(cfg)
        put = median_time(lambda t=tier: [t.put(k, b) for k, b in zip(keys, blobs)], 5)
        get = median_time(lambda t=tier: [t.get(k) for k in keys], 5)
        dev = "-"
        if label == "hbm":
            dev = f"{total / sync_time(lambda t=tier: [t.get_tensor(k) for k in keys]):.1f}"
        rows.append([label, f"{total / put:.1f}", f"{total / get:.1f}", dev])
        tier.close()
    return markdown_table(["tier", "put GB/s (from host bytes)", "get GB/s (to host bytes)",
                           "get_tensor GB/s (device view)"], rows)


def model() -> str:
    from replay.model import ModelArgs, Transformer

    m = Transformer(ModelArgs.tiny16(), seed=0, device="cuda")
    toks = torch.randint(0, 256, (8192,), generator=torch.Generator().manual_seed(0)).tolist()
    st = m.new_state()
    prefill = sync_time(lambda: m.prefill(toks, m.new_state(), chunk_size=4096), 3)
    m.prefill(toks, st, chunk_size=4096)

    def resumed(r: int) -> None:
        s = m.new_state()
        for c in m.args.layout.caches:
            s.load_global(c.name, *st.global_entries(c.name, 0, st.n_entries(c.name)))
        m.replay(s, toks[-r:], len(toks) - r)

    bounded, exact = sync_time(lambda: resumed(128), 5), sync_time(lambda: resumed(2048), 3)
    decode = sync_time(lambda: m.decode_one_token(7, st), 9)
    rows = [["prefill 8,192 tokens (chunk 4096)", f"{prefill * 1e3:.0f}"],
            ["resume: install globals + bounded replay (128)", f"{bounded * 1e3:.0f}"],
            ["resume: install globals + exact replay (2048)", f"{exact * 1e3:.0f}"],
            ["decode one token", f"{decode * 1e3:.1f}"],
            ["re-prefill / bounded resume", f"{prefill / bounded:.0f}x"]]
    return markdown_table(["tiny-16 on the GPU", "ms"], rows)


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (GPU paths are optional; see benchmarks/results/gpu.md)")
        return
    dev = torch.cuda.get_device_name()
    body = (f"Device: {dev}, torch {torch.__version__}, CUDA {torch.version.cuda}. Medians of repeats, "
            f"synchronized.\n\n## Codecs on CUDA (bf16 [65536, 512])\n\n{codecs()}\n\n"
            f"## HBM tier vs host tier (280 chunks x 229,376 B = 64 MiB)\n\n{tiers()}\n\n"
            f"## Model\n\n{model()}\n\nReproduce on a CUDA machine: `python benchmarks/bench_gpu.py`")
    print(body)
    print(f"wrote {write_result('gpu.md', 'GPU results', body)}")


if __name__ == "__main__":
    main()
