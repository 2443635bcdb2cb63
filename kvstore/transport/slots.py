"""Slots: the scatter form of a load into the caller's memory, for engine pages.

An engine's CPU cache is one region cut into slots (vLLM's primary tier: one block stride per
slot). A load of page blobs names that region (``CallerMemory``: address, size), ``slot_bytes`` and,
for each key, the offset of its slot; the daemon writes each verified blob's payload (the engine's
block bytes, kvstore/format/page.py) at its slot's start, nothing else: the header and checksum stay
with the daemon, the bytes of a slot past the payload, and every slot of a miss, are left as they
were. Both sides check the slots the same way, before any byte is written (this module: the daemon
on the request, the client before its own copy where the daemon cannot write).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.errors import InvalidArgument


def check(offsets: Sequence[int] | np.ndarray, slot_bytes: int, size: int, n_keys: int) -> np.ndarray:
    """The slot offsets as uint64, if there is one per key and every slot lies inside the
    ``size``-byte region without overlapping another; else InvalidArgument naming the field."""
    off = np.asarray(offsets, np.uint64).reshape(-1)
    if len(off) != n_keys:
        raise InvalidArgument(f"CallerMemory.slot_offsets names {len(off)} slots for {n_keys} keys: one per key")
    if slot_bytes <= 0:
        raise InvalidArgument("CallerMemory.slot_bytes must be positive with slot_offsets")
    if not n_keys:
        return off
    if slot_bytes > size or int(off.max()) > size - slot_bytes:
        bad = int(np.argmax(off > np.uint64(max(size - slot_bytes, 0)))) if slot_bytes <= size else 0
        raise InvalidArgument(f"CallerMemory.slot_offsets[{bad}] = {int(off[bad])}: a slot of {slot_bytes} bytes "
                              f"there ends past the region's {size} bytes")
    order = np.argsort(off, kind="stable")
    gaps = np.diff(off[order])
    if (gaps < np.uint64(slot_bytes)).any():
        j = int(order[int(np.argmax(gaps < np.uint64(slot_bytes))) + 1])
        raise InvalidArgument(f"CallerMemory.slot_offsets[{j}] = {int(off[j])} overlaps another slot "
                              f"({slot_bytes} bytes each)")
    return off
