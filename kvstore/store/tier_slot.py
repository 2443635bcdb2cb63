"""One tier as the tiered store drives it: typed calls that count a failure against the tier (and
mark it degraded) instead of failing the store, the tier's counters, and the tier's own lock."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvstore.tiers.base import CorruptValue, Stored, Tier, TierError, Usage, Value, Views, WriteBatch

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_D = TypeVar("_D")


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

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.counters = TierCounters()
        self.lock = threading.RLock()
        repaired = getattr(tier, "salvaged", "")  # damage repaired at open is reported like any failure
        if repaired:
            self.counters.errors, self.counters.last_error = 1, repaired

    @property
    def name(self) -> str:
        return self.tier.name

    def call(self, what: str, op: Callable[[Tier], _T]) -> _T:
        """``op(tier)``; a TierError is counted (``what`` names the call in the log) and raised."""
        c = self.counters
        try:
            out = op(self.tier)
        except CorruptValue:
            raise  # one damaged value, not a failing tier: the caller deletes it
        except TierError as e:
            self._failed(what, e)
            raise
        c.degraded = False
        return out

    def _failed(self, what: str, e: TierError) -> None:
        c = self.counters
        c.errors += 1
        c.last_error, c.degraded = str(e), True
        log.warning("tier %s failed on %s: %s", self.name, what, e)

    def attempt(self, what: str, op: Callable[[Tier], _T], default: _D) -> _T | _D:
        """``call``, with ``default`` for a failure (counted all the same)."""
        try:
            return self.call(what, op)
        except TierError:
            return default

    # -- the calls the tiered store makes, typed; the quiet ones degrade to a default ----------------
    def has(self, key: bytes) -> bool:
        return self.attempt("contains", lambda t: t.contains(key), False)

    def has_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.attempt("contains", lambda t: t.contains_many(keys), [False] * len(keys))

    def get(self, key: bytes) -> Stored | None:
        return self.attempt("get", lambda t: t.get(key), None)

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
        self.call("put", lambda t: t.put(key, value))

    def put_many(self, items: Sequence[tuple[bytes, Value]]) -> None:
        self.call("put_many", lambda t: t.put_many(items))

    def write(self, batch: WriteBatch) -> int:
        return self.call("write", lambda t: t.write(batch))

    def drop(self, key: bytes) -> bool:
        return self.attempt("delete", lambda t: t.delete(key), False)

    def drop_many(self, keys: Iterable[bytes]) -> int:
        return self.attempt("delete_many", lambda t: t.delete_many(keys), 0)

    def usage(self) -> Usage | None:
        return self.attempt("usage", lambda t: t.usage(), None)

    def victims(self) -> list[bytes]:
        return self.attempt("victims", lambda t: list(t.victims()), [])

    def size_of(self, key: bytes) -> int:
        return self.attempt("size_of", lambda t: t.size_of(key), None) or 0

    def keys(self) -> list[bytes]:
        return self.attempt("keys", lambda t: list(t.keys()), [])

    def report(self) -> TierReport:
        return TierReport(self.name, self.tier.persistent, self.usage() or Usage(0, 0, 0, 0), self.counters)
