"""HBM tier: values in one preallocated CUDA byte arena, moved to and from host bytes at PCIe speed.

The arena is allocated once (``capacity_bytes`` of uint8 on the device) and carved by an extent
allocator (tiers/hbm/alloc.py), so the tier never calls ``cudaMalloc`` per value and never competes with
the model for memory after startup. A put that finds no free extent big enough raises
``TierFullError``; the store makes room first, demoting LRU values (``victims()``) to the tiers below,
and skips a put that still does not fit.

Batches are what make it fast: ``put_many`` places a batch in one extent and uploads it through
pinned staging buffers on parallel copy lanes (staging.py); ``get_many`` copies a batch back in one
DMA per run of back-to-back values, straight into one pinned host buffer (from torch's caching
host allocator, so it is reused once the caller drops the views) whose read-only views it returns.
``read_views`` (a load's batch read, kvstore/store/tiered/reads.py) does the same into a pinned buffer
the tier lends for the ``with`` block and keeps for the next read (scratch.py): every key of
the batch in one pass under the lock, one synchronize.
``copy_to`` copies values device to device (the same-GPU handoff, kvstore/server/device_arenas.py).
This module imports fine without CUDA; only constructing the tier needs it.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

import torch

from kvstore.tiers.base import (
    MemoryMeta,
    MetaMap,
    Stored,
    TierError,
    TierFullError,
    TierStats,
    Usage,
    Value,
    Views,
    check_key,
    check_value,
)
from kvstore.tiers.config import HbmTierConfig
from kvstore.tiers.device_tier import DeviceTier
from kvstore.tiers.hbm.alloc import ExtentAllocator, aligned, packed_offsets, paired_runs
from kvstore.tiers.hbm.staging import Stager
from kvstore.tiers.scratch import Scratch

__all__ = ["HbmTier", "TierFullError"]

#: the values of a batch read that take arena bytes: (position in the batch, (arena offset, size))
Sized = list[tuple[int, tuple[int, int]]]


class HbmTier(DeviceTier):
    """A GPU-resident LRU map over one arena. Values of 0 bytes take no arena space."""

    name = "hbm"
    persistent = False

    def __init__(self, config: HbmTierConfig) -> None:
        if not torch.cuda.is_available():
            raise TierError("hbm tier needs CUDA; torch.cuda.is_available() is False")
        if config.device >= torch.cuda.device_count():
            raise ValueError(f"hbm tier: no CUDA device {config.device} ({torch.cuda.device_count()} present)")
        self._config = config
        self.device = torch.device("cuda", config.device)
        try:
            self._arena = torch.empty(config.capacity_bytes, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError as exc:
            raise TierError(f"hbm tier: cannot allocate a {config.capacity_bytes}-byte arena: {exc}") from exc
        self._free = ExtentAllocator(config.capacity_bytes)
        self._stager = Stager(self.device, config)
        self._stream = torch.cuda.Stream(self.device)  # reads: device to host, device to device
        #: read_views' host buffers, pinned, lent per read and kept
        self._scratch: Scratch[torch.Tensor] = Scratch(lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        self._lock = threading.Lock()  # guards the arena, the allocator and the LRU map together
        self._entries: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (offset, size), LRU
        self._used = 0
        self._closed = False
        self._meta = MemoryMeta()

    def _check_open(self) -> None:
        if self._closed:
            raise TierError("hbm tier: used after close()")

    def _drop(self, key: bytes) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        offset, size = entry
        if size:
            self._free.release(offset, size)
        self._used -= size
        return True

    # -- writes -----------------------------------------------------------------------------------
    def put_many(self, items: Iterable[tuple[bytes, Value]]) -> None:
        """Store a batch, all or nothing: placed in one extent when one is free, uploaded through
        the staging lanes. A batch that does not fit raises ``TierFullError`` and changes nothing
        (old values of its keys stay: space is found before anything is freed)."""
        batch: dict[bytes, memoryview] = {}
        for key, value in items:
            batch[check_key(key)] = check_value(value)  # a key given twice: the last value wins
        if not batch:
            return
        keys, views = list(batch), list(batch.values())
        sized = [(k, v) for k, v in zip(keys, views) if len(v)]
        with self._lock:
            self._check_open()
            offsets = self._free.alloc_many([len(v) for _, v in sized])
            if offsets is None:
                need = sum(aligned(len(v)) for _, v in sized)
                raise TierFullError(f"hbm tier: no room for {len(sized)} values ({need} bytes; "
                                    f"{self._free.free_bytes()} free, largest extent {self._free.largest()})")
            blocks = [(o, len(v)) for o, (_, v) in zip(offsets, sized)]
            try:
                if blocks:
                    self._stager.upload(self._arena, blocks, [v for _, v in sized])
            except BaseException:
                for o, n in blocks:
                    self._free.release(o, n)
                raise
            placed = dict(zip((k for k, _ in sized), blocks))
            for key, view in zip(keys, views):
                self._drop(key)
                self._entries[key] = placed.get(key, (0, 0))
                self._used += len(view)

    # -- reads ------------------------------------------------------------------------------------
    def _hits(self, keys: Sequence[bytes]) -> list[tuple[int, int] | None]:
        """Each key's (offset, size), marked recently used, or None; the caller holds the lock."""
        self._check_open()
        out: list[tuple[int, int] | None] = []
        for key in keys:
            entry = self._entries.get(check_key(key))
            if entry is not None:
                self._entries.move_to_end(key)
            out.append(entry)
        return out

    def get_many(self, keys: Sequence[bytes]) -> list[Stored | None]:
        """Read-only host views of the values (None for a miss), all in one pinned buffer filled by
        one DMA per run of back-to-back values. The buffer is the caller's: nothing reuses it
        while any view is alive."""
        with self._lock:
            hits = self._hits(keys)
            sized, dst, span = _planned(hits)
            host = torch.empty(span, dtype=torch.uint8, pin_memory=bool(span))
            self._copy_out(sized, dst, host)
        return _views(hits, sized, dst, host)

    @contextlib.contextmanager
    def read_views(self, keys: Sequence[bytes]) -> Iterator[Views]:
        """``get_many`` into a pinned buffer lent for the block and reused by later reads: the views are
        valid inside the ``with`` block only (the caller copies or sends them there). The tier holds
        no framing that can be damaged: nothing is ever unreadable."""
        with contextlib.ExitStack() as lent:
            with self._lock:
                hits = self._hits(keys)
                sized, dst, span = _planned(hits)
                host = lent.enter_context(self._scratch.lending())(span)
                self._copy_out(sized, dst, host)
            yield Views(_views(hits, sized, dst, host), frozenset())

    def _copy_out(self, sized: Sized, dst: Sequence[int], host: torch.Tensor) -> None:
        """The ``sized`` values copied into ``host`` at ``dst``: one DMA per run of values back to back
        on both sides, then one synchronize. The caller holds the lock (a block may be reused once
        released)."""
        if not sized:
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            for src, at, n in paired_runs([h for _, h in sized], dst):
                host[at:at + n].copy_(self._arena[src:src + n], non_blocking=True)
        self._stream.synchronize()

    def get_tensor(self, key: bytes) -> torch.Tensor | None:
        """The value as a uint8 view on the device, or None on a miss. Marks the key recently used.

        The view aliases the arena: it is valid only until the key is deleted or overwritten (the
        block is then reused). Clone it to keep it longer, or use ``copy_to``.
        """
        with self._lock:
            hit = self._hits([key])[0]
            return None if hit is None else self._arena[hit[0]:hit[0] + hit[1]]

    def copy_to(self, keys: Sequence[bytes], dst: torch.Tensor, offsets: Sequence[int]) -> list[bool]:
        """``DeviceTier.copy_to``: synchronized before it returns, the lock held throughout."""
        with self._lock:
            hits = self._hits(keys)
            for h, at in zip(hits, offsets, strict=True):
                if h is not None and at + h[1] > dst.numel():
                    raise ValueError(f"a value of {h[1]} bytes at offset {at} overruns the {dst.numel()}-byte buffer")
            pairs = [(h, at) for h, at in zip(hits, offsets) if h is not None and h[1]]
            if pairs:
                with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                    for src, at, n in paired_runs([h for h, _ in pairs], [at for _, at in pairs]):
                        dst[at:at + n].copy_(self._arena[src:src + n], non_blocking=True)
                self._stream.synchronize()
        return [h is not None for h in hits]

    # -- bookkeeping ------------------------------------------------------------------------------
    def delete_many(self, keys: Iterable[bytes]) -> int:
        keys = [check_key(key) for key in keys]
        with self._lock:
            self._check_open()
            return sum(self._drop(key) for key in keys)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        keys = [check_key(key) for key in keys]
        with self._lock:
            self._check_open()
            entries = self._entries
            return [key in entries for key in keys]

    def size_of(self, key: bytes) -> int | None:
        check_key(key)
        with self._lock:
            self._check_open()
            entry = self._entries.get(key)
            return None if entry is None else entry[1]

    def stats(self, pages: bool = False) -> TierStats:
        with self._lock:
            self._check_open()
            return TierStats(Usage(self._used, self._config.capacity_bytes, len(self._entries), self._used))

    def meta(self) -> MetaMap:
        return self._meta

    def keys(self) -> Iterator[bytes]:
        return self.victims()

    def victims(self) -> Iterator[bytes]:
        with self._lock:
            self._check_open()
            snapshot = list(self._entries)
        return iter(snapshot)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._entries.clear()
            self._used = 0
            self._stager.close()
            self._scratch.clear()
            # Drop the arena; torch's caching allocator keeps the memory for reuse.
            self._arena = self._arena.new_empty(0)


def _planned(hits: Sequence[tuple[int, int] | None]) -> tuple[Sized, list[int], int]:
    """The hits that take arena bytes, where each goes in a packed host buffer, and its size."""
    sized = [(i, h) for i, h in enumerate(hits) if h is not None and h[1]]
    dst, span = packed_offsets([h[1] for _, h in sized])
    return sized, dst, span


def _views(hits: Sequence[tuple[int, int] | None], sized: Sized, dst: Sequence[int], host: torch.Tensor
           ) -> list[Stored | None]:
    """Each key's value as a read-only view of ``host`` (b"" for an empty value, None for a miss)."""
    view = memoryview(host.numpy().data).toreadonly()
    out: list[Stored | None] = [None if h is None else b"" for h in hits]
    for (i, (_, n)), at in zip(sized, dst):
        out[i] = view[at:at + n]
    return out
