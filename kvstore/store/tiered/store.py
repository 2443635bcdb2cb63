"""TieredStore: chunk blobs across tiers ordered fast to slow.

The tiers never know about each other; this class moves data between them:
- writes go to the fastest tier and (write-through, the default) to the persistent tier before
  the call returns, so every acknowledged chunk is durable;
- reads are batches (``store/tiered/reads.py``): each tier, fastest first, asked once for what no faster
  tier served, its answers verified in one pass (a session's chunks by the C kernel; checksum and
  the key each blob claims otherwise), and promoted to faster tiers; a chunk that fails
  verification is deleted from that tier and served from a slower one, or is a miss: never returned;
- a tier over its capacity demotes its least recently used chunks to the next tier (dropping them
  only where the next tier already holds them or there is none), skipping pinned chunks;
- a tier that fails (TierError, e.g. Redis down) is reported and degraded around.

Moving chunks up is ``promotion.py``'s (after a load answered, or ahead of one, on the store's one
promotion worker: ``store/tiered/promotion.py``), down ``demotion.py``'s; this class writes, reads, keeps the
durable tier's meta records (manifests, layouts), and answers what the daemon asks of its tiers.

Locks: each tier has its own (``TierSlot.lock``, for moves into and out of it, taken fast to
slow); pins and the write-back dirty set have one each. Reads take none of them (a promotion only
tries), and no lock is held while the durable tier commits a write (its fsync): the tier orders
its own writers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar, TypeVarTuple

from kvstore.errors import ResourceExhausted, Unavailable
from kvstore.format.stored import is_valid_blob
from kvstore.store.config import StoreConfig
from kvstore.store.tiered.demotion import Demotion, Dirty, Pins
from kvstore.store.tiered.ledger import Ledger
from kvstore.store.tiered.promotion import Job, Promotion, PromotionWorker, subset
from kvstore.store.tiered.reads import Verify, read_tiers, read_verified
from kvstore.store.tiered.slot import TierCounters, TierReport, TierSlot
from kvstore.tiers.base import OutOfSpace, Stored, Tier, TierError, TierStats, Value, WriteBatch
from kvstore.tiers.device_tier import DeviceTier

__all__ = ["TierCounters", "TierReport", "TieredStore"]
log = logging.getLogger(__name__)
_T = TypeVar("_T")
_Args = TypeVarTuple("_Args")


class TieredStore:
    def __init__(self, tiers: Sequence[Tier], config: StoreConfig) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        #: The tiers, fast to slow: for tests and offline tools. The daemon asks this store instead
        #: (``tier_names``, ``hbm_tier``, ``held_in_memory``, ``probe``, ...) and never sees a tier.
        self.tiers = tuple(tiers)
        #: The tier that copies device to device (the HBM tier), known by what it offers.
        self._device = next((t for t in self.tiers if isinstance(t, DeviceTier)), None)
        self.config = config
        persistent = [i for i, t in enumerate(self.tiers) if t.persistent]
        #: Index of the tier that makes a chunk durable (the first persistent one), or the last tier.
        self.durable = persistent[0] if persistent else len(self.tiers) - 1
        #: Per-namespace usage of the tiers this daemon owns (slower ones may be shared: not counted).
        self.ledger = Ledger([t.name for t in self.tiers[: self.durable + 1]])
        self._slots = [TierSlot(t, self.ledger) for t in self.tiers]
        self.counters = {s.name: s.counters for s in self._slots}
        self._pins = Pins()
        self._dirty = Dirty(self.ledger)  # write-back: in the fast tier, not yet on the durable one
        self._down = Demotion(self._slots, self.durable, self._pins, self._dirty, self.ledger, config.quotas)
        self._slots[self.durable].count_held()  # what earlier runs left (owned once the manifests are read)
        for s in self._slots[: self.durable]:
            u, shares = s.usage(), config.quotas.listed_shares(s.name)
            if u is not None and u.capacity_bytes and shares > u.capacity_bytes:
                log.warning("the namespaces' shares of the %s tier add up to %d bytes, more than its %d: a namespace "
                            "within its share may see its chunks moved down while every one is within its share",
                            s.name, shares, u.capacity_bytes)
        self._make_room = self._down.make_room
        self._up = Promotion(self._slots, self.durable, self._down, self.ledger)
        self._worker = PromotionWorker()  # the one mover: promotions behind loads, prefetches
        for slot in self._slots[: self.durable + 1]:  # the tiers this daemon owns (slower ones may be shared)
            slot.count_repairs()

    # -- writes ---------------------------------------------------------------------------------
    def buffer_for(self, n: int) -> memoryview | None:
        """A writable buffer to build an ``n``-byte value in that the fastest tier, where a save puts
        it first, keeps as it is (``Tier.buffer_for``); None where there is none to have."""
        return self._slots[0].tier.buffer_for(n) if self.durable != 0 else None

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
                    if self._room_in_fastest(items):
                        fast.put_many(items)
                        self._dirty.add(items)
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
                keys = [k for k, _ in items]
                had = {k for k, h in zip(keys, slot.has_many(keys)) if h}
                try:
                    if self._room_in_fastest(items):
                        slot.put_many(items)
                        fast = [k for k in keys if k not in had]
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
        self._dirty.discard([*(k for k, _ in items), *batch.deletes])
        if batch.deletes:
            for slot in self._slots[: self.durable]:
                slot.drop_many(batch.deletes)
            self.ledger.forget(batch.deletes)

    def _room_in_fastest(self, items: Sequence[tuple[bytes, Value]]) -> bool:
        """Room made in the fastest tier for ``items`` (with its lock held); whether to put them there:
        always, unless the tier is shared fairly and they are past their namespaces' shares (then the
        fast tier, a cache, is skipped rather than another namespace's chunks within its share moved)."""
        size = sum(len(b) for _, b in items)
        made = self._make_room(0, size, incoming=self.incoming(items))
        return made or not self._down.shared_fairly(0)

    def incoming(self, items: Sequence[tuple[bytes, Value]]) -> dict[str, int]:
        """The bytes of ``items`` by owning namespace (``Ledger.claim``)."""
        out: dict[str, int] = {}
        for (_, blob), ns in zip(items, self.ledger.owners(k for k, _ in items)):
            out[ns] = out.get(ns, 0) + len(blob)
        return out

    # -- per-namespace usage (ledger.py, store/quotas.py) -------------------------------------------
    def claim(self, keys: Sequence[bytes], namespace: str) -> None:
        """``keys`` are ``namespace``'s chunks (a key hashes its namespace: claimed once, for good)."""
        self.ledger.claim(keys, namespace)

    def used_by(self, namespace: str) -> dict[str, int]:
        """Bytes ``namespace`` holds on each tier this daemon owns, by tier name."""
        return {s.name: self.ledger.used(s.name, namespace) for s in self._slots[: self.durable + 1]}

    def _durable_error(self, e: TierError) -> Exception:
        name = self.tiers[self.durable].name
        if isinstance(e, OutOfSpace):
            return ResourceExhausted(f"durable tier {name} is out of space: {e}")
        return Unavailable(f"durable tier {name} failed: {e}")

    def flush(self, keys: Sequence[bytes] | None = None) -> None:
        """Write-back mode: make ``keys`` (default: every dirty chunk) durable now, in one
        transaction."""
        todo = list(self._dirty.among(keys))
        items = []
        for key, blob in zip(todo, self.copies(todo)):
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
        self._dirty.discard(keys)
        self.ledger.forget(keys)

    # -- reads ----------------------------------------------------------------------------------
    def read_verified(self, keys: Sequence[bytes], verify: Verify) -> contextlib.AbstractContextManager[
            list[Stored | None]]:
        """The verified value of each key (None: a miss), each tier asked once, its answers verified in
        one ``verify`` call; valid inside the ``with`` block only (``store/tiered/reads.py``). What slower
        tiers served is promoted behind the read, on the promotion worker."""
        def behind(at: list[int]) -> None:
            self._worker.submit(functools.partial(self._promote_again, keys, verify, at))

        return read_verified(self._slots, self._up, self.config.promote_on_read, keys, verify, behind)

    def _promote_again(self, keys: Sequence[bytes], verify: Verify, at: Sequence[int]) -> None:
        """Behind a load: read ``keys[at]`` again (verified as any read) and promote what slower tiers serve."""
        again = [keys[j] for j in at]
        with read_verified(self._slots, self._up, True, again, subset(verify, at), counted=False):
            pass

    def copies(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """A copy of each key's value (None: a miss), read as one batch and verified as every stored
        blob is (its checksum, and the key it claims): for what reads without a session's index (a
        write-back flush, a publication to a shared tier). What slower tiers served is promoted."""
        with read_verified(self._slots, self._up, self.config.promote_on_read, keys, _claims_its_key(keys)) as got:
            return [None if v is None else bytes(v) for v in got]

    def prefetch(self, keys: Sequence[bytes], verify: Verify) -> list[bool | None]:
        """Verified copies of ``keys`` into the fastest tier ahead of a load (``Promotion.into_fastest``);
        for each key, None: already there; True: copied there now; False: skipped (no valid copy, or
        no room). Waits for that tier's lock: for the promotion worker (``run_behind``). What the fastest
        tier holds already is neither read nor verified here (a load verifies it): one presence check."""
        held = self._slots[0].has_many(keys)
        out: list[bool | None] = [None if h else False for h in held]
        todo = [j for j, h in enumerate(held) if not h]
        if not todo:
            return out
        with read_tiers(self._slots[1:], [keys[j] for j in todo], subset(verify, todo), counted=False) as got:
            below = [(todo[i], bytes(v)) for i, v in enumerate(got.values) if v is not None]
        for (j, _), ok in zip(below, self._up.into_fastest([(keys[j], c) for j, c in below])):
            out[j] = ok
        return out

    def run_behind(self, job: Job) -> None:
        """``job`` on the store's promotion worker, after what is queued there (``promotion.py``)."""
        self._worker.submit(job)

    def settle(self) -> None:
        """Wait for the promotion worker's jobs (promotions behind loads, prefetches) to be done."""
        self._worker.settle()

    def where(self, key: bytes) -> list[str]:
        """Names of the tiers holding ``key`` (not verified; a lookup, not a read)."""
        return [s.name for s in self._slots if s.has(key)]

    def fastest(self, keys: Sequence[bytes]) -> list[str | None]:
        """For each key, the fastest tier holding it (or None): tier by tier, each asked in one batch
        for the keys no faster tier holds."""
        out: list[str | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for s in self._slots:
            if not todo:
                break
            held = s.has_many([keys[i] for i in todo])
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

    def holds_durably_many(self, keys: Sequence[bytes]) -> list[bool]:
        """``holds_durably`` of each key, the durable tier asked once."""
        held = self._slots[self.durable].has_many(keys)
        return [h or key in self._dirty for key, h in zip(keys, held)]

    # -- meta records (manifests) live in the durable tier's own meta keyspace --------------------
    def _meta(self, what: str, op: Callable[[*_Args], _T], *args: *_Args) -> _T:
        """``op(*args)``, a method of the durable tier's meta keyspace; its failure is the store's."""
        try:
            return self._slots[self.durable].call(f"meta {what}", op, *args)
        except TierError as e:
            raise self._durable_error(e) from e

    def put_meta(self, key: bytes, value: bytes) -> None:
        self._meta("put", self.tiers[self.durable].meta().put, key, value)

    def get_meta(self, key: bytes) -> bytes | None:
        return self._meta("get", self.tiers[self.durable].meta().get, key)

    def meta_keys(self, prefix: bytes) -> Iterator[bytes]:
        try:
            keys = self._meta("keys", self.tiers[self.durable].meta().keys)  # a snapshot, taken by the call
        except Unavailable:
            return iter(())
        return (k for k in keys if k.startswith(prefix))

    def chunk_keys(self, local_only: bool = False) -> set[bytes]:
        """Every chunk key held by any tier (``local_only``: by the durable tier or a faster one)."""
        out: set[bytes] = set()
        for slot in self._slots[: self.durable + 1 if local_only else len(self._slots)]:
            out.update(slot.keys())
        return out

    # -- movement between tiers (demotion.py) ----------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> None:
        """Keep ``keys`` where they are until unpinned (e.g. while a session is being resumed)."""
        self._pins.pin(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        self._pins.unpin(keys)

    def evict(self, keys: Sequence[bytes], tier: str, what: str) -> int:
        """Move ``what``'s chunks down to the tier named ``tier``; how many moved (``Demotion.evict``),
        once the promotion worker's jobs are done (nothing moves up behind a move down)."""
        self._worker.settle()
        return self._down.evict(keys, tier, what)

    # -- what the daemon asks of its tiers --------------------------------------------------------
    def tier_names(self) -> list[str]:
        """The tiers' names, fast to slow."""
        return [s.name for s in self._slots]

    def durable_name(self) -> str:
        """The name of the tier that makes a save durable: every save needs it."""
        return self._slots[self.durable].name

    def hbm_tier(self) -> DeviceTier | None:
        """The tier that copies device to device (the HBM tier: ``DeviceTier.copy_to``), or None."""
        return self._device

    def held_in_memory(self, keys: Sequence[bytes], max_bytes: int) -> bool:
        """Whether the fastest tier is a memory tier holding every one of ``keys``, in at most
        ``max_bytes`` together (a lookup, no read: a chunk demoted meanwhile is still read
        correctly, from a slower tier)."""
        fast = self.tiers[0]
        if fast.persistent:
            return False
        total = 0
        for k in keys:
            n = fast.size_of(k)
            if n is None or (total := total + n) > max_bytes:
                return False
        return True

    def in_fastest(self, key: bytes) -> bool:
        """Whether the fastest tier holds ``key`` (it alone is asked; False if it fails)."""
        try:
            return self.tiers[0].contains_many([key])[0]
        except TierError:
            return False

    def probe(self) -> dict[str, TierError | None]:
        """Each tier's failure now (None: it answered), asked directly: not counted in its counters."""
        out: dict[str, TierError | None] = {}
        for tier in self.tiers:
            try:
                tier.stats()
                out[tier.name] = None
            except TierError as e:
                out[tier.name] = e
        return out

    def report_damage(self, what: str) -> None:
        """Damage found in the durable tier's records (a stored definition that does not read back):
        counted as an error of that tier, ``what`` its last error, as a repaired data file is (``TierSlot``)."""
        c = self._slots[self.durable].counters
        c.errors += 1
        c.last_error = what

    def durable_stats(self) -> TierStats:
        """The durable tier's ``TierStats``, with its page statistics where it has them (asked directly:
        a failure raises TierError, not counted)."""
        return self.tiers[self.durable].stats(pages=True)

    # -- reporting ------------------------------------------------------------------------------
    def reports(self) -> list[TierReport]:
        return [s.report() for s in self._slots]

    def close(self) -> None:
        self._worker.close()
        if len(self._dirty):
            try:
                self.flush()
            except (Unavailable, ResourceExhausted) as e:
                log.error("closing with %d chunks not yet durable: %s", len(self._dirty), e)
        for t in self.tiers:
            try:
                t.close()
            except TierError as e:
                log.warning("closing tier %s: %s", t.name, e)


def _claims_its_key(keys: Sequence[bytes]) -> Verify:
    """The check of a stored blob read without its index entry: its checksum, and the key it claims."""
    return lambda at, values: [is_valid_blob(keys[j], v) for j, v in zip(at, values)]
