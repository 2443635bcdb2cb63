"""Moving chunks up the tiers. A read takes the fastest copy that passes verification (a failing
copy is counted and deleted where it lies, and the next tier is tried); its copy is then promoted
into every faster tier, best effort: a read never waits for a tier's lock. A shared tier's copies
go into the durable tier as one batch (one fsync), and prefetch puts a chunk into the fastest tier
ahead of a load, waiting for that tier's lock (it is a background worker).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvstore.store.demotion import Demotion
from kvstore.store.tier_slot import TierSlot
from kvstore.tiers.base import CorruptValue, Stored, TierError

log = logging.getLogger(__name__)


class Promotion:
    """Moves chunks up ``slots`` (fast to slow; ``durable`` is the index of the durable tier)."""

    def __init__(self, slots: list[TierSlot], durable: int, down: Demotion) -> None:
        self._slots = slots
        self._durable = durable
        self._make_room = down.make_room  # room is made by demoting

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

    def find(self, key: bytes, valid: Callable[[Stored], bool]) -> tuple[int, Stored] | None:
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
        found = None if fast.has(key) else self.find(key, check)
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
