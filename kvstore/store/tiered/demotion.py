"""Moving chunks down the tiers: making room in a tier over its capacity (its least recently used
chunks demoted to the next tier), an explicit demotion, and an admin's evict of a session; and what
must not move: pinned chunks (a load is reading them, a pinned session's) and, in write-back mode,
chunks whose only copy is in the fast tier (``Dirty``).

A chunk is dropped from a tier only where the next tier already holds it or there is none. Each
tier's lock is held while chunks move into or out of it, taken fast to slow (``store/tiered/slot.py``).

With host shares configured (``store/quotas.py``), room in the host tier is made fairly
(``make_room``'s ``incoming``): a namespace past its share has its own least recently used chunks
moved down first; a full tier then moves down chunks of namespaces past their share (those with no
share first among them: all their bytes are past it), in LRU order; a namespace within its share
is never moved down for another's data past its share. Only when every namespace is within its
share and the tier is still full (the shares add up to more than the tier) does plain LRU order
decide.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

from kvstore.errors import InvalidArgument
from kvstore.store.quotas import Quotas
from kvstore.store.tiered.ledger import Ledger
from kvstore.store.tiered.slot import TierSlot
from kvstore.tiers.base import TierError, Value


class Pins:
    """Chunks kept where they are until unpinned, counted (two loads of one chunk pin it twice).
    A lock of its own: a load pins its chunks without waiting for a save."""

    def __init__(self) -> None:
        self._pins: Counter[bytes] = Counter()
        self._lock = threading.Lock()

    def pin(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._pins.update(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._pins.subtract(keys)
            for k in keys:
                if self._pins[k] <= 0:
                    self._pins.pop(k, None)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return self._pins[key] > 0

    def __len__(self) -> int:
        """How many chunks are pinned now."""
        with self._lock:
            return len(self._pins)


class Dirty:
    """Write-back mode: chunks in the fast tier not yet on the durable one (their only copy); each
    counted in ``ledger`` as pending (``Ledger.pend``) toward its namespace's ssd quota until it is
    durable or deleted."""

    def __init__(self, ledger: Ledger | None = None) -> None:
        self._keys: set[bytes] = set()
        self._lock = threading.Lock()
        self._ledger = ledger

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys  # one set lookup: atomic, no lock on the read path

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, items: Sequence[tuple[bytes, Value]]) -> None:
        """``items`` (key, blob) were put in the fast tier only."""
        with self._lock:  # with the ledger's count: a discard in between would leave it pending
            self._keys.update(k for k, _ in items)
            if self._ledger is not None:
                self._ledger.pend((k, memoryview(b).nbytes) for k, b in items)

    def discard(self, keys: Sequence[bytes]) -> None:
        """``keys`` are durable now, or deleted."""
        with self._lock:
            self._keys.difference_update(keys)
            if self._ledger is not None:
                self._ledger.settle(keys)

    def among(self, keys: Sequence[bytes] | None = None) -> list[bytes]:
        """The dirty ones of ``keys`` (None: every dirty chunk)."""
        with self._lock:
            return [k for k in (keys if keys is not None else list(self._keys)) if k in self._keys]


class Demotion:
    """Moves chunks down ``slots`` (fast to slow; ``durable`` is the index of the durable tier)."""

    def __init__(self, slots: list[TierSlot], durable: int, pins: Pins, dirty: Dirty,
                 ledger: Ledger | None = None, quotas: Quotas | None = None) -> None:
        self._slots = slots
        self._durable = durable
        self._pins = pins
        self._dirty = dirty
        self._ledger = ledger
        self._quotas = quotas if quotas is not None else Quotas()

    def shared_fairly(self, i: int) -> bool:
        """Whether room in tier ``i`` is made by namespace shares (``make_room``'s ``incoming``)."""
        return self._ledger is not None and self._ledger.tracks(self._slots[i].name) and \
            self._quotas.shares(self._slots[i].name)

    def share_left(self, i: int, namespace: str) -> int | None:
        """Bytes ``namespace`` may still put into tier ``i`` within its share (None: no limit)."""
        if not self.shared_fairly(i):
            return None
        assert self._ledger is not None
        share = self._quotas.of(namespace).bytes_on(self._slots[i].name) if namespace else 0
        return None if share is None else share - self._ledger.used(self._slots[i].name, namespace)

    def make_room(self, i: int, size: int, protect: bytes | None = None,
                  incoming: dict[str, int] | None = None) -> bool:
        """Demote LRU chunks out of tier ``i`` until ``size`` more bytes fit under its capacity; whether
        they fit now. ``incoming``: the bytes by namespace (the ledger's owners), for a tier shared
        fairly (the module's docstring): then also whether each namespace's bytes fit in its share
        (a namespace with no share of a full tier gets no room)."""
        slot = self._slots[i]
        with slot.lock:
            if incoming is not None and self.shared_fairly(i):
                return self._make_fair_room(i, size, protect, incoming)
            usage = slot.usage()
            if usage is None or not usage.capacity_bytes:
                return True
            used, cap = usage.used_bytes, usage.capacity_bytes
            if used + size <= cap:
                return True
            for victim in slot.victims():
                if used + size <= cap:
                    break
                if victim == protect or victim in self._pins:
                    continue
                n = slot.size_of(victim)
                if self._evict_one(i, victim):
                    used -= n
            return used + size <= cap

    def _make_fair_room(self, i: int, size: int, protect: bytes | None, incoming: dict[str, int]) -> bool:
        slot, ledger = self._slots[i], self._ledger
        assert ledger is not None
        tier = slot.name
        share = {ns: self._quotas.of(ns).bytes_on(tier) if ns else 0 for ns in incoming}
        victims = slot.victims()
        owners = ledger.owners(victims)
        gone: set[bytes] = set()

        def over(ns: str) -> int:  # bytes ``ns`` holds past its share (no share: everything it holds)
            s = self._quotas.of(ns).bytes_on(tier) if ns else 0
            return ledger.used(tier, ns) - (0 if s is None else s)

        def move(victim: bytes) -> bool:
            if victim == protect or victim in self._pins or victim in gone:
                return False
            if self._evict_one(i, victim):
                gone.add(victim)
                return True
            return False

        # 1. a namespace past its share makes room for its own bytes out of its own chunks, LRU first
        fits = True
        for ns, n in incoming.items():
            s = share[ns]
            if s is None:
                continue
            for victim, owner in zip(victims, owners):
                if owner != ns or ledger.used(tier, ns) + n <= s:
                    continue
                move(victim)
            fits = fits and ledger.used(tier, ns) + n <= s
        usage = slot.usage()
        if usage is None or not usage.capacity_bytes:
            return fits
        cap = usage.capacity_bytes

        def room() -> bool:
            u = slot.usage()
            return u is not None and u.used_bytes + size <= cap

        # 2. a full tier: chunks of namespaces past their share move down, LRU first
        for victim, owner in zip(victims, owners):
            if room():
                break
            if over(owner) > 0:
                move(victim)
        # 3. every namespace within its share and still full (shares add up to more than the tier):
        # plain LRU, but only for bytes within their namespace's share
        if not room() and fits and all(s is not None for s in share.values()):
            for victim in victims:
                if room():
                    break
                move(victim)
        return fits and room()

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
                self.make_room(nxt, len(blob), protect=key)
                self._slots[nxt].put(key, blob)
            except TierError:
                # The next tier does not hold it and could not take it: this may be the only copy
                # (a dirty chunk, or the durable tier's), so keep it and stay over capacity.
                return False
            slot.counters.demotions += 1
            if nxt >= self._durable:
                self._dirty.discard([key])
        elif key in self._dirty and nxt >= len(self._slots):
            return False
        else:
            slot.counters.evictions += 1
        slot.drop(key)
        return True

    def demote(self, key: bytes, to: int) -> bool:
        """Move ``key`` down to tier ``to``: ensure it is there (or slower), drop it from faster tiers
        except the durable one: a tier below it may be shared and expire by TTL (Redis), so the
        durable copy is what an acknowledged save keeps. Counted as one demotion per tier it left."""
        with contextlib.ExitStack() as held:
            for slot in self._slots:  # every tier's lock, fast to slow: this moves across all of them
                held.enter_context(slot.lock)
            if key in self._pins:
                return False
            holders = [i for i, s in enumerate(self._slots) if s.has(key)]
            if not holders:
                return False
            if not any(i >= to for i in holders):
                blob = self._slots[holders[0]].get(key)
                if blob is None:
                    return False
                try:
                    self.make_room(to, len(blob))
                    self._slots[to].put(key, blob)
                except TierError:
                    return False  # keep it where it is rather than lose it
                if to >= self._durable:
                    self._dirty.discard([key])
            for i in holders:
                if i < to and i != self._durable and self._slots[i].drop(key):
                    self._slots[i].counters.demotions += 1
            if not any(i < to and i != self._durable for i in holders):
                self._slots[holders[0]].counters.demotions += 1  # copied down, nothing above it dropped
            return True

    def evict(self, keys: Sequence[bytes], tier: str, what: str) -> int:
        """Move ``what``'s chunks ``keys`` down to ``tier`` (admin: simulate memory pressure); how many moved.

        A chunk already there is left alone and not counted (nor is a missing one): a chunk is there
        when no tier faster than ``tier`` holds it, except the durable tier, which keeps its copy
        when ``tier`` is below it (a shared tier may expire by TTL). Evict only moves down: a session
        with a chunk held only by slower tiers is refused before anything moves (prefetch moves
        chunks up). A chunk that cannot move now (a load has it pinned, ``tier`` has no room) stays
        where it is and is not counted, as under real memory pressure; the same call again moves it."""
        names = [s.name for s in self._slots]
        if tier not in names:
            raise InvalidArgument(f"unknown tier {tier!r}; this store has {', '.join(names)}")
        to = names.index(tier)
        down: list[bytes] = []
        below: dict[str, int] = defaultdict(int)
        for k in keys:
            held = [i for i, s in enumerate(self._slots) if s.has(k)]
            if not held:
                continue
            if min(held) > to:
                below[names[min(held)]] += 1
            elif max(held) < to or any(i < to and i != self._durable for i in held):
                down.append(k)
        if below:
            n = sum(below.values())
            raise InvalidArgument(f"evict moves chunks down; use prefetch to move them up ({n} of "
                                  f"{len(keys)} chunks of {what} are below {tier}: "
                                  f"{', '.join(f'{t} {c}' for t, c in below.items())})")
        return sum(self.demote(k, to) for k in down)
