"""HBM tier: values in one preallocated CUDA byte arena, placed by a first-fit allocator.

The arena is allocated once (``capacity_bytes`` of uint8 on the device), so the tier never
competes with the model for memory after startup. A put that finds no free block big enough
raises ``TierFullError``; the store evicts and retries. This module imports fine without CUDA;
only constructing the tier needs it.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import torch

from kvstore.tiers.base import Stored, Tier, TierError, TierFullError, Usage, Value, check_key, check_value
from kvstore.tiers.config import HbmTierConfig

__all__ = ["HbmTier", "TierFullError"]

_ALIGN = 256  # every value starts 256-byte aligned, like cudaMalloc, so copies run at full speed


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


class _FreeList:
    """First-fit allocation of byte ranges in [0, capacity), freed ranges coalesced with neighbours."""

    def __init__(self, capacity: int) -> None:
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (offset, size), sorted, never adjacent

    def alloc(self, size: int) -> int | None:
        """Offset of a fresh block of ``size`` (> 0) bytes, or None if no free block is big enough."""
        need = _aligned(size)
        for i, (offset, free) in enumerate(self._free):
            if free >= need:
                if free == need:
                    del self._free[i]
                else:
                    self._free[i] = (offset + need, free - need)
                return offset
        return None

    def release(self, offset: int, size: int) -> None:
        """Give back a block that ``alloc(size)`` returned."""
        size = _aligned(size)
        i = bisect.bisect(self._free, (offset, 0))
        if i < len(self._free) and offset + size == self._free[i][0]:  # merge with the next block
            size += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == offset:  # merge with the previous block
            i -= 1
            offset, prev = self._free.pop(i)
            size += prev
        self._free.insert(i, (offset, size))

    def largest(self) -> int:
        return max((size for _, size in self._free), default=0)


class HbmTier(Tier):
    """A GPU-resident LRU map over one arena. Values of 0 bytes take no arena space."""

    name = "hbm"
    persistent = False

    def __init__(self, config: HbmTierConfig) -> None:
        if not torch.cuda.is_available():
            raise TierError("hbm tier needs CUDA; torch.cuda.is_available() is False")
        if config.device >= torch.cuda.device_count():
            raise ValueError(f"hbm tier: no CUDA device {config.device} ({torch.cuda.device_count()} present)")
        self._config = config
        self._device = torch.device("cuda", config.device)
        try:
            self._arena = torch.empty(config.capacity_bytes, dtype=torch.uint8, device=self._device)
        except torch.cuda.OutOfMemoryError as exc:
            raise TierError(f"hbm tier: cannot allocate a {config.capacity_bytes}-byte arena: {exc}") from exc
        self._free = _FreeList(config.capacity_bytes)
        # Uploads go through one pinned staging buffer: a pageable copy would be staged by the driver anyway.
        self._staging = torch.empty(0, dtype=torch.uint8, pin_memory=True)
        self._lock = threading.Lock()  # guards the arena, the free list and the LRU map together
        self._entries: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (offset, size), LRU
        self._used = 0
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise TierError("hbm tier: used after close()")

    def _upload(self, offset: int, view: memoryview) -> None:
        n = len(view)
        if self._staging.numel() < n:
            self._staging = torch.empty(max(n, 2 * self._staging.numel()), dtype=torch.uint8, pin_memory=True)
        self._staging[:n].numpy()[:] = np.frombuffer(view, dtype=np.uint8)
        # Synchronous (non_blocking=False): the staging buffer is reused by the next put.
        self._arena[offset : offset + n].copy_(self._staging[:n])

    def _drop(self, key: bytes) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        offset, size = entry
        if size:
            self._free.release(offset, size)
        self._used -= size
        return True

    def put(self, key: bytes, value: Value) -> None:
        check_key(key)
        view = check_value(value)
        n = len(view)
        with self._lock:
            self._check_open()
            # Allocate before freeing the old value: a put that does not fit leaves the key as it was.
            offset = self._free.alloc(n) if n else 0
            if offset is None:
                raise TierFullError(f"hbm tier: no free block of {n} bytes (largest free block {self._free.largest()})")
            try:
                if n:
                    self._upload(offset, view)
            except BaseException:
                self._free.release(offset, n)
                raise
            self._drop(key)
            self._entries[key] = (offset, n)
            self._used += n

    def _touch(self, key: bytes) -> torch.Tensor | None:
        """The value's device view, marked recently used; the caller holds the lock."""
        check_key(key)
        self._check_open()
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        offset, size = entry
        return self._arena[offset : offset + size]

    def get(self, key: bytes) -> Stored | None:
        with self._lock:
            view = self._touch(key)
            if view is None:
                return None
            if not view.numel():
                return b""
            host = view.cpu()  # copied under the lock: the block may be reused once it is released
        return memoryview(host.numpy()).toreadonly()

    def get_tensor(self, key: bytes) -> torch.Tensor | None:
        """The value as a uint8 view on the device, or None on a miss. Marks the key recently used.

        The view aliases the arena: it is valid only until the key is deleted or overwritten (the
        block is then reused). Clone it to keep it longer.
        """
        with self._lock:
            return self._touch(key)

    def delete(self, key: bytes) -> bool:
        check_key(key)
        with self._lock:
            self._check_open()
            return self._drop(key)

    def contains(self, key: bytes) -> bool:
        check_key(key)
        with self._lock:
            self._check_open()
            return key in self._entries

    def size_of(self, key: bytes) -> int | None:
        check_key(key)
        with self._lock:
            self._check_open()
            entry = self._entries.get(key)
            return None if entry is None else entry[1]

    def usage(self) -> Usage:
        with self._lock:
            self._check_open()
            return Usage(self._used, self._config.capacity_bytes, len(self._entries), self._used)

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
            # Drop the arena and staging buffer; torch's caching allocator keeps the memory for reuse.
            self._arena = self._arena.new_empty(0)
            self._staging = self._staging.new_empty(0)
