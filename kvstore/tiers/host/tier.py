"""Host tier: values in process memory, LRU order in an OrderedDict, one lock around both.

Values of 64 KiB and more (chunks, page blobs) are copied into buffers of a pool that recycles the
buffers of dropped values and keeps memory faulted in ahead (the pool, below): a save or a
promotion copies into memory that is ready, not into fresh pages. Smaller ones are kept as
``bytes``. With CUDA present and ``pin_memory`` set, values are kept in pinned uint8 tensors
instead, so a later copy to the GPU is a direct DMA. What is not ``bytes`` is handed out as a
read-only memoryview.

The pool: memory for the host tier's values that a save or a promotion never waits to fault in.

A value copied into fresh memory pays a page fault per 4 KiB first: on this kind of machine a 229 KB
chunk copied into a new buffer took 122 us, into a reused one 6 us. And a host tier that keeps each
save's copies in the allocator's heap takes the very memory LMDB freed after its last write
transaction, so LMDB's next one faults in new pages too. So the host tier keeps its values in
buffers of this pool:

- **recycled**: a value dropped (deleted, evicted, replaced) gives its buffer back; it is lent again,
  for a value of the same size, once nothing else refers to it (a reader's view keeps it from reuse:
  its reference count says so, and a buffer still referred to is simply not lent);
- **touched ahead**: for each size asked for lately, a thread keeps ``reserve_bytes`` of buffers
  already faulted in, refilled off the caller's path and out of its way: once the takes pause
  (``QUIET_S``: a save's copies are done), or at once when less than ``LOW_WATER`` of the reserve
  is left. Faulting memory in beside a save slows the save's own work on this kind of machine (a
  page fault costs ~3 us; a turn's chunk checks took 1.2 ms instead of 0.17 while the pool refilled
  the turn's 1.8 MB beside them);
- **bounded**: at most ``reserve_bytes`` of free buffers are kept per size (more are let go).

Values are numpy uint8 arrays; the tier hands out read-only views of them.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
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


#: The sizes the pool touches buffers ahead for: the most recently asked.
SIZES_AHEAD = 4
#: A buffer is lent ahead only for values this large (smaller ones cost little to fault in).
MIN_AHEAD_BYTES = 64 << 10
#: The pause in the takes the pool waits for before faulting memory in (a save's takes come together).
QUIET_S = 0.002
#: ... unless less than this fraction of a size's reserve is ready: then it refills at once.
LOW_WATER = 0.25


def _touched(n: int) -> np.ndarray:
    buf = np.empty(n, np.uint8)
    buf[:] = 0  # every page faulted in now (numpy fills a large array with the GIL released)
    return buf


class HostPool:
    """``take(n)`` a buffer of n bytes, ``give(buf)`` it back when its value is dropped."""

    def __init__(self, reserve_bytes: int) -> None:
        self.reserve_bytes = reserve_bytes
        self._lock = threading.Lock()
        self._free: dict[int, deque[np.ndarray]] = {}  # size -> given back, maybe still referred to
        self._ahead: dict[int, deque[np.ndarray]] = {}  # size -> touched, never lent
        self._recent: OrderedDict[int, None] = OrderedDict()  # sizes asked for, most recent last
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._last_take = 0.0  # time.monotonic() of the last take of a size the pool keeps ahead
        self.faulted_in_line = 0  # buffers a take had to fault in itself (none ready)
        #: buffers ``lend`` handed out that the tier may adopt as a value's (by id, while alive)
        self._lent: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()

    def lend(self, n: int) -> np.ndarray:
        """``take``, for a caller that fills it and hands it to the tier as a value (``adopt``): a
        save's private copy of what a client sent becomes the stored value, not a second copy."""
        buf = self.take(n)
        with self._lock:
            self._lent[id(buf)] = buf
        return buf

    def adopt(self, obj: object) -> bool:
        """Whether ``obj`` is a buffer ``lend`` handed out and not yet adopted (it is now)."""
        with self._lock:
            return self._lent.pop(id(obj), None) is obj

    def take(self, n: int) -> np.ndarray:
        """A buffer of exactly ``n`` bytes, contents undefined: recycled, touched ahead, or new."""
        with self._lock:
            buf = self._recycled(n)
            if buf is None and (ready := self._ahead.get(n)):
                buf = ready.popleft()
            if n >= MIN_AHEAD_BYTES and self.reserve_bytes and not self._closed:
                self._recent[n] = None
                self._recent.move_to_end(n)
                while len(self._recent) > SIZES_AHEAD:
                    self._ahead.pop(self._recent.popitem(last=False)[0], None)
                self._start()
                self._last_take = time.monotonic()
                self._wake.notify()
        if buf is None:
            self.faulted_in_line += n >= MIN_AHEAD_BYTES
            buf = np.empty(n, np.uint8)
        return buf

    def give(self, buf: np.ndarray) -> None:
        """``buf``'s value was dropped: lend it again once nothing else refers to it."""
        with self._lock:
            if self._closed:
                return
            free = self._free.setdefault(len(buf), deque())
            if len(buf) * (len(free) + 1) <= max(self.reserve_bytes, len(buf)):
                free.append(buf)

    def _recycled(self, n: int) -> np.ndarray | None:
        """A given-back buffer of ``n`` bytes nothing refers to any more (under the lock)."""
        free = self._free.get(n)
        if not free:
            return None
        for _ in range(len(free)):
            buf = free.popleft()
            # references: the deque's was just dropped; what remains is ``buf`` and getrefcount's argument
            if sys.getrefcount(buf) <= 2:
                return buf
            free.append(buf)  # a reader still holds a view of it
        return None

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._fill, name="host-pool", daemon=True)
            self._thread.start()

    def _fill(self) -> None:
        """Keep ``reserve_bytes`` of touched buffers of each recent size, faulting them in unlocked."""
        while True:
            with self._lock:
                n = self._short()
                while not self._closed and n is None:
                    self._wake.wait()
                    n = self._short()
                if self._closed or n is None:
                    return
                self._wait_quiet(n)
                if self._closed:
                    return
            buf = _touched(n)
            with self._lock:
                if n in self._recent:
                    self._ahead.setdefault(n, deque()).append(buf)

    def _wait_quiet(self, n: int) -> None:
        """Wait (under the lock) until the takes pause for ``QUIET_S``, or size ``n``'s ready buffers fall
        under ``LOW_WATER`` of the reserve."""
        while not self._closed:
            ready = len(self._ahead.get(n, ())) + len(self._free.get(n, ()))
            left = QUIET_S - (time.monotonic() - self._last_take)
            if left <= 0 or n * ready < LOW_WATER * self.reserve_bytes:
                return
            self._wake.wait(left)

    def _short(self) -> int | None:
        """A recent size whose touched buffers fall short of the reserve (under the lock)."""
        for n in reversed(self._recent):
            have = len(self._ahead.get(n, ())) + len(self._free.get(n, ()))
            if n * (have + 1) <= self.reserve_bytes:
                return n
        return None

    def held_bytes(self) -> int:
        """Bytes of buffers the pool holds that no value uses (free and touched ahead)."""
        with self._lock:
            return sum(len(b) for q in (*self._free.values(), *self._ahead.values()) for b in q)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._free.clear()
            self._ahead.clear()
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
