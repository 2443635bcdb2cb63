"""Memory for the host tier's values that a save or a promotion never waits to fault in.

A value copied into fresh memory pays a page fault per 4 KiB first: on this kind of machine a 229 KB
chunk copied into a new buffer took 122 us, into a reused one 6 us. And a host tier that keeps each
save's copies in the allocator's heap takes the very memory LMDB freed after its last write
transaction, so LMDB's next one faults in new pages too. So the host tier keeps its values in
buffers of this pool:

- **recycled**: a value dropped (deleted, evicted, replaced) gives its buffer back; it is lent again,
  for a value of the same size, once nothing else refers to it (a reader's view keeps it from reuse:
  its reference count says so, and a buffer still referred to is simply not lent);
- **touched ahead**: for each size asked for lately, a thread keeps ``reserve_bytes`` of buffers
  already faulted in, refilled after each take, off the caller's path;
- **bounded**: at most ``reserve_bytes`` of free buffers are kept per size (more are let go).

Values are numpy uint8 arrays; the tier hands out read-only views of them.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import OrderedDict, deque

import numpy as np

#: The sizes the pool touches buffers ahead for: the most recently asked.
SIZES_AHEAD = 4
#: A buffer is lent ahead only for values this large (smaller ones cost little to fault in).
MIN_AHEAD_BYTES = 64 << 10


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
            buf = _touched(n)
            with self._lock:
                if n in self._recent:
                    self._ahead.setdefault(n, deque()).append(buf)

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
