"""The caches of one sequence in the reference model: the persisted global caches (packed FP4, the
bytes the store saves), each layer's SWA ring (FP8, never persisted), and the session state that
holds them. Split from model.py so the model file stays about the computation."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from kvstore.format import quant
from kvstore.format.layout import EntryFormat, Layout

if TYPE_CHECKING:
    from replay.model import ModelArgs


class PackedCache:
    """One persisted global cache ("main.L2", "index.L8", ...): entries [0, n) as packed codes and
    scales (the source of truth, what the store saves) plus their dequantized copy for attention."""

    def __init__(self, name: str, layout: Layout, device: torch.device, dtype: torch.dtype, capacity: int = 64) -> None:
        """capacity: entries allocated up front (the tensors move only when a write goes past them)."""
        self.spec = layout.cache(name)
        main = self.spec.fmt is EntryFormat.FP4_E4M3_16
        self.dequantize = quant.dequantize_main if main else quant.dequantize_indexer
        self.codes = torch.zeros(capacity, self.spec.code_bytes, dtype=torch.uint8, device=device)
        self.scales = torch.zeros(capacity, self.spec.scale_bytes, dtype=torch.uint8, device=device)
        self.values = torch.zeros(capacity, self.spec.channels, dtype=dtype, device=device)
        self.n = 0

    def write(self, start: int, codes: Tensor, scales: Tensor) -> None:
        """Set entries [start, start + len(codes)); start <= n (no holes)."""
        end = start + codes.shape[0]
        if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise ValueError(f"{self.spec.name}: codes and scales must be uint8")
        if not 0 <= start <= self.n:
            raise ValueError(f"{self.spec.name}: writing from entry {start} would leave a hole after {self.n}")
        if codes.shape[1:] != self.codes.shape[1:] or scales.shape != (codes.shape[0], self.scales.shape[1]):
            raise ValueError(f"{self.spec.name}: expected codes [N, {self.spec.code_bytes}] and scales "
                             f"[N, {self.spec.scale_bytes}], got {tuple(codes.shape)}, {tuple(scales.shape)}")
        if end > self.codes.shape[0]:
            cap = max(end, 2 * self.codes.shape[0])
            self.codes, self.scales, self.values = (F.pad(t, (0, 0, 0, cap - t.shape[0]))
                                                    for t in (self.codes, self.scales, self.values))
        dev = self.codes.device
        self.codes[start:end], self.scales[start:end] = codes.to(dev), scales.to(dev)
        self.values[start:end] = self.dequantize(self.codes[start:end], self.scales[start:end], self.values.dtype)
        self.n = max(self.n, end)


class SwaRing:
    """One layer's SWA KV of positions [lo, hi) (at most ``window``), FP8 packed, slot = pos % window."""

    def __init__(self, window: int, dim: int, device: torch.device, dtype: torch.dtype) -> None:
        self.window = window
        self.codes = torch.zeros(window, dim, dtype=torch.uint8, device=device)
        self.scales = torch.zeros(window, dim // 32, dtype=torch.uint8, device=device)
        self.keys = torch.zeros(window, dim, dtype=dtype, device=device)  # FP8 round-tripped
        self.lo = self.hi = 0

    def reset(self, pos: int) -> None:
        self.lo = self.hi = pos

    def entries(self) -> tuple[Tensor, Tensor]:
        """Packed (codes [hi-lo, D], scales [hi-lo, D/32]) in position order."""
        slots = torch.arange(self.lo, self.hi, device=self.codes.device) % self.window
        return self.codes[slots], self.scales[slots]

    def push(self, k: Tensor, pos0: int) -> tuple[Tensor, int]:
        """Append k: [T, D] at positions [pos0, pos0+T) (FP8 round trip); return the keys the chunk's
        windows can see, ext: [E, D] at positions [e0, pos0+T), and e0."""
        assert pos0 == self.hi, "SWA ring positions must be contiguous"
        t, w, dev = k.shape[0], self.window, k.device
        codes, scales = quant.quantize_swa(k)
        k = quant.dequantize_swa(codes, scales, k.dtype)
        e0 = max(self.lo, pos0 - w + 1)
        ext = torch.cat([self.keys[torch.arange(e0, pos0, device=dev) % w], k])
        keep = slice(max(0, t - w), t)
        slots = torch.arange(pos0, pos0 + t, device=dev)[keep] % w
        self.codes[slots], self.scales[slots], self.keys[slots] = codes[keep], scales[keep], k[keep]
        self.hi, self.lo = pos0 + t, max(self.lo, pos0 + t - w)
        return ext, e0


class SessionState:
    """One sequence's caches: the global caches (packed), the m>1 compressors' pending tokens, every
    layer's SWA ring, and where the decoder's current contiguous run began (``decoder_from``). max_len > 0
    preallocates every global cache for that many tokens (a multiple of 16 entries, with room for one group
    past the end), so its tensors never move: replay/fast_decode.py's CUDA graphs point into them."""

    def __init__(self, args: ModelArgs, device: torch.device, dtype: torch.dtype, max_len: int = 0) -> None:
        self.args, self.layout = args, args.layout
        self.pos = 0  # tokens processed
        self.decoder_from = 0  # the decoder ran over every position in [decoder_from, pos)
        self.caches = {c.name: PackedCache(c.name, self.layout, device, dtype,
                                           -(-(max_len // c.m + 2) // 16) * 16 if max_len > 0 else 64)
                       for c in self.layout.caches}
        self.pending: dict[int, tuple[Tensor, Tensor, int]] = {}  # layer -> (kv, z, first position)
        self.rings = [SwaRing(args.window, args.head_dim, device, dtype) for _ in range(args.n_layers)]

    def n_entries(self, name: str) -> int:
        return self._cache(name).n

    def global_entries(self, name: str, start: int, end: int) -> tuple[Tensor, Tensor]:
        """Packed entries [start, end) of one cache: (codes uint8 [N, code_bytes], scales uint8 [N, scale_bytes]).
        Tokens [t0, t1) with t0, t1 multiples of m are entries [t0 // m, t1 // m)."""
        cache = self._cache(name)
        if not 0 <= start <= end <= cache.n:
            raise ValueError(f"{name}: entries [{start}, {end}) are outside [0, {cache.n})")
        return cache.codes[start:end].clone(), cache.scales[start:end].clone()

    def load_global(self, name: str, codes: Tensor, scales: Tensor, start: int = 0) -> None:
        """Install packed entries [start, start + N) as they are (no re-encoding); start <= n_entries."""
        self._cache(name).write(start, codes, scales)

    def global_nbytes(self) -> int:
        return sum(c.n * c.spec.entry_bytes for c in self.caches.values())

    def _cache(self, name: str) -> PackedCache:
        if name not in self.caches:
            raise ValueError(f"unknown cache {name!r}; this model has {sorted(self.caches)}")
        return self.caches[name]
