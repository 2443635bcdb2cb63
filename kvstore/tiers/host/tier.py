"""Host tier: values in process memory, LRU order in an OrderedDict, one lock around both.

Values of 64 KiB and more (chunks, page blobs) are copied into buffers of a pool that recycles the
buffers of dropped values and keeps memory faulted in ahead (``tiers/host/pool.py``): a save or a
promotion copies into memory that is ready, not into fresh pages. Smaller ones are kept as
``bytes``. With CUDA present and ``pin_memory`` set, values are kept in pinned uint8 tensors
instead, so a later copy to the GPU is a direct DMA. What is not ``bytes`` is handed out as a
read-only memoryview.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from kvstore.tiers.base import (
    MemoryMeta,
    MetaMap,
    Stored,
    Tier,
    TierError,
    TierStats,
    Usage,
    Value,
    check_key,
    check_value,
)
from kvstore.tiers.config import HostTierConfig
from kvstore.tiers.host.pool import MIN_AHEAD_BYTES, HostPool


def _nvidia_driver_present() -> bool:
    """Whether an NVIDIA kernel driver is loaded: checked before importing torch, which alone
    costs a CPU-only daemon ~1.5 s of every start (and a restart after a crash is on the clock)."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def _pinned_copier() -> Callable[[memoryview], Any] | None:
    """A function copying a byte view into a fresh pinned tensor, or None without CUDA."""
    if not _nvidia_driver_present():
        return None
    import numpy as np
    import torch

    if not torch.cuda.is_available():
        return None

    def copy(view: memoryview) -> Any:
        tensor = torch.empty(len(view), dtype=torch.uint8, pin_memory=True)
        tensor.numpy()[:] = np.frombuffer(view, dtype=np.uint8)
        return tensor

    return copy


class HostTier(Tier):
    """An in-process LRU map. ``capacity_bytes`` is reported, not enforced."""

    name = "host"
    persistent = False

    def __init__(self, config: HostTierConfig) -> None:
        self._config = config
        self._lock = threading.Lock()
        self._values: OrderedDict[bytes, Any] = OrderedDict()  # bytes, or a pinned uint8 tensor
        self._used = 0
        self._closed = False
        self._pin = _pinned_copier() if config.pin_memory else None
        self._pool = HostPool(config.reserve_bytes)
        self._meta = MemoryMeta()

    def _check_open(self) -> None:
        if self._closed:
            raise TierError("host tier: used after close()")

    def _copy(self, view: memoryview) -> Any:
        # Copy outside the lock: values are up to a few MB and other threads should not wait.
        if self._pin is not None and len(view):
            return self._pin(view)
        if len(view) >= MIN_AHEAD_BYTES:
            if isinstance(view.obj, np.ndarray) and view.nbytes == view.obj.nbytes and self._pool.adopt(view.obj):
                return view.obj  # the buffer this tier lent for it (``buffer_for``): already a copy
            buf = self._pool.take(len(view))
            buf[:] = np.frombuffer(view, np.uint8)
            return buf
        if isinstance(view.obj, bytes) and view.nbytes == len(view.obj):
            return view.obj  # a whole bytes object is immutable: kept as it is, no copy
        return view.tobytes()

    def buffer_for(self, n: int) -> memoryview | None:
        """A writable buffer of ``n`` bytes from this tier's pool for a value about to be put (``Tier.
        buffer_for``): put as it is, it is kept without a copy."""
        if self._pin is not None or n < MIN_AHEAD_BYTES:
            return None
        return memoryview(self._pool.lend(n).data)

    def _drop(self, stored: Any) -> None:
        """A value is no longer the tier's: its pool buffer goes back (reused once no view of it is left)."""
        if isinstance(stored, np.ndarray):
            self._pool.give(stored)

    @staticmethod
    def _out(stored: Any) -> Stored:
        if isinstance(stored, bytes):
            return stored
        arr: np.ndarray = stored if isinstance(stored, np.ndarray) else stored.numpy()
        return memoryview(arr.data).toreadonly()  # read-only: callers must not edit the tier

    def put_many(self, items: Iterable[tuple[bytes, Value]]) -> None:
        """One value at a time, each copied before the lock is taken: measured against copying the
        whole batch first and inserting it under one lock, a daemon's save into buffers this tier
        lent (``buffer_for``) ran 12 to 29% slower batched, for a cause not pinned down (bench_revisions.py)."""
        for key, value in items:
            check_key(key)
            stored = self._copy(check_value(value))
            with self._lock:
                self._check_open()
                old = self._values.pop(key, None)
                if old is not None:
                    self._used -= len(old)
                    self._drop(old)
                self._values[key] = stored
                self._used += len(stored)

    def get_many(self, keys: Sequence[bytes]) -> list[Stored | None]:
        keys = [check_key(key) for key in keys]
        with self._lock:
            self._check_open()
            found = [self._values.get(key) for key in keys]
            for key, stored in zip(keys, found):
                if stored is not None:
                    self._values.move_to_end(key)
        return [None if stored is None else self._out(stored) for stored in found]

    def delete_many(self, keys: Iterable[bytes]) -> int:
        keys = [check_key(key) for key in keys]
        gone = 0
        with self._lock:
            self._check_open()
            for key in keys:
                stored = self._values.pop(key, None)
                if stored is not None:
                    self._used -= len(stored)
                    self._drop(stored)
                    gone += 1
        return gone

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        keys = [check_key(key) for key in keys]
        with self._lock:
            self._check_open()
            values = self._values
            return [key in values for key in keys]

    def size_of(self, key: bytes) -> int | None:
        check_key(key)
        with self._lock:
            self._check_open()
            stored = self._values.get(key)
            return None if stored is None else len(stored)

    def stats(self, pages: bool = False) -> TierStats:
        with self._lock:
            self._check_open()
            return TierStats(Usage(self._used, self._config.capacity_bytes, len(self._values), self._used))

    def meta(self) -> MetaMap:
        return self._meta

    def keys(self) -> Iterator[bytes]:
        return self.victims()  # LRU order is as good as any

    def victims(self) -> Iterator[bytes]:
        with self._lock:
            self._check_open()
            snapshot = list(self._values)
        return iter(snapshot)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._values.clear()
            self._used = 0
        self._pool.close()
