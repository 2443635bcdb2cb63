"""Moving chunks up the tiers, from verified copies a batch read made (``store/tiered/reads.py``): into
every tier faster than the one that served them, best effort (a read never waits for a tier's lock;
a chunk not promoted now is promoted by a later read). A shared tier's copies go into the durable
tier as one batch (one fsync). A prefetch puts a session's copies into the fastest tier ahead of a
load, waiting for that tier's lock (it runs on the promotion worker, never on a load's thread).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.store.tiered.demotion import Demotion
from kvstore.store.tiered.slot import TierSlot
from kvstore.tiers.base import Stored, TierError


class Promotion:
    """Moves chunks up ``slots`` (fast to slow; ``durable`` is the index of the durable tier)."""

    def __init__(self, slots: list[TierSlot], durable: int, down: Demotion) -> None:
        self._slots = slots
        self._durable = durable
        self._make_room = down.make_room  # room is made by demoting

    def promote_copies(self, copies: Sequence[tuple[bytes, bytes, int]]) -> None:
        """Each (key, copy, tier it was read from) into the faster tiers; those read from below the
        durable tier (a shared one) into the durable tier in one batch."""
        durable_later: list[tuple[bytes, Stored]] = []
        for key, copy, t in copies:
            if t > self._durable:
                durable_later.append((key, copy))
            self.promote(key, copy, min(t, self._durable))
        self.promote_durably(durable_later)

    def promote_durably(self, items: list[tuple[bytes, Stored]]) -> int:
        """Copies read from below the durable tier, written into it in one transaction (one fsync,
        not one per chunk). Best effort, like every promotion: skipped while that tier is busy."""
        slot = self._slots[self._durable]
        if not items or not slot.lock.acquire(blocking=False):
            return 0
        try:
            self._make_room(self._durable, sum(len(b) for _, b in items))
            slot.put_many(items)
            slot.counters.promotions += len(items)
            return len(items)
        except TierError:
            return 0
        finally:
            slot.lock.release()

    def into_fastest(self, items: Sequence[tuple[bytes, Stored]]) -> list[bool]:
        """Verified copies, whole, into the fastest tier ahead of a load (prefetch.py): room made for
        them all by demoting (only that demotes anything), then those that fit, in one batch; the
        rest skipped. Waits for that tier's lock (reads never take it). For each, whether
        it went in."""
        fast = self._slots[0]
        if not items:
            return []
        with fast.lock:
            self._make_room(0, sum(len(b) for _, b in items))
            u = fast.usage()
            if u is None:
                return [False] * len(items)
            room = u.capacity_bytes - u.used_bytes if u.capacity_bytes else None
            fits = [False] * len(items)
            for i, (_, blob) in enumerate(items):
                if room is None or len(blob) <= room:
                    fits[i] = True
                    room = None if room is None else room - len(blob)
            try:
                fast.put_many([item for item, ok in zip(items, fits) if ok])
            except TierError:
                return [False] * len(items)
            fast.counters.promotions += sum(fits)
        return fits

    def promote(self, key: bytes, blob: Stored, found: int) -> None:
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
