"""The one interface every storage tier implements: batches in and out, a stats snapshot, close.

A tier is a flat key -> value map with an eviction order. Keys are opaque bytes (1 to 256 of
them: 16-byte chunk hashes in practice); values are opaque
bytes (chunk blobs of ~10 KB to a few MB). Tiers never know about each other and never drop data
on their own to respect a capacity: the tiered store reads ``stats()`` and ``victims()`` and
demotes. Bad arguments raise ``ValueError``; infrastructure failures raise ``TierError``.
Records that are not values (session manifests) live in the tier's separate ``meta()`` keyspace.

The methods are the ones the store calls, in the shape it calls them: in batches (a save, a load,
a session's removal are batches; one key is a batch of one, ``kvstore/store/tiered/slot.py``). A tier
implements the abstract ones and overrides a default only where it does better (one transaction,
one round trip, views with no copy).
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import NamedTuple, TypeVar

MAX_KEY_BYTES = 256
_T = TypeVar("_T", bound="Tier")

#: What a tier accepts as a value; it copies what it keeps, so the caller may reuse the buffer.
Value = bytes | bytearray | memoryview
#: What a tier returns for a hit: bytes or a read-only memoryview, never aliasing a caller buffer.
Stored = bytes | memoryview


class Usage(NamedTuple):
    """A tier's occupancy, as the store needs it to decide what to demote."""

    used_bytes: int  # bytes this tier holds for values (for ssd: stored, i.e. compressed, bytes)
    capacity_bytes: int  # 0 = unlimited
    items: int
    raw_bytes: int  # uncompressed bytes of the values held (== used_bytes where nothing is compressed)


class TierError(Exception):
    """A tier failed (e.g. Redis connection lost). The caller degrades around it."""


class TierFullError(TierError):
    """A put did not fit in the tier's free space. The store makes room before it puts (demoting the
    tier's ``victims()``) and skips a put that still does not fit: a cache tier's miss, never an error."""


class OutOfSpace(TierError):
    """The tier's storage is exhausted (a full disk, a configured size limit): the write was not
    made, what was stored before is intact, and the same write may succeed once space returns."""


class CorruptValue(TierError):
    """A stored value's framing is damaged: the value is unreadable, the tier is fine. The store
    deletes it there and serves another copy."""


def check_key(key: bytes) -> bytes:
    """Validate a key: ``bytes`` of length 1 to ``MAX_KEY_BYTES``."""
    if not isinstance(key, bytes):
        raise ValueError(f"tier keys must be bytes, got {type(key).__name__}")
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"tier keys must be 1 to {MAX_KEY_BYTES} bytes long, got {len(key)}")
    return key


def check_value(value: Value) -> memoryview:
    """Validate a value and return it as a flat, contiguous byte view (no copy)."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ValueError(f"tier values must be bytes, bytearray or memoryview, got {type(value).__name__}")
    view = memoryview(value)
    if not view.contiguous:
        raise ValueError("tier values must be contiguous buffers")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Views(NamedTuple):
    """What ``Tier.read_views`` found: each key's value (None where it is absent or unreadable), and
    which keys' records are unreadable (damaged framing: ``get_many`` raises CorruptValue for them)."""

    values: list[Stored | None]
    unreadable: frozenset[int]  # indices into the keys


@dataclass(frozen=True)
class LmdbPages:
    """LMDB's own page statistics for an ssd tier's values and meta sub-databases together: what
    the storage costs beyond the bytes stored (``kvstore stats``' bytes per token)."""

    psize: int  # bytes per page
    depth: int  # of the values' B-tree
    branch_pages: int
    leaf_pages: int
    overflow_pages: int
    entries: int
    map_size: int
    last_pgno: int
    file_bytes: int  # (last_pgno + 1) * psize: the data file's extent in use
    last_txnid: int  # write transactions so far (each one commit, one fsync)

    @property
    def in_use(self) -> int:
        """Pages in use by both sub-databases."""
        return self.branch_pages + self.leaf_pages + self.overflow_pages


@dataclass(frozen=True)
class TierStats:
    """What a tier reports of itself: its occupancy, and the facts only some tiers have."""

    usage: Usage
    pages: LmdbPages | None = None  # an LMDB tier's, when asked for (``Tier.stats(pages=True)``)
    salvaged: str = ""  # what an open-time repair of damaged storage did ("": none was needed)


@dataclass(frozen=True)
class WriteBatch:
    """Writes a tier applies together (``Tier.write``): a turn's new values and its manifest, the
    values a replaced or deleted session alone used and its manifest's removal."""

    puts: Sequence[tuple[bytes, Value]] = ()
    deletes: Sequence[bytes] = ()
    meta_puts: Sequence[tuple[bytes, bytes]] = ()
    meta_deletes: Sequence[bytes] = ()

    def __bool__(self) -> bool:
        return bool(self.puts or self.deletes or self.meta_puts or self.meta_deletes)


class MetaMap(abc.ABC):
    """A tier's second keyspace, for small records that are not values (session manifests). Its
    keys never mix with the tier's values, so nothing has to tell the two kinds apart."""

    @abc.abstractmethod
    def put(self, key: bytes, value: bytes) -> None:
        """Store ``value`` under ``key`` atomically (a crash leaves the old value or the new one)."""

    @abc.abstractmethod
    def get(self, key: bytes) -> bytes | None:
        """The record under ``key``, or None."""

    @abc.abstractmethod
    def delete(self, key: bytes) -> bool:
        """Remove ``key``; True if it was present."""

    @abc.abstractmethod
    def keys(self) -> Iterator[bytes]:
        """Every key held; a snapshot."""


class MemoryMeta(MetaMap):
    """Records in a dict: the meta keyspace of a tier that does not persist anyway."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[bytes, bytes] = {}

    def put(self, key: bytes, value: bytes) -> None:
        value = bytes(value)
        with self._lock:
            self._records[check_key(key)] = value

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            return self._records.get(key)

    def delete(self, key: bytes) -> bool:
        with self._lock:
            return self._records.pop(key, None) is not None

    def keys(self) -> Iterator[bytes]:
        with self._lock:
            return iter(list(self._records))


class Tier(abc.ABC):
    """A key -> value store with an eviction order. Implementations are thread-safe."""

    name: str  # "hbm" | "host" | "ssd" | "redis"
    persistent: bool  # survives a process restart (ssd, redis) or not (host, hbm)

    @abc.abstractmethod
    def put_many(self, items: Iterable[tuple[bytes, Value]]) -> None:
        """Store a copy of each value under its key, replacing any previous value (a key given twice:
        the last value wins); marks them recently used. A tier that can, writes them together (one
        transaction, one round trip)."""

    @abc.abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> list[Stored | None]:
        """The value stored under each key, in order, None for each miss; each hit marks its key
        recently used. A value's framing found damaged raises ``CorruptValue``."""

    @abc.abstractmethod
    def delete_many(self, keys: Iterable[bytes]) -> int:
        """Remove the keys; returns how many were present."""

    @abc.abstractmethod
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is present. Does not change the eviction order."""

    @abc.abstractmethod
    def size_of(self, key: bytes) -> int | None:
        """Stored bytes of one value (what it counts for in ``stats().usage.used_bytes``), None if absent."""

    @abc.abstractmethod
    def keys(self) -> Iterator[bytes]:
        """Every key held (for restart reconciliation and GC); a snapshot, in no particular order."""

    @abc.abstractmethod
    def victims(self) -> Iterator[bytes]:
        """Keys in eviction order, least recently used first; a snapshot, so the caller may delete
        while iterating. Empty for tiers that evict by themselves (redis)."""

    @abc.abstractmethod
    def stats(self, pages: bool = False) -> TierStats:
        """Bytes and items held now and the configured capacity, and what else the tier knows of
        itself: damage repaired at its open, and (``pages``: asked for a report, not for every
        capacity check, since it costs a read transaction) its storage engine's page statistics."""

    @abc.abstractmethod
    def meta(self) -> MetaMap:
        """The tier's meta keyspace (see ``MetaMap``): a ``MemoryMeta`` for a tier that does not
        persist anyway."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources. Idempotent; any other call afterwards raises ``TierError``."""

    def buffer_for(self, n: int) -> memoryview | None:
        """A writable buffer of ``n`` bytes to build a value in that a ``put_many`` of it (whole, unchanged
        since) keeps without copying; None where the tier copies anyway (the default)."""
        return None


    def write(self, batch: WriteBatch) -> int:
        """Apply ``batch`` (see ``WriteBatch``); returns how many of its deleted keys (values and
        meta records) were present. A tier with transactions applies it in one, so a crash leaves
        all of it or none; this default goes in the order that keeps a crash safe without one:
        values, then meta records (a manifest never names a value not yet written), then the meta
        deletes, then the value deletes (a manifest is gone before the values it named)."""
        self.put_many(batch.puts)
        meta = self.meta()
        for key, value in batch.meta_puts:
            meta.put(key, value)
        gone = sum(meta.delete(key) for key in batch.meta_deletes)
        return gone + self.delete_many(batch.deletes)

    @contextlib.contextmanager
    def read_views(self, keys: Sequence[bytes]) -> Iterator[Views]:
        """``get_many`` for a batch read inside the ``with`` block, whose values are valid only there: a
        tier reading from a memory map (ssd) hands out views into it, with no copy (copy what you
        keep). A damaged record is reported in ``unreadable``, not raised, so that one does not fail
        the batch; other failures raise TierError. This default: ``get_many``, and key by key once
        it raises CorruptValue."""
        try:
            views = Views(self.get_many(keys), frozenset())
        except CorruptValue:
            values: list[Stored | None] = []
            bad: set[int] = set()
            for i, key in enumerate(keys):
                try:
                    values.append(self.get_many([key])[0])
                except CorruptValue:
                    values.append(None)
                    bad.add(i)
            views = Views(values, frozenset(bad))
        yield views  # the caller's errors are not ours to catch: raised out of the with block as they are

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
