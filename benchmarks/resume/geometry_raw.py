"""The floors the resume benchmark measures the daemon against, on the same bytes in the same run:
a memcpy into a reused buffer, raw LMDB puts with an fsync'd commit per turn, raw LMDB reads of every
chunk in one read transaction; and the page cache control for "ssd, cache dropped" (posix_fadvise
DONTNEED, checked with mincore).

The raw environment is opened as the ssd tier opens its own (no writemap, no readahead, sync on),
values stored bare (the tier adds a 9-byte record header and compresses the scales tail).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Sequence
from pathlib import Path

import lmdb
import numpy as np


class RawLmdb:
    """One LMDB environment holding a session's chunks, keyed as the daemon keys them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self._open(readahead=False)

    def _open(self, readahead: bool) -> None:
        self.env = lmdb.open(str(self.path), map_size=1 << 40, max_dbs=2, sync=True, metasync=True,
                             writemap=False, readahead=readahead)
        self.db = self.env.open_db(b"chunks")

    def put_turn(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> float:
        """One write transaction of ``items``, committed (and fsynced); its seconds."""
        t = time.perf_counter()
        with self.env.begin(write=True, db=self.db) as txn:
            for key, value in items:
                txn.put(key, value)
        return time.perf_counter() - t

    def read_all(self, keys: Sequence[bytes], into: np.ndarray | None = None) -> tuple[float, int]:
        """Every chunk in one read transaction (``buffers=True``: views into the map), copied into
        ``into`` (back to back) when given; (seconds, bytes)."""
        t = time.perf_counter()
        total = 0
        with self.env.begin(db=self.db, buffers=True) as txn:
            if into is None:
                for key in keys:
                    total += len(txn.get(key))
            else:
                out = memoryview(into.data)
                for key in keys:
                    v = txn.get(key)
                    out[total : total + len(v)] = v
                    total += len(v)
        return time.perf_counter() - t, total

    def reopen(self, readahead: bool = False) -> None:
        """Close and open again (this process's mapping of the file is gone, so its pages can be
        dropped), with the kernel's readahead on the map or (the ssd tier's setting) off."""
        self.env.close()
        self._open(readahead)

    def close(self) -> None:
        self.env.close()


def memcpy(src: memoryview, dest: np.ndarray) -> float:
    """One copy of ``src`` into the (reused, already faulted-in) ``dest``; its seconds."""
    t = time.perf_counter()
    dest[: len(src)] = np.frombuffer(src, np.uint8)
    return time.perf_counter() - t


def resident_fraction(path: Path) -> float | None:
    """The fraction of ``path``'s pages in the page cache (mincore over a fresh read-only mapping,
    which faults nothing in), or None where mincore is not to be had."""
    size = path.stat().st_size
    if not size:
        return 0.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if libc.mincore(addr, size, vec) != 0:
                return None
            return float(np.frombuffer(vec, np.uint8).__and__(1).mean())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
