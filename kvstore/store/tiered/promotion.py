"""Moving chunks up the tiers, from verified copies a batch read made (``store/tiered/reads.py``): into
every tier faster than the one that served them, best effort (a read never waits for a tier's lock;
a chunk not promoted now is promoted by a later read). A shared tier's copies go into the durable
tier as one batch (one fsync). A prefetch puts a session's copies into the fastest tier ahead of a
load, waiting for that tier's lock (it runs on the promotion worker, never on a load's thread).

The promotion worker, the store's one mover: a thread that copies chunks up the tiers after the call
that asked for it answered.

Two kinds of job run on it, in the order they were submitted. Promotion behind a load: a resume from
the ssd tier wants its bytes now; the copy into the host tier only speeds up the next resume. Made
inside the load, that copy is a second pass over every byte (and for a long session, fresh memory
faulted in): a fifth of a 128K-token resume. So a batch read hands the keys it served from below to
this worker, which reads them again (one batch per tier, verified as any read) and promotes them.
And a prefetch (``prefetch.py``): a session's chunks read as batches and put into the fastest tier
ahead of its load. One thread per store, started on first use; ``settle`` waits until it is idle
(``evict`` and ``close`` do, so that nothing moves up behind an admin's move down).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvstore.store.tiered.demotion import Demotion
from kvstore.store.tiered.ledger import Ledger
from kvstore.store.tiered.slot import TierSlot
from kvstore.tiers.base import Stored, TierError


class Promotion:
    """Moves chunks up ``slots`` (fast to slow; ``durable`` is the index of the durable tier)."""

    def __init__(self, slots: list[TierSlot], durable: int, down: Demotion, ledger: Ledger) -> None:
        self._slots = slots
        self._durable = durable
        self._down = down
        self._make_room = down.make_room  # room is made by demoting
        self._ledger = ledger  # owners of chunks: a tier shared fairly makes room by namespace

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
            owners = self._ledger.owners(k for k, _ in items)
            incoming: dict[str, int] = {}
            for (_, blob), ns in zip(items, owners):
                incoming[ns] = incoming.get(ns, 0) + len(blob)
            self._make_room(0, sum(len(b) for _, b in items), incoming=incoming)
            u = fast.usage()
            if u is None:
                return [False] * len(items)
            room = u.capacity_bytes - u.used_bytes if u.capacity_bytes else None
            share = {ns: self._down.share_left(0, ns) for ns in incoming}  # None: no share to keep to
            fits = [False] * len(items)
            for i, ((_, blob), ns) in enumerate(zip(items, owners)):
                left = share[ns]
                if (room is None or len(blob) <= room) and (left is None or len(blob) <= left):
                    fits[i] = True
                    room = None if room is None else room - len(blob)
                    share[ns] = None if left is None else left - len(blob)
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
                fair = self._down.shared_fairly(i)
                made = self._make_room(i, len(blob), protect=key,
                                       incoming={self._ledger.owner(key): len(blob)} if fair else None)
                if fair and not made:
                    continue  # past its namespace's share: a later read, or a prefetch, may bring it
                slot.put(key, blob)
                slot.counters.promotions += 1
            except TierError:
                continue
            finally:
                slot.lock.release()


log = logging.getLogger(__name__)
_V = TypeVar("_V")

#: a promotion to run: keys read (again) and promoted, best effort
Job = Callable[[], None]


class PromotionWorker:
    def __init__(self) -> None:
        self._jobs: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, job: Job) -> None:
        """Run ``job`` (a best-effort promotion) on the worker thread, after what is queued; nothing
        once the worker is closed."""
        with self._cond:
            if self._closed:
                return
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-promote", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def settle(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted promotion ran; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout_s)

    def close(self) -> None:
        """Run what is queued, then stop the worker."""
        self.settle()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                job()
            except Exception:  # best effort, as every promotion: never the load's failure
                log.exception("a promotion on the worker failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def subset(verify: Callable[[Sequence[int], Sequence[_V]], Sequence[bool]], positions: Sequence[int]
           ) -> Callable[[Sequence[int], Sequence[_V]], Sequence[bool]]:
    """``verify`` for the keys at ``positions`` of the keys it was made for (a re-read of some of them)."""
    return lambda at, values: verify([positions[a] for a in at], values)
