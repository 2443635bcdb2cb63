"""Readahead on the ssd tier's memory map while a batch read runs, off otherwise.

The tier opens LMDB with readahead off (MDB_NORDAHEAD: ``madvise(MADV_RANDOM)`` over the map): a
lookup of one value must not read megabytes of its neighbours. A whole-session load is the other
case: its chunks were saved turn by turn, so they lie in runs in the file, and with readahead off a
load after the page cache lost them faults them in a page at a time (py-lmdb touches every page of
each value it returns). So a batch read of many values turns the map's readahead on
(``MADV_NORMAL``) while it runs, and the last concurrent one to end turns it off again. It is a hint:
no byte read changes. Where the map cannot be found or advised (no ``/proc/self/maps``, no
``madvise``), reads go on as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections.abc import Callable, Iterator

#: A batch read of this many keys or more reads ahead.
READAHEAD_KEYS = 16


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def mappings(path: str, maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """(start, length) of each mapping of ``path`` in this process; [] where that cannot be known."""
    want = os.path.realpath(path)
    out = []
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == want:
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    out.append((start, end - start))
    except OSError:
        return []
    return out


class MapAdvice:
    """The readahead advice of one data file's mappings in this process (LMDB's map of it)."""

    def __init__(self, data_file: str) -> None:
        self.data_file = data_file
        self._madvise = _libc_madvise() if hasattr(mmap, "MADV_RANDOM") else None
        self._lock = threading.Lock()
        self._active = 0
        self._spans: list[tuple[int, int]] | None = None  # the file's mappings, looked up once per map

    def remapped(self) -> None:
        """The map moved (LMDB mapped the file anew to grow it): look its mappings up again."""
        with self._lock:
            self._spans = None

    @contextlib.contextmanager
    def reading_ahead(self, n_keys: int) -> Iterator[None]:
        """Readahead on for the block when the read is a batch of ``n_keys`` >= READAHEAD_KEYS. The
        map must not be resized meanwhile (the tier's gate is held shared around it)."""
        if n_keys < READAHEAD_KEYS or self._madvise is None:
            yield
            return
        with self._lock:
            self._active += 1
            if self._active == 1:
                self._advise(mmap.MADV_NORMAL)
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self._advise(mmap.MADV_RANDOM)

    def _advise(self, advice: int) -> bool:
        """``advice`` on every mapping of the file (under the lock); whether there was one and each
        took it."""
        assert self._madvise is not None
        if not self._spans:
            self._spans = mappings(self.data_file)
        return bool(self._spans) and all(self._madvise(start, length, advice) == 0 for start, length in self._spans)
