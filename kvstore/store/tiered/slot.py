"""One tier as the tiered store drives it: typed calls that count a failure against the tier (and
mark it degraded) instead of failing the store, the tier's counters, and the tier's own lock."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, TypeVarTuple

from kvstore.store.tiered.ledger import Ledger
from kvstore.tiers.base import CorruptValue, Stored, Tier, TierError, TierStats, Usage, Value, Views, WriteBatch

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_D = TypeVar("_D")
_Args = TypeVarTuple("_Args")


@dataclass
class TierCounters:
    hits: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    verify_failures: int = 0
    errors: int = 0
    last_error: str = ""
    degraded: bool = False


@dataclass(frozen=True)
class TierReport:
    """One tier's state, as `kvstore stats` shows it."""

    name: str
    persistent: bool
    usage: Usage
    counters: TierCounters = field(default_factory=TierCounters)


class TierSlot:
    """A tier, its counters, and ``lock``: held while chunks move into or out of this tier (its
    capacity is made room in, a chunk demoted or promoted), never by a plain read, and never
    across the durable tier's commit of a save. Locks of several slots are taken fast to slow."""

    def __init__(self, tier: Tier, ledger: Ledger | None = None) -> None:
        self.tier = tier
        self.counters = TierCounters()
        self.lock = threading.RLock()
        #: Per-namespace usage (``ledger.py``), told of every put and drop, where it tracks this tier.
        self._ledger = ledger if ledger is not None and ledger.tracks(tier.name) else None

    @property
    def name(self) -> str:
        return self.tier.name

    def count_repairs(self) -> None:
        """Count damage the tier repaired at its open (``TierStats.salvaged``) like any failure:
        asked once, as the store opens, of the tiers it owns (not of one shared with other daemons)."""
        stats = self.stats()
        if stats is not None and stats.salvaged:
            self.counters.errors, self.counters.last_error = self.counters.errors + 1, stats.salvaged

    def call(self, what: str, op: Callable[[*_Args], _T], *args: *_Args) -> _T:
        """``op(*args)``, one of the tier's bound methods; a TierError is counted (``what`` names the
        call in the log) and raised."""
        try:
            out = op(*args)
        except CorruptValue:
            raise  # one damaged value, not a failing tier: the caller deletes it
        except TierError as e:
            self._failed(what, e)
            raise
        self.counters.degraded = False
        return out

    def _failed(self, what: str, e: TierError) -> None:
        c = self.counters
        c.errors += 1
        c.last_error, c.degraded = str(e), True
        log.warning("tier %s failed on %s: %s", self.name, what, e)

    def attempt(self, what: str, default: _D, op: Callable[[*_Args], _T], *args: *_Args) -> _T | _D:
        """``call``, with ``default`` for a failure (counted all the same)."""
        try:
            return self.call(what, op, *args)
        except TierError:
            return default

    # -- the calls the tiered store makes, typed; the quiet ones degrade to a default ----------------
    def has(self, key: bytes) -> bool:
        return self.attempt("contains_many", [False], self.tier.contains_many, [key])[0]

    def has_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.attempt("contains_many", [False] * len(keys), self.tier.contains_many, keys)

    def get(self, key: bytes) -> Stored | None:
        return self.attempt("get_many", [None], self.tier.get_many, [key])[0]

    @contextlib.contextmanager
    def read_views(self, keys: Sequence[bytes]) -> Iterator[Views]:
        """``Tier.read_views``: values valid inside the ``with`` block. A TierError opening the batch
        is counted and raised, as ``call`` does; one raised by the block itself is not the tier's."""
        entered = False
        try:
            with self.tier.read_views(keys) as views:
                entered = True
                yield views
        except TierError as e:
            if not entered and not isinstance(e, CorruptValue):
                self._failed("read_views", e)
            raise
        self.counters.degraded = False

    def put(self, key: bytes, value: Stored) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: Sequence[tuple[bytes, Value]]) -> None:
        self.call("put_many", self.tier.put_many, items)
        self._count_puts(items)

    def write(self, batch: WriteBatch) -> int:
        out = self.call("write", self.tier.write, batch)
        if self._ledger is not None:
            self._ledger.drop(self.name, batch.deletes)
            self._count_puts(batch.puts)
        return out

    def _count_puts(self, items: Sequence[tuple[bytes, Value]]) -> None:
        if self._ledger is None or not items:
            return
        size_of = self.tier.size_of
        got = []
        for k, v in items:
            try:
                n = size_of(k)
            except TierError:
                n = None
            got.append((k, memoryview(v).nbytes if n is None else n))
        self._ledger.put(self.name, got)

    def drop(self, key: bytes) -> bool:
        return self.drop_many([key]) == 1

    def drop_many(self, keys: Iterable[bytes]) -> int:
        keys = list(keys)
        try:
            n = self.call("delete_many", self.tier.delete_many, keys)
        except TierError:
            return 0
        if self._ledger is not None:
            self._ledger.drop(self.name, keys)
        return n

    def count_held(self) -> None:
        """Tell the ledger what this tier holds now (at open: the ssd tier's chunks of earlier runs)."""
        if self._ledger is not None:
            keys = self.keys()
            self._ledger.put(self.name, [(k, self.size_of(k)) for k in keys])

    def stats(self, pages: bool = False) -> TierStats | None:
        return self.attempt("stats", None, self.tier.stats, pages)

    def usage(self) -> Usage | None:
        stats = self.stats()
        return None if stats is None else stats.usage

    def victims(self) -> list[bytes]:
        return self.attempt("victims", [], _listed, self.tier.victims)

    def size_of(self, key: bytes) -> int:
        return self.attempt("size_of", None, self.tier.size_of, key) or 0

    def keys(self) -> list[bytes]:
        return self.attempt("keys", [], _listed, self.tier.keys)

    def report(self) -> TierReport:
        return TierReport(self.name, self.tier.persistent, self.usage() or Usage(0, 0, 0, 0), self.counters)


def _listed(snapshot: Callable[[], Iterator[bytes]]) -> list[bytes]:
    """The keys a tier's snapshot yields, read now: a tier may raise while they are read."""
    return list(snapshot())
