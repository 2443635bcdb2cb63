"""Pinned host buffers a batch read borrows and gives back (the HBM tier's ``read_views``), as
``ssd_batch.Scratch`` lends pageable ones to the ssd tier's decoded records.

A whole session read out of HBM is hundreds of megabytes: a fresh pinned buffer per read costs a
``cudaHostAlloc`` of that size the first time and a lookup in torch's host cache after, and its
pages are the ones the DMA engine must reach anyway. One buffer lent for the read, kept for the
next, is filled at the link's speed from the first byte. At most ``keep`` buffers are kept (the
largest); a read finding none large enough free allocates one. Needs CUDA only when it lends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: the smallest buffer allocated (a few small reads share one)
MIN_BYTES = 1 << 20


class PinnedScratch:
    """``with scratch.lending(n) as host:`` a pinned uint8 CPU tensor of ``n`` bytes, the read's alone
    until the block ends."""

    def __init__(self, keep: int = 2) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._keep = keep

    @contextlib.contextmanager
    def lending(self, n: int) -> Iterator[torch.Tensor]:
        import torch

        if n == 0:
            yield torch.empty(0, dtype=torch.uint8)
            return
        with self._lock:
            fit = [b for b in self._free if b.numel() >= n]
            buf = min(fit, key=lambda b: b.numel()) if fit else None
            if buf is not None:
                self._free.remove(buf)
        if buf is None:
            buf = torch.empty(max(n, MIN_BYTES), dtype=torch.uint8, pin_memory=True)
        try:
            yield buf[:n]
        finally:
            with self._lock:
                self._free = sorted([*self._free, buf], key=lambda b: b.numel())[-self._keep:]

    def clear(self) -> None:
        with self._lock:
            self._free = []
