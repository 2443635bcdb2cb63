"""Buffers a batch read borrows for its values and gives back when it ends, kept for the next read.

A load of hundreds of megabytes into fresh memory faults in every page of it first (on this kind of
machine that costs more than filling it), and a fresh pinned buffer costs a ``cudaHostAlloc`` of that
size. The ssd tier lends pageable buffers for the records it decodes (``tiers/ssd/batch.py``), the HBM tier
pinned ones for what it copies out of device memory (``hbm/tier.py``): the same shelf, another allocator.
A lend takes the smallest kept buffer large enough, else allocates one; at most ``keep`` buffers
(the largest) stay on the shelf after a read.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

#: the smallest buffer allocated (a few small reads share one)
MIN_BYTES = 1 << 20


class _Buffer(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, s: slice, /) -> _Buffer: ...


B = TypeVar("B", bound=_Buffer)


class Scratch(Generic[B]):
    """``with scratch.lending() as lend:`` ``lend(n)`` a buffer of ``n`` bytes (a slice of one kept or
    allocated with ``alloc``), the read's alone until the block ends."""

    def __init__(self, alloc: Callable[[int], B], keep: int = 2) -> None:
        self._alloc = alloc
        self._free: list[B] = []
        self._lock = threading.Lock()
        self._keep = keep

    @contextlib.contextmanager
    def lending(self) -> Iterator[Callable[[int], B]]:
        lent: list[B] = []

        def lend(n: int) -> B:
            with self._lock:
                fit = [i for i, b in enumerate(self._free) if len(b) >= n]
                buf = None
                if fit:  # by position: a numpy buffer compares element-wise, so list.remove(buf) cannot find it
                    buf = self._free.pop(min(fit, key=lambda i: len(self._free[i])))
            if buf is None:
                buf = self._alloc(max(n, MIN_BYTES))
            lent.append(buf)
            return buf[:n]  # type: ignore[return-value]

        try:
            yield lend
        finally:
            with self._lock:
                self._free = sorted([*self._free, *lent], key=len)[-self._keep :]

    def clear(self) -> None:
        with self._lock:
            self._free = []
