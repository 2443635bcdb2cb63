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

Locks: each tier has its own (``TierSlot.lock``, for moves into and out of it, taken fast to
slow); pins and the write-back dirty set have one each. Reads take none of them (a promotion only
tries), and no lock is held while the durable tier commits a write (its fsync): the tier orders
its own writers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from kvstore.errors import ResourceExhausted, Unavailable
from kvstore.store.config import StoreConfig
from kvstore.store.pages import is_valid_blob
from kvstore.store.tier_slot import TierCounters, TierReport, TierSlot
from kvstore.tiers.base import CorruptValue, MetaMap, OutOfSpace, Stored, Tier, TierError, WriteBatch

__all__ = ["TierCounters", "TierReport", "TieredStore", "chunk_is_valid"]
log = logging.getLogger(__name__)
_T = TypeVar("_T")


def chunk_is_valid(key: bytes, blob: Stored) -> bool:
    """A stored chunk (or engine page blob) is served only if its checksum holds and it claims the
    key it was found under."""
    return is_valid_blob(key, blob)


class TieredStore:
    def __init__(self, tiers: Sequence[Tier], config: StoreConfig) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        self.tiers = list(tiers)
        self.config = config
        self._slots = [TierSlot(t) for t in self.tiers]
        self.counters = {s.name: s.counters for s in self._slots}
        persistent = [i for i, t in enumerate(self.tiers) if t.persistent]
        #: Index of the tier that makes a chunk durable (the first persistent one), or the last tier.
        self.durable = persistent[0] if persistent else len(self.tiers) - 1
        self._pins: Counter[bytes] = Counter()
        self._pin_lock = threading.Lock()
        self._dirty: set[bytes] = set()  # write-back: in the fast tier, not yet on the durable one
        self._dirty_lock = threading.Lock()

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
            fast = self._slots[0]
            with fast.lock:
                try:
                    self._make_room(0, sum(len(b) for _, b in items))
                    fast.put_many(items)
                    with self._dirty_lock:
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
        if the durable tier fails, what this call put in a faster tier is removed again."""
        if not batch:
            return
        items = batch.puts
        size = sum(len(b) for _, b in items)
        fast: list[bytes] = []  # keys this call added to the fast tier
        if self.durable != 0 and items:
            slot = self._slots[0]
            with slot.lock:
                had = {k for k, _ in items if slot.has(k)}
                try:
                    self._make_room(0, size)
                    slot.put_many(items)
                    fast = [k for k, _ in items if k not in had]
                except TierError:
                    pass  # a fast tier is a cache: the durable write below is what counts
        durable = self._slots[self.durable]
        if items:
            self._make_room(self.durable, size)
        only_puts = not (batch.deletes or batch.meta_puts or batch.meta_deletes)
        try:
            if only_puts:  # the plain batch call, which every tier implements at its best
                durable.put_many(items)
            else:
                durable.write(batch)
        except TierError as e:
            for k in fast:
                self._slots[0].drop(k)
            raise self._durable_error(e) from e
        with self._dirty_lock:
            self._dirty.difference_update(k for k, _ in items)
            self._dirty.difference_update(batch.deletes)
        if batch.deletes:
            for slot in self._slots[: self.durable]:
                slot.drop_many(batch.deletes)

    def _durable_error(self, e: TierError) -> Exception:
        name = self.tiers[self.durable].name
        if isinstance(e, OutOfSpace):
            return ResourceExhausted(f"durable tier {name} is out of space: {e}")
        return Unavailable(f"durable tier {name} failed: {e}")

    def flush(self, keys: Sequence[bytes] | None = None) -> None:
        """Write-back mode: make ``keys`` (default: every dirty chunk) durable now, in one
        transaction."""
        with self._dirty_lock:
            todo = [k for k in (keys if keys is not None else list(self._dirty)) if k in self._dirty]
        items = []
        for key in todo:
            blob = self._slots[0].get(key)
            if blob is None:
                blob = self.get(key)
            if blob is None:
                raise Unavailable(f"chunk {key.hex()} was lost before it became durable")
            items.append((key, blob))
        self.commit(WriteBatch(puts=items))

    def delete_many(self, keys: Sequence[bytes], local_only: bool = False) -> None:
        """Delete ``keys`` from every tier, one batch per tier (one transaction, one fsync on the
        durable tier), or (``local_only``) from the durable tier and faster ones: slower tiers may
        be shared with other daemons (Redis) and expire by TTL instead."""
        if not keys:
            return
        for slot in self._slots[: self.durable + 1 if local_only else len(self._slots)]:
            slot.drop_many(keys)
        with self._dirty_lock:
            self._dirty.difference_update(keys)

    def delete(self, key: bytes, local_only: bool = False) -> None:
        self.delete_many([key], local_only)

    # -- reads ----------------------------------------------------------------------------------
    def get(self, key: bytes, check: Callable[[Stored], bool] | None = None,
            durable_later: list[tuple[bytes, Stored]] | None = None) -> Stored | None:
        """The verified chunk, from the fastest tier holding it; None on a miss. ``check`` is the
        verification (default: checksum and the key the chunk claims); a copy that fails it is
        counted, deleted from that tier, and the next tier is tried. ``durable_later``: a copy read
        from below the durable tier (a shared one) is promoted into the faster tiers now and left in
        this list for the durable one, for the caller to write as one batch (``promote_durably``)."""
        if (found := self._find(key, check or (lambda blob: chunk_is_valid(key, blob)))) is None:
            return None
        i, blob = found
        self._slots[i].counters.hits += 1
        if i > 0 and self.config.promote_on_read:
            if durable_later is not None and i > self.durable:
                durable_later.append((key, blob))
                i = self.durable
            self._promote(key, blob, i)
        return blob

    def promote_durably(self, items: list[tuple[bytes, Stored]]) -> int:
        """Copies read from below the durable tier, written into it in one transaction (one fsync,
        not one per chunk). Best effort, like every promotion: skipped while that tier is busy."""
        slot = self._slots[self.durable]
        if not items or not slot.lock.acquire(blocking=False):
            return 0
        try:
            self._make_room(self.durable, sum(len(b) for _, b in items))
            slot.put_many(items)
            slot.counters.promotions += len(items)
            return len(items)
        except TierError:
            return 0
        finally:
            slot.lock.release()

    def _find(self, key: bytes, valid: Callable[[Stored], bool]) -> tuple[int, Stored] | None:
        """The fastest tier holding a copy that passes ``valid``, and that copy (failing ones deleted)."""
        for i, slot in enumerate(self._slots):
            try:
                blob = slot.get_strict(key)
            except CorruptValue:
                blob = b""  # fails verification below: counted, deleted there, next tier tried
            except TierError:
                continue
            if blob is None:
                continue
            if not valid(blob):
                slot.counters.verify_failures += 1
                log.error("chunk %s failed verification in tier %s: deleted there", key.hex(), slot.name)
                slot.drop(key)
                continue
            return i, blob
        return None

    def prefetch(self, key: bytes, check: Callable[[Stored], bool]) -> bool:
        """Put a verified copy of a chunk, whole, into the fastest tier ahead of a load (prefetch.py);
        only making room demotes anything. Waits for that tier's lock (a background worker; reads never
        take it). False: already there, no valid copy, or no room (the rest pinned)."""
        fast = self._slots[0]
        found = None if fast.has(key) else self._find(key, check)
        if found is None or found[0] == 0:
            return False
        with fast.lock:
            self._make_room(0, len(found[1]), protect=key)
            u = fast.usage()
            if u is None or (u.capacity_bytes and u.used_bytes + len(found[1]) > u.capacity_bytes):
                return False
            try:
                fast.put(key, found[1])
            except TierError:
                return False
            fast.counters.promotions += 1
        return True

    def _promote(self, key: bytes, blob: Stored, found: int) -> None:
        # Best effort: a read never waits for a tier's lock; a chunk not promoted now is promoted
        # by a later read.
        for i in range(found):
            slot = self._slots[i]
            if not slot.lock.acquire(blocking=False):
                continue
            try:
                self._make_room(i, len(blob), protect=key)
                slot.put(key, blob)
                slot.counters.promotions += 1
            except TierError:
                continue
            finally:
                slot.lock.release()

    def where(self, key: bytes) -> list[str]:
        """Names of the tiers holding ``key`` (not verified; a lookup, not a read)."""
        return [s.name for s in self._slots if s.has(key)]

    def fastest(self, keys: Sequence[bytes]) -> list[str | None]:
        """For each key, the fastest tier holding it (or None): tier by tier, each asked only for
        the keys no faster tier holds; a tier that answers in batches (Redis) gets one batch."""
        out: list[str | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for s in self._slots:
            if not todo:
                break
            batch: Callable[[list[bytes]], list[bool]] | None = getattr(s.tier, "exists_many", None)
            held: list[bool]
            if batch is not None:
                asked = [keys[i] for i in todo]
                held = s.attempt("exists_many", functools.partial(_ask, batch, asked), [False] * len(todo))
            else:
                held = [s.has(keys[i]) for i in todo]
            for i, h in zip(todo, held):
                if h:
                    out[i] = s.name
            todo = [i for i, h in zip(todo, held) if not h]
        return out

    def contains(self, key: bytes) -> bool:
        return any(s.has(key) for s in self._slots)

    def holds_durably(self, key: bytes) -> bool:
        """Whether ``key`` is on the durable tier, or (write-back) waiting in the fast tier to get there.
        Tiers slower than the durable one do not count: they may be shared and expire by TTL."""
        return key in self._dirty or self._slots[self.durable].has(key)

    # -- meta records (manifests) live in the durable tier's own meta keyspace --------------------
    def _meta(self, what: str, op: Callable[[MetaMap], _T]) -> _T:
        try:
            return self._slots[self.durable].call(f"meta {what}", lambda t: op(t.meta()))
        except TierError as e:
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
        slot = self._slots[self.durable]
        try:
            candidates = [k for k in slot.call("keys", lambda t: list(t.keys())) if k.startswith(prefix)]
            values = slot.call("get_many", lambda t: t.get_many(candidates)) if candidates else []
            found = [k for k, v in zip(candidates, values) if v is not None and is_meta(k, v)]
            if found:
                slot.call("move_to_meta", lambda t: t.move_to_meta(found))
        except TierError as e:  # CorruptValue included: a damaged old record stays where it is
            log.error("cannot migrate old-format meta records in tier %s: %s", slot.name, e)
            return 0
        if found:
            log.warning("moved %d meta records of the old format out of tier %s's values", len(found), slot.name)
        return len(found)

    def chunk_keys(self, local_only: bool = False) -> set[bytes]:
        """Every chunk key held by any tier (``local_only``: by the durable tier or a faster one)."""
        out: set[bytes] = set()
        for slot in self._slots[: self.durable + 1 if local_only else len(self._slots)]:
            out.update(slot.keys())
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
        """Move ``key`` down to tier ``to``: ensure it is there (or slower), drop it from faster tiers
        except the durable one: a tier below it may be shared and expire by TTL (Redis), so the
        durable copy is what an acknowledged save keeps. Counted as one demotion per tier it left."""
        with contextlib.ExitStack() as held:
            for slot in self._slots:  # every tier's lock, fast to slow: this moves across all of them
                held.enter_context(slot.lock)
            if self._pinned(key):
                return False
            holders = [i for i, s in enumerate(self._slots) if s.has(key)]
            if not holders:
                return False
            if not any(i >= to for i in holders):
                blob = self._slots[holders[0]].get(key)
                if blob is None:
                    return False
                try:
                    self._make_room(to, len(blob))
                    self._slots[to].put(key, blob)
                except TierError:
                    return False  # keep it where it is rather than lose it
                if to >= self.durable:
                    with self._dirty_lock:
                        self._dirty.discard(key)
            for i in holders:
                if i < to and i != self.durable and self._slots[i].drop(key):
                    self._slots[i].counters.demotions += 1
            if not any(i < to and i != self.durable for i in holders):
                self._slots[holders[0]].counters.demotions += 1  # copied down, nothing above it dropped
            return True

    def _make_room(self, i: int, incoming: int, protect: bytes | None = None) -> None:
        """Demote LRU chunks out of tier ``i`` until ``incoming`` more bytes fit under its capacity."""
        slot = self._slots[i]
        with slot.lock:
            usage = slot.usage()
            if usage is None or not usage.capacity_bytes:
                return
            used, cap = usage.used_bytes, usage.capacity_bytes
            if used + incoming <= cap:
                return
            for victim in slot.victims():
                if used + incoming <= cap:
                    break
                if victim == protect or self._pinned(victim):
                    continue
                size = slot.size_of(victim)
                if self._evict_one(i, victim):
                    used -= size

    def _evict_one(self, i: int, key: bytes) -> bool:
        # Called with tier i's lock held; takes the next tier's (fast to slow). Where the next tier
        # is the durable one and lacks the chunk (write-back), this puts it there: that eviction
        # holds tier i's lock across the durable write, which reads never take.
        nxt = i + 1
        slot = self._slots[i]
        if nxt < len(self._slots) and not self._slots[nxt].has(key):
            blob = slot.get(key)
            if blob is None:
                return False
            try:
                self._make_room(nxt, len(blob), protect=key)
                self._slots[nxt].put(key, blob)
            except TierError:
                # The next tier does not hold it and could not take it: this may be the only copy
                # (a dirty chunk, or the durable tier's), so keep it and stay over capacity.
                return False
            slot.counters.demotions += 1
            if nxt >= self.durable:
                with self._dirty_lock:
                    self._dirty.discard(key)
        elif key in self._dirty and nxt >= len(self._slots):
            return False
        else:
            slot.counters.evictions += 1
        slot.drop(key)
        return True

    # -- reporting ------------------------------------------------------------------------------
    def reports(self) -> list[TierReport]:
        return [s.report() for s in self._slots]

    def close(self) -> None:
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


def _ask(batch: Callable[[list[bytes]], list[bool]], keys: list[bytes], _tier: Tier) -> list[bool]:
    return batch(keys)
