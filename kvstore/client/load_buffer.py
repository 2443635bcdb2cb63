"""The memory a default load (``Client.load_session()``) is answered in, on the daemon's host.

The daemon writes the whole answer into one buffer of the caller's (the ``load_session_into`` path,
kvstore/client/load_into.py), and the caller gets read-only views of it: one copy from the tier, no
allocation per chunk. What costs is fresh memory: every page of a new buffer faults in zeroed
(117 MB: ~20 ms with 2 MiB pages, twice that with 4 KiB ones, as much as the copy itself). So:

- a buffer is address space reserved at a size (``MAP_NORESERVE``), backed by transparent huge
  pages where the kernel has them; only what an answer reaches is ever touched;
- the client keeps the last one and answers the next load in it again, but only once nothing of the
  previous answer is alive: the views it handed out each hold the buffer, so while the caller keeps
  any of them (or anything made from them without a copy) the buffer is busy and a fresh one is
  taken. A view the caller may keep is therefore never written again under it.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
import threading

#: the least a buffer reserves (address space, not memory): a 1M-token DeepSeek-V4.1 session is 0.94 GB
MIN_RESERVE = 1 << 30


class LoadBuffers:
    """The buffer a default load is answered in: the one kept, while no view of it is alive, else a
    fresh one (kept from then on). Thread-safe: a buffer taken by one thread is busy for the others."""

    def __init__(self, keep_bytes: int, reserve_bytes: int = MIN_RESERVE) -> None:
        self.keep_bytes = keep_bytes  # a larger buffer is not kept after its load (its memory stays touched)
        self._size = reserve_bytes  # a fresh buffer's size: grows to the largest answer asked for
        self._kept: mmap.mmap | None = None
        self._lock = threading.Lock()

    def take(self, nbytes: int = 0) -> memoryview:
        """A writable buffer of at least ``nbytes`` bytes that nobody else holds (fresh ones are as large
        as the largest asked for). Its memory is the caller's while any view of it lives."""
        with self._lock:
            kept = self._kept
            # references: self._kept, ``kept``, getrefcount's argument; any more is a view alive
            if kept is not None and len(kept) >= nbytes and sys.getrefcount(kept) == 3:
                return memoryview(kept)
            self._size = max(self._size, nbytes)
            buf = _reserve(self._size)
            self._kept = buf if len(buf) <= max(self.keep_bytes, MIN_RESERVE) else None
            return memoryview(buf)

    def close(self) -> None:
        """Forget the kept buffer (unmapped once no view of it is alive)."""
        with self._lock:
            self._kept = None


def _reserve(nbytes: int) -> mmap.mmap:
    """``nbytes`` of private anonymous memory, reserved (no swap accounted) and touched only as written,
    in 2 MiB pages where the kernel's transparent huge pages allow it (``madvise`` mode)."""
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # no transparent huge pages here: 4 KiB pages, the same answer
            buf.madvise(mmap.MADV_HUGEPAGE)
    return buf
