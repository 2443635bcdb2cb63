"""Chunk bytes for the agent workload: real codecs, built once per layout and reused.

Encoding fresh Gaussian KV for every chunk of hundreds of sessions would cost more CPU than the
store itself on this machine; the at-rest size does not need it, because every chunk is
compressed on its own (zstd per record), so reusing the *entries* of a small pool of real chunks
under new token ids and keys gives the same bytes at rest as fresh KV would. Each chunk's header,
token ids, key and checksum are its own.

Formats: FP4 caches go through kvstore's quantizers (Gaussian KV with a per-channel sigma ~
LogNormal(0, 0.5), as bench_store.make_session). The V4-Flash main entry (448 FP8 E4M3 + 64 BF16
RoPE channels + 8 scale bytes, 584 B) is built the same way: FP8 codes of x / s with one UE8M0
scale per 64 channels (7 used, 1 pad byte), the RoPE part as BF16 bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvstore.format import chunk, quant
from kvstore.format.keys import chain_keys
from kvstore.format.layout import EntryFormat, Layout

POOL = 6  # distinct full chunks of real entries per layout


def _mixed_entries(n: int, sigma: torch.Tensor, g: torch.Generator) -> chunk.Entries:
    """``n`` V4-Flash main entries: 448 FP8 E4M3 codes (UE8M0 scale per 64), 64 BF16, 8 scale bytes."""
    x = torch.randn(n, 448, generator=g) * sigma[:448]
    blocks = x.view(n, 7, 64)
    exp = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp_min(1e-4) / 448))  # [n, 7]
    q = (blocks / torch.exp2(exp)[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    rope = (torch.randn(n, 64, generator=g) * sigma[448:]).to(torch.bfloat16).view(torch.uint8)  # [n, 128]
    scales = torch.zeros(n, 8, dtype=torch.uint8)
    scales[:, :7] = (exp + 127).to(torch.uint8)
    return chunk.Entries(torch.cat([q.reshape(n, 448), rope], 1).numpy(), scales.numpy())


def _entries(layout: Layout, tokens: int, g: torch.Generator) -> dict[str, chunk.Entries]:
    out = {}
    for c in layout.caches:
        n = c.entries_for(tokens)
        sigma = torch.exp(0.5 * torch.randn(c.channels, generator=g))
        if c.fmt is EntryFormat.FP8_BF16_MIXED:
            out[c.name] = _mixed_entries(n, sigma, g)
        else:
            quantize = quant.quantize_main if c.fmt is EntryFormat.FP4_E4M3_16 else quant.quantize_indexer
            out[c.name] = chunk.Entries.of(*quantize(torch.randn(n, c.channels, generator=g) * sigma))
    return out


@dataclass
class ChunkMaker:
    """Encodes chunks of ``layout`` for any token ids, from a pool of real entries."""

    layout: Layout
    chunk_tokens: int
    seed: int = 0
    pool: list[dict[str, chunk.Entries]] = field(default_factory=list)
    used: int = 0

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        self.pool = [_entries(self.layout, self.chunk_tokens, g) for _ in range(POOL)]

    def encode(self, key: bytes, start: int, ids: np.ndarray) -> bytes:
        """A chunk (or a tail, key ``bytes(16)``) of ``len(ids)`` <= chunk_tokens tokens."""
        src = self.pool[self.used % POOL]
        self.used += 1
        ents = {c.name: chunk.Entries(src[c.name].codes[: c.entries_for(len(ids))],
                                      src[c.name].scales[: c.entries_for(len(ids))]) for c in self.layout.caches}
        return chunk.encode(self.layout, key=key, start=start, token_ids=ids, entries=ents)

    def sequence(self, namespace: str, ids: np.ndarray, first: int) -> tuple[list[bytes], list[bytes], bytes]:
        """(every complete chunk's key, the blobs of chunks ``first``.., the tail blob) of ``ids``."""
        ct = self.chunk_tokens
        keys = chain_keys(self.layout.layout_id, namespace, ids, ct)
        blobs = [self.encode(keys[i], i * ct, ids[i * ct : (i + 1) * ct]) for i in range(first, len(keys))]
        lo = len(keys) * ct
        return keys, blobs, self.encode(bytes(16), lo, ids[lo:])


def snapshot_shape(layout: Layout, chunk_tokens: int, target: int) -> tuple[int, int]:
    """(complete chunks, tail tokens) of ``layout`` whose payload is closest to ``target`` bytes:
    how one SWA snapshot is stored as a pseudo-session of the same store."""
    full = layout.chunk_payload_bytes(chunk_tokens)
    n = target // full
    tail = min(range(chunk_tokens), key=lambda t: abs(n * full + layout.chunk_payload_bytes(t) - target))
    return n, tail


def mixed_codes_zstd(maker: ChunkMaker) -> tuple[float, float]:
    """(zstd-1 compressed / raw size of the FP8/BF16 main-KV codes of ``maker``'s pool, their share
    of a full chunk's encoded bytes): what a V4-style store would gain by compressing its codes,
    which kvstore's ssd records keep raw (they compress from the first scales section on)."""
    import zstandard

    from kvstore.format.chunk import encoded_size

    codes = b"".join(e[c.name].codes.tobytes() for e in maker.pool for c in maker.layout.caches
                     if c.fmt is EntryFormat.FP8_BF16_MIXED)
    if not codes:
        return 1.0, 0.0
    ratio = len(zstandard.ZstdCompressor(level=1).compress(codes)) / len(codes)
    return ratio, len(codes) / len(maker.pool) / encoded_size(maker.layout, maker.chunk_tokens)
