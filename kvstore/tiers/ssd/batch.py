"""The ssd tier's batch reads: N records in one LMDB read transaction (``SsdTier.read_views`` calls
these with the transaction open).

A record stored raw (flag 0) is handed out as a view into the memory map: no copy, no decode, one
header check (``RecordCodec.view``); a caller that copies it (``kvstore.format.chunk_batch.check``
with a destination) makes the one copy out of the tier. A compressed record is decoded into a
buffer lent for the read (``views``). A record whose framing
is damaged is reported unreadable, never returned: the store drops it there and reads another copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.tiers.base import CorruptValue, Stored, Views
from kvstore.tiers.scratch import Scratch
from kvstore.tiers.ssd.record import HEADER, RAW, RecordCodec

#: Lends a read a buffer of n bytes for its decoded records, valid until the read ends (``Scratch``).
Lend = Callable[[int], np.ndarray]


def scratch() -> Scratch[np.ndarray]:
    """The shelf of buffers the ssd tier's batch reads decode records into (pageable memory)."""
    return Scratch(lambda n: np.empty(n, np.uint8))


def views(txn: Any, codec: RecordCodec, keys: Sequence[bytes], lend: Lend | None = None) -> Views:
    """Each key's value (None where absent), valid while ``txn`` (opened with ``buffers=True``) is and,
    for a record decoded into a buffer ``lend`` lent, while that is."""
    records = [txn.get(key) for key in keys]
    if lend is not None and (packed := _decoded(codec, keys, records, lend)) is not None:
        return packed
    try:  # the common case: every record sound, one comprehension, no Python per record beyond its view
        return Views([None if r is None else codec.view(k, r) for k, r in zip(keys, records)], frozenset())
    except CorruptValue:
        pass
    values: list[Stored | None] = []
    bad: set[int] = set()
    for i, (key, record) in enumerate(zip(keys, records)):
        try:
            values.append(None if record is None else codec.view(key, record))
        except CorruptValue:
            values.append(None)
            bad.add(i)
    return Views(values, frozenset(bad))


def _decoded(codec: RecordCodec, keys: Sequence[bytes], records: Sequence[Any], lend: Lend) -> Views | None:
    """The values when some records are compressed: raw ones as views into the map, compressed ones
    decoded back to back into one lent buffer. None when a record's framing is damaged (the caller
    then sorts them out one by one)."""
    at: list[tuple[int, int, int]] = []  # (index, offset, length) of each compressed record's value
    total = 0
    try:
        for i, (key, r) in enumerate(zip(keys, records)):
            if r is not None and not (len(r) >= HEADER.size and r[0] == RAW):
                n = codec.raw_length(key, r)
                at.append((i, total, n))
                total += n
        if not at:
            return None
        buf = lend(total).data
        values: list[Stored | None] = [None if r is None else codec.view(k, r) if r[0] == RAW else None
                                       for k, r in zip(keys, records)]
        for i, off, n in at:
            got = codec.decode_into(keys[i], records[i], buf[off : off + n])
            values[i] = buf[off : off + got]
    except CorruptValue:
        return None
    return Views(values, frozenset())
