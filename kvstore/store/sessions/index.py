"""The session store's in-memory index: every session's current manifest, which sessions reference
each chunk (reachability, derived from the manifests: no refcount to drift), and who owns each
chunk and where it sits (``chunk_index.py``). Rebuilt at open from the manifests.

Two locks, taken in this order. ``write_lock`` orders every change of a manifest (save, commit,
delete, touch, expiry, GC, a version caught up from another daemon) and is held across its durable
commit (its fsync), so a check and the write it guards see one state. ``lock`` guards the index's
contents (and the store's hit counters) and is never held across a tier call that writes: loads,
lookups and listings never wait behind a save's fsync. Both are re-entrant: a caller holds them
across several of the calls below when they must see one state.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from kvstore.format.keys import ROOT
from kvstore.format.manifest import Manifest
from kvstore.store.sessions.chunk_index import ChunkIndex, ChunkInfo
from kvstore.store.sessions.kind import Kinds
from kvstore.store.sessions.sharing import SessionRef, Update
from kvstore.store.sessions.turn_log import TurnLog

#: Pins (or unpins) chunks in the tiered store: a pinned session's chunks are never demoted.
PinChunks = Callable[[Sequence[bytes]], None]
#: Tells the tiered store which namespace owns chunks (``TieredStore.claim``: per-namespace usage).
ClaimChunks = Callable[[Sequence[bytes], str], None]


def _no_claim(keys: Sequence[bytes], namespace: str) -> None:
    pass


class SessionIndex:
    def __init__(self, pin: PinChunks, unpin: PinChunks, kinds: Kinds, claim: ClaimChunks = _no_claim) -> None:
        #: The session kinds: each manifest's (``Manifest.kind``) enters its chunks and finds them again.
        self.kinds = kinds
        self.write_lock = threading.RLock()
        self.lock = threading.RLock()
        self._pin, self._unpin, self._claim = pin, unpin, claim
        self._manifests: dict[SessionRef, Manifest] = {}
        self._refs: dict[bytes, set[SessionRef]] = defaultdict(set)
        #: Owner and place of every chunk saved or named by a manifest: reads, lookups and commits
        #: see only their own namespace's chunks, and every hit is verified against it.
        self.chunks = ChunkIndex()
        #: What the durable tier holds of each session (its manifest and turn records: ``turn_log.py``),
        #: changed under ``write_lock`` only; kept when a session leaves the index (its records stay on
        #: disk until a save or delete writes over them).
        self.logs: dict[SessionRef, TurnLog] = {}

    # -- sessions ---------------------------------------------------------------------------------
    def get(self, ref: SessionRef) -> Manifest | None:
        """The session's current version (expired or not), or None."""
        return self._manifests.get(ref)

    def add(self, m: Manifest) -> None:
        """Index a session's version (the first; ``replace`` for a later one)."""
        ref = (m.namespace, m.session_id)
        with self.lock:
            self._manifests[ref] = m
            for k in m.chunk_keys:
                self._refs[k].add(ref)
            self.kinds.of(m.kind).record(self.chunks, m.namespace, m.layout_id, m.chunk_keys)
        self._claim(m.chunk_keys, m.namespace)
        if m.retention.pinned:  # a pinned session's chunks are never demoted or evicted
            self._pin(m.chunk_keys)

    def remove(self, ref: SessionRef) -> list[bytes]:
        """Drop a session; returns the chunk keys nobody references any more."""
        with self.lock:
            old = self._manifests.pop(ref, None)
            freed = self._unref(ref, old.chunk_keys if old else ())
        if old is not None and old.retention.pinned:
            self._unpin(old.chunk_keys)
        return freed

    def replace(self, m: Manifest) -> None:
        """Index ``m`` as its session's current version, in place of any other. A session that grew
        (its chunks those of the version it replaces, and more) changes only what differs: a turn of
        a long session costs what the turn adds, not what the session holds."""
        ref = (m.namespace, m.session_id)
        with self.lock:
            old = self._manifests.get(ref)
            same = self.unchanged_prefix(m)
            if old is None or not same or old.retention.pinned or m.retention.pinned:
                self.remove(ref)
                self.add(m)
                return
            self._manifests[ref] = m
            added = m.chunk_keys[same:]
            kept = set(added)
            self._unref(ref, [k for k in old.chunk_keys[same:] if k not in kept])
            for k in added:
                self._refs[k].add(ref)
            self._claim(added, m.namespace)
            self.kinds.of(m.kind).record(self.chunks, m.namespace, m.layout_id, added, same, m.chunk_keys[same - 1])

    def append(self, m: Manifest, start: int) -> None:
        """Index ``m``, its session's current version with keys appended from chunk ``start`` (an
        append: same layout, kind and retention): O(the keys added)."""
        ref = (m.namespace, m.session_id)
        added = m.chunk_keys[start:]
        with self.lock:
            self._manifests[ref] = m
            for k in added:
                self._refs[k].add(ref)
            self.kinds.of(m.kind).record(self.chunks, m.namespace, m.layout_id, added, start,
                                         m.chunk_keys[start - 1] if start else ROOT)
        self._claim(added, m.namespace)
        if m.retention.pinned:
            self._pin(added)

    def log(self, ref: SessionRef) -> TurnLog:
        """What the durable tier holds of the session (nothing: an empty log)."""
        return self.logs.get(ref) or TurnLog()

    def unchanged_prefix(self, m: Manifest) -> int:
        """How many leading chunks ``m`` names in the places its session's current version has them, as
        its kind counts them (0 for another layout)."""
        with self.lock:
            old = self._manifests.get((m.namespace, m.session_id))
        if old is None or old.layout_id != m.layout_id or old.kind is not m.kind:
            return 0
        return self.kinds.of(m.kind).unchanged(old.chunk_keys, m.chunk_keys)

    def _unref(self, ref: SessionRef, keys: Iterable[bytes]) -> list[bytes]:
        """``ref`` no longer references ``keys``; returns those nobody references any more (under ``lock``)."""
        freed = []
        for k in keys:
            refs = self._refs.get(k)
            if refs is not None:
                refs.discard(ref)
                if not refs:
                    del self._refs[k]
                    freed.append(k)
        return freed

    def adopt(self, updates: list[Update], advance: Callable[[SessionRef, int], bool]) -> bool:
        """Index versions other daemons published (``sharing.py``), those ``advance`` accepts (not one
        older than a version saved here meanwhile); whether any was given."""
        if not updates:
            return False
        with self.write_lock, self.lock:
            for ref, gen, m in updates:
                if advance(ref, gen):
                    self.remove(ref)
                    if m is not None:
                        self.add(m)
                    # the version indexed is not the one on this daemon's disk: the next save writes it whole;
                    # nor one this daemon's append made (no retry of one is answered with it)
                    self.logs[ref] = replace(self.log(ref), chains=False, last_base=0, last_first=-1)
        return True

    def live(self, now: float, namespace: str | None = None) -> list[Manifest]:
        """The unexpired sessions (of ``namespace``, None: of all), by namespace and id."""
        with self.lock:
            ms = [m for (ns, _), m in self._manifests.items() if namespace in (None, ns) and not m.expired(now)]
        return sorted(ms, key=lambda m: (m.namespace, m.session_id))

    def expired(self, now: float) -> list[SessionRef]:
        with self.lock:
            return [ref for ref, m in self._manifests.items() if m.expired(now)]

    def pinned_keys(self) -> set[bytes]:
        with self.lock:
            return {k for m in self._manifests.values() if m.retention.pinned for k in m.chunk_keys}

    # -- chunks -----------------------------------------------------------------------------------
    def owned(self, namespace: str, keys: Sequence[bytes]) -> list[ChunkInfo | None]:
        """Each key's info if ``namespace`` owns it, else None (absent and another's alike)."""
        with self.lock:
            return [self.chunks.owned(namespace, k) for k in keys]

    def referenced(self) -> list[bytes]:
        """Every chunk some session references."""
        with self.lock:
            return list(self._refs)

    def unreferenced(self, keys: Sequence[bytes] | set[bytes]) -> list[bytes]:
        """The keys no session references."""
        with self.lock:
            return [k for k in keys if not self._refs.get(k)]

    def replaced_only(self, refs: set[SessionRef], kept: set[bytes]) -> list[bytes]:
        """Chunks that only the current versions of ``refs`` use and no new version names: what
        replacing (or deleting) them frees."""
        out: dict[bytes, None] = {}
        with self.lock:
            for ref in refs:
                old = self._manifests.get(ref)
                for k in old.chunk_keys if old is not None else ():
                    if k not in kept and self._refs.get(k, set()) <= refs:
                        out[k] = None
        return list(out)

    def forget_chunks(self, keys: Sequence[bytes]) -> None:
        """Chunks deleted from the tiers: nobody owns them any more."""
        with self.lock:
            for k in keys:
                self.chunks.discard(k)

    def live_chunks(self, now: float) -> dict[bytes, bytes]:
        """Every chunk a live (unexpired) session references, with that session's layout id."""
        with self.lock:
            return {k: m.layout_id for m in self._manifests.values() if not m.expired(now) for k in m.chunk_keys}


def common_prefix(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """How many leading keys ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, a session grown by a turn: one comparison in C
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
