"""TieredStore: chunk blobs across tiers ordered fast to slow.

The tiers never know about each other; this class moves data between them:
- writes go to the fastest tier and (write-through, the default) to the persistent tier before
  the call returns, so every acknowledged chunk is durable;
- reads come from the fastest tier holding the chunk, are verified (checksum and the key the
  chunk claims), and are promoted to faster tiers; a chunk that fails verification is deleted
  from that tier and served from a slower one, or is a miss: never returned;
- a tier over its capacity demotes its least recently used chunks to the next tier (dropping them
  only where the next tier already holds them or there is none), skipping pinned chunks;
- a tier that fails (TierError, e.g. Redis down) is reported and degraded around.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvstore import chunk
from kvstore.errors import ResourceExhausted, Unavailable
from kvstore.store.config import StoreConfig
from kvstore.tiers.base import CorruptValue, MetaMap, OutOfSpace, Stored, Tier, TierError, Usage, WriteBatch

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


def chunk_is_valid(key: bytes, blob: Stored) -> bool:
    """A stored chunk is served only if its checksum holds and it claims the key it was found under."""
    try:
        header = chunk.read_header(blob)
        chunk.verify_checksum(blob)
    except chunk.ChunkError:
        return False
    return header.key == key


class TieredStore:
    def __init__(self, tiers: Sequence[Tier], config: StoreConfig) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        self.tiers = list(tiers)
        self.config = config
        self.counters = {t.name: TierCounters() for t in self.tiers}
        for t in self.tiers:  # damage a tier repaired while opening is reported like any failure
            repaired = getattr(t, "salvaged", "")
            if repaired:
                c = self.counters[t.name]
                c.errors, c.last_error = c.errors + 1, repaired
        persistent = [i for i, t in enumerate(self.tiers) if t.persistent]
        #: Index of the tier that makes a chunk durable (the first persistent one), or the last tier.
        self.durable = persistent[0] if persistent else len(self.tiers) - 1
        self._pins: Counter[bytes] = Counter()
        self._dirty: set[bytes] = set()
        #: Guards the dirty set and every move between tiers (capacity, demotion, promotion). Never
        #: held across the durable tier's commit: the tiers order their own writers.
        self._lock = threading.RLock()
        self._pin_lock = threading.Lock()

    # -- tier calls that degrade instead of failing -------------------------------------------
    def _call(self, i: int, what: str, op: Callable[[Tier], _T]) -> _T:
        """``op(tier i)``, counting a TierError against the tier (``what`` names the call in logs)."""
        tier = self.tiers[i]
        c = self.counters[tier.name]
        try:
            out = op(tier)
        except CorruptValue:
            raise  # one damaged value, not a failing tier: the caller deletes it
        except TierError as e:
            c.errors += 1
            c.last_error, c.degraded = str(e), True
            log.warning("tier %s failed on %s: %s", tier.name, what, e)
            raise
        c.degraded = False
        return out

    def _try(self, i: int, what: str, op: Callable[[Tier], _T], default: _D) -> _T | _D:
        try:
            return self._call(i, what, op)
        except TierError:
            return default

    def _has(self, i: int, key: bytes) -> bool:
        return self._try(i, "contains", lambda t: t.contains(key), False)

    def _drop(self, i: int, key: bytes) -> bool:
        return self._try(i, "delete", lambda t: t.delete(key), False)

    def _get(self, i: int, key: bytes) -> Stored | None:
        return self._try(i, "get", lambda t: t.get(key), None)

    def _put(self, i: int, key: bytes, blob: Stored) -> None:
        self._call(i, "put", lambda t: t.put(key, blob))

    def _size_of(self, i: int, key: bytes) -> int:
        return self._try(i, "size_of", lambda t: t.size_of(key), None) or 0

    # -- writes ---------------------------------------------------------------------------------
    def put(self, key: bytes, blob: bytes | memoryview) -> None:
        """Store a chunk. Write-through: returns once the durable tier holds it (else Unavailable)."""
        self.put_many([(key, blob)])

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> None:
        """Store chunks; the durable tier gets them in one batch (one transaction, one fsync).
        All or nothing: if the durable tier fails, what this call put in a faster tier is removed
        again (a chunk a faster tier already held before is left alone)."""
        if not items:
            return
        if self.config.write_mode == "back" and self.durable != 0:
            with self._lock:
                try:
                    self._make_room(0, sum(len(b) for _, b in items))
                    self._call(0, "put_many", lambda t: t.put_many(items))
                    self._dirty.update(k for k, _ in items)
                    return
                except TierError:
                    pass  # the fast tier cannot take them: write them through instead
        self.commit(WriteBatch(puts=items))

    def commit(self, batch: WriteBatch) -> None:
        """Write ``batch`` through to the durable tier in one transaction (one fsync): a turn's
        chunks and manifest, or a session's removal and the chunks only it used. New chunks also
        go to the fastest tier first (a cache: its failure does not fail the call) and deleted
        ones leave the tiers faster than the durable one once it has committed. All or nothing:
        if the durable tier fails, what this call put in a faster tier is removed again.

        No store lock is held while the durable tier commits (its fsync): reads, pins and other
        tiers' work go on meanwhile; the tier orders its own writers."""
        if not batch:
            return
        items = batch.puts
        size = sum(len(b) for _, b in items)
        fast: list[bytes] = []  # keys this call added to the fast tier
        with self._lock:
            if self.durable != 0 and items:
                had = {k for k, _ in items if self._has(0, k)}
                try:
                    self._make_room(0, size)
                    self._call(0, "put_many", lambda t: t.put_many(items))
                    fast = [k for k, _ in items if k not in had]
                except TierError:
                    pass  # a fast tier is a cache: the durable write below is what counts
            if items:
                self._make_room(self.durable, size)
        only_puts = not (batch.deletes or batch.meta_puts or batch.meta_deletes)
        try:
            if only_puts:  # the plain batch call, which every tier implements at its best
                self._call(self.durable, "put_many", lambda t: t.put_many(items))
            else:
                self._call(self.durable, "write", lambda t: t.write(batch))
        except TierError as e:
            for k in fast:
                self._drop(0, k)
            raise self._durable_error(e) from e
        with self._lock:
            self._dirty.difference_update(k for k, _ in items)
            self._dirty.difference_update(batch.deletes)
        for i in range(self.durable):
            if batch.deletes:
                self._try(i, "delete_many", lambda t: t.delete_many(batch.deletes), 0)

    def _durable_error(self, e: TierError) -> Exception:
        name = self.tiers[self.durable].name
        if isinstance(e, OutOfSpace):
            return ResourceExhausted(f"durable tier {name} is out of space: {e}")
        return Unavailable(f"durable tier {name} failed: {e}")

    def flush(self, keys: Sequence[bytes] | None = None) -> None:
        """Write-back mode: make ``keys`` (default: every dirty chunk) durable now."""
        with self._lock:
            todo = [k for k in (keys if keys is not None else list(self._dirty)) if k in self._dirty]
            for key in todo:
                blob = self._get(0, key)
                if blob is None:
                    blob = self.get(key)
                if blob is None:
                    raise Unavailable(f"chunk {key.hex()} was lost before it became durable")
                self._make_room(self.durable, len(blob))
                try:
                    self._put(self.durable, key, blob)
                except TierError as e:
                    raise self._durable_error(e) from e
                self._dirty.discard(key)

    def delete_many(self, keys: Sequence[bytes], local_only: bool = False) -> None:
        """Delete ``keys`` from every tier, one batch per tier (one transaction, one fsync on the
        durable tier), or (``local_only``) from the durable tier and faster ones: slower tiers may
        be shared with other daemons (Redis) and expire by TTL instead."""
        if not keys:
            return
        for i in range(self.durable + 1 if local_only else len(self.tiers)):
            self._try(i, "delete_many", lambda t: t.delete_many(keys), 0)
        with self._lock:
            self._dirty.difference_update(keys)

    def delete(self, key: bytes, local_only: bool = False) -> None:
        self.delete_many([key], local_only)

    # -- reads ----------------------------------------------------------------------------------
    def get(self, key: bytes, check: Callable[[Stored], bool] | None = None) -> Stored | None:
        """The verified chunk, from the fastest tier holding it; None on a miss. ``check`` is the
        verification (default: checksum and the key the chunk claims); a copy that fails it is
        counted, deleted from that tier, and the next tier is tried."""
        valid = check if check is not None else (lambda blob: chunk_is_valid(key, blob))
        for i in range(len(self.tiers)):
            name = self.tiers[i].name
            try:
                blob = self._call(i, "get", lambda t: t.get(key))
            except CorruptValue:
                blob = b""  # fails verification below: counted, deleted there, next tier tried
            except TierError:
                continue
            if blob is None:
                continue
            if not valid(blob):
                self.counters[name].verify_failures += 1
                log.error("chunk %s failed verification in tier %s: deleted there", key.hex(), name)
                self._drop(i, key)
                continue
            self.counters[name].hits += 1
            if i > 0 and self.config.promote_on_read:
                self._promote(key, blob, i)
            return blob
        return None

    def _promote(self, key: bytes, blob: Stored, found: int) -> None:
        # Best effort: a read never waits behind a write (a save may hold the lock through an
        # fsync); a chunk not promoted now is promoted by a later read.
        if not self._lock.acquire(blocking=False):
            return
        try:
            for i in range(found):
                try:
                    self._make_room(i, len(blob), protect=key)
                    self._put(i, key, blob)
                    self.counters[self.tiers[i].name].promotions += 1
                except TierError:
                    continue
        finally:
            self._lock.release()

    def where(self, key: bytes) -> list[str]:
        """Names of the tiers holding ``key`` (not verified; a lookup, not a read)."""
        return [t.name for i, t in enumerate(self.tiers) if self._has(i, key)]

    def contains(self, key: bytes) -> bool:
        return any(self._has(i, key) for i in range(len(self.tiers)))

    def holds_durably(self, key: bytes) -> bool:
        """Whether ``key`` is on the durable tier, or (write-back) waiting in the fast tier to get there.
        Tiers slower than the durable one do not count: they may be shared and expire by TTL."""
        return key in self._dirty or bool(self._has(self.durable, key))

    # -- meta records (manifests) live in the durable tier's own meta keyspace --------------------
    def _meta(self, what: str, op: Callable[[MetaMap], _T]) -> _T:
        tier = self.tiers[self.durable]
        try:
            return op(tier.meta())
        except TierError as e:
            c = self.counters[tier.name]
            c.errors += 1
            c.last_error, c.degraded = str(e), True
            log.warning("tier %s failed on meta %s: %s", tier.name, what, e)
            raise self._durable_error(e) from e

    def put_meta(self, key: bytes, value: bytes) -> None:
        self._meta("put", lambda m: m.put(key, value))

    def get_meta(self, key: bytes) -> bytes | None:
        return self._meta("get", lambda m: m.get(key))

    def meta_keys(self, prefix: bytes) -> Iterator[bytes]:
        try:
            keys = self._meta("keys", lambda m: list(m.keys()))
        except Unavailable:
            return iter(())
        return (k for k in keys if k.startswith(prefix))

    def migrate_meta(self, prefix: bytes, is_meta: Callable[[bytes, Stored], bool]) -> int:
        """Move the meta records an older format kept among the durable tier's values (under keys
        starting with ``prefix``, recognised by ``is_meta(key, value)``) into its meta keyspace,
        all at once. Returns how many moved; 0 once migrated."""
        i = self.durable
        try:
            candidates = [k for k in self._call(i, "keys", lambda t: t.keys()) if k.startswith(prefix)]
            values = self._call(i, "get_many", lambda t: t.get_many(candidates)) if candidates else []
            found = [k for k, v in zip(candidates, values) if v is not None and is_meta(k, v)]
            if found:
                self._call(i, "move_to_meta", lambda t: t.move_to_meta(found))
        except TierError as e:  # CorruptValue included: a damaged old record stays where it is
            log.error("cannot migrate old-format meta records in tier %s: %s", self.tiers[i].name, e)
            return 0
        if found:
            log.warning("moved %d meta records of the old format out of tier %s's values",
                        len(found), self.tiers[i].name)
        return len(found)

    def chunk_keys(self, local_only: bool = False) -> set[bytes]:
        """Every chunk key held by any tier (``local_only``: by the durable tier or a faster one)."""
        out: set[bytes] = set()
        for i in range(self.durable + 1 if local_only else len(self.tiers)):
            out.update(self._try(i, "keys", lambda t: t.keys(), ()))
        return out

    # -- movement between tiers -----------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> None:
        """Keep ``keys`` where they are until unpinned (e.g. while a session is being resumed).
        Pins have a lock of their own: a load pins its chunks without waiting for a save."""
        with self._pin_lock:
            self._pins.update(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        with self._pin_lock:
            self._pins.subtract(keys)
            for k in keys:
                if self._pins[k] <= 0:
                    self._pins.pop(k, None)

    def _pinned(self, key: bytes) -> bool:
        with self._pin_lock:
            return self._pins[key] > 0

    def demote(self, key: bytes, to: int) -> bool:
        """Move ``key`` down to tier ``to``: ensure it is there (or slower), drop it from faster tiers."""
        with self._lock:
            if self._pinned(key):
                return False
            holders = [i for i in range(len(self.tiers)) if self._has(i, key)]
            if not holders:
                return False
            if not any(i >= to for i in holders):
                blob = self._get(holders[0], key)
                if blob is None:
                    return False
                try:
                    self._make_room(to, len(blob))
                    self._put(to, key, blob)
                except TierError:
                    return False  # keep it where it is rather than lose it
                self.counters[self.tiers[holders[0]].name].demotions += 1
                if to >= self.durable:
                    self._dirty.discard(key)
            for i in holders:
                if i < to and (self._drop(i, key)):
                    self.counters[self.tiers[i].name].evictions += 1
            return True

    def _make_room(self, i: int, incoming: int, protect: bytes | None = None) -> None:
        """Demote LRU chunks out of tier ``i`` until ``incoming`` more bytes fit under its capacity."""
        usage = self._try(i, "usage", lambda t: t.usage(), None)
        if usage is None or not usage.capacity_bytes:
            return
        used, cap = usage.used_bytes, usage.capacity_bytes
        if used + incoming <= cap:
            return
        for victim in list(self._try(i, "victims", lambda t: t.victims(), ())):
            if used + incoming <= cap:
                break
            if victim == protect or self._pinned(victim):
                continue
            size = self._size_of(i, victim)
            if self._evict_one(i, victim):
                used -= size

    def _evict_one(self, i: int, key: bytes) -> bool:
        nxt = i + 1
        c = self.counters[self.tiers[i].name]
        if nxt < len(self.tiers) and not self._has(nxt, key):
            blob = self._get(i, key)
            if blob is None:
                return False
            try:
                self._make_room(nxt, len(blob), protect=key)
                self._put(nxt, key, blob)
            except TierError:
                # The next tier does not hold it and could not take it: this may be the only copy
                # (a dirty chunk, or the durable tier's), so keep it and stay over capacity.
                return False
            else:
                c.demotions += 1
                if nxt >= self.durable:
                    self._dirty.discard(key)
        elif key in self._dirty and nxt >= len(self.tiers):
            return False
        else:
            c.evictions += 1
        self._drop(i, key)
        return True

    # -- reporting ------------------------------------------------------------------------------
    def reports(self) -> list[TierReport]:
        out = []
        for i, t in enumerate(self.tiers):
            usage = self._try(i, "usage", lambda t: t.usage(), Usage(0, 0, 0, 0))
            out.append(TierReport(t.name, t.persistent, usage, self.counters[t.name]))
        return out

    def close(self) -> None:
        with self._lock:
            if self._dirty:
                try:
                    self.flush()
                except (Unavailable, ResourceExhausted) as e:
                    log.error("closing with %d chunks not yet durable: %s", len(self._dirty), e)
            for t in self.tiers:
                try:
                    t.close()
                except TierError as e:
                    log.warning("closing tier %s: %s", t.name, e)
