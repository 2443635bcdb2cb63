"""Reading through the session store: prefix lookups, key lookups and loads.

Each sees only chunks the asking namespace owns (``chunk_index.py``): another namespace's chunk is a
miss exactly like an absent one. Lookups answer from the index and the tiers' presence, not the
bytes. Every load is one kind of read, a batch (``read``; ``windows`` for a stream: a batch per
window): each tier asked once, every chunk it serves verified against the index in one pass
(``_verify``: the C kernel), and a copy that fails is a miss there (deleted from the tier that held
it, ``store/tiered/reads.py``). The keys a caller names are checked before any of it (``check_keys``: the
front ends check a request's more strictly, ``server/request_checks.py``, but an in-process caller
comes here directly). A chunk the index does not know may have been saved through another daemon:
the sharing layer catches up first.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar, cast

from kvstore.errors import InvalidArgument
from kvstore.format.manifest import check_namespace
from kvstore.results import LookupResult
from kvstore.store.sessions.chunk_index import ChunkInfo
from kvstore.store.sessions.counters import HitCounters
from kvstore.store.sessions.index import SessionIndex
from kvstore.store.sessions.layouts import Layouts
from kvstore.store.sessions.sharing import Sharing
from kvstore.store.tiered.reads import Verify
from kvstore.store.tiered.store import TieredStore
from kvstore.tiers.base import MAX_KEY_BYTES, Stored

#: A stream's windows (``windows``): the first this many chunks (its first bytes leave at once), then
#: about WINDOW_BYTES each, at most WINDOW_CHUNKS chunks: about what the gRPC adapter sends a hop
#: (``grpc_adapter.MESSAGES_PER_HOP`` messages of 512 KiB), so that a hop does a base load's work per hop
#: and a stream holds at most that much encoded while its caller drains it.
FIRST_WINDOW_CHUNKS = 8
WINDOW_BYTES = 2 << 20
WINDOW_CHUNKS = 1024
_T = TypeVar("_T")


def check_keys(keys: Sequence[bytes]) -> None:
    """InvalidArgument naming the first of ``keys`` that no tier could hold (0 bytes, or more than
    ``MAX_KEY_BYTES``), before any tier is asked: a tier's own guard is an internal invariant (an
    INTERNAL error if a read ever reached it). Any other key names a chunk or nothing: a miss at worst."""
    bad = next((i for i, k in enumerate(keys) if not 0 < len(k) <= MAX_KEY_BYTES), None)
    if bad is not None:
        raise InvalidArgument(f"keys[{bad}] is {len(keys[bad])} bytes long; a key is 1 to {MAX_KEY_BYTES} bytes")


class SessionReads:
    def __init__(self, index: SessionIndex, store: TieredStore, sharing: Sharing, layouts: Layouts,
                 chunk_tokens: int, hits: HitCounters) -> None:
        self.index = index
        self.store = store
        self.sharing = sharing
        self.layouts = layouts
        self.chunk_tokens = chunk_tokens
        self.hits = hits  # updated under index.lock

    def _owned(self, namespace: str, keys: Sequence[bytes]) -> list[ChunkInfo | None]:
        """``index.owned``, caught up with the sharing layer first when some key is unknown; a page
        blob whose layout this store cannot read is a miss (``_readable``)."""
        infos = self.index.owned(namespace, keys)
        # all(): a ChunkInfo is true, None is not (``None in infos`` would call ChunkInfo.__eq__ per key)
        if not all(infos) and self.index.adopt(self.sharing.catch_up(namespace), self.sharing.advance):
            infos = self.index.owned(namespace, keys)  # maybe named by a session published elsewhere
        return self._readable(infos)

    def _readable(self, infos: list[ChunkInfo | None]) -> list[ChunkInfo | None]:
        """``infos`` without the blobs whose layout this store cannot read, of any kind (a page layout
        that did not reopen, or one a shared session names that this daemon was never told of):
        nothing could verify them, so no tier is asked and none deletes them; they are misses, and
        stay stored."""
        unknown = {lid for lid in {i.layout_id for i in infos if i is not None} if self.layouts.get(lid) is None}
        if not unknown:
            return infos
        return [None if info is not None and info.layout_id in unknown else info for info in infos]

    def lookup(self, namespace: str, layout_id: bytes, token_ids: Sequence[int]) -> LookupResult:
        """Longest cached prefix of ``token_ids`` (whole chunks), and which tiers hold it."""
        check_namespace(namespace)
        keys = self.index.kinds.for_layout(namespace, layout_id).prefix_keys(namespace, layout_id, token_ids)
        self.index.adopt(self.sharing.catch_up(namespace), self.sharing.advance)
        tiers: dict[str, int] = defaultdict(int)
        n = 0
        for key in keys:
            # Index and presence, not the bytes: a load verifies those (docs/FORMAT.md).
            with self.index.lock:
                known = self.index.chunks.owned(namespace, key) is not None
            where = self.store.where(key) if known else []
            if not where:
                break
            tiers[where[0]] += 1
            n += 1
        cached = n * self.chunk_tokens
        with self.index.lock:
            self.hits.lookups += 1
            self.hits.requested_tokens += len(token_ids)
            self.hits.hit_tokens += cached
        return LookupResult(cached, len(token_ids), n, dict(tiers))

    def lookup_keys(self, namespace: str, keys: Sequence[bytes]) -> list[str | None]:
        """For each key (an engine block's, or a chunk's), the fastest tier holding a copy that this
        store validated for ``namespace``, or None. As ``lookup``: the index and presence, not the
        bytes (a load verifies those, and a copy damaged since is a miss there)."""
        check_namespace(namespace)
        check_keys(keys)
        known = [info is not None for info in self._owned(namespace, keys)]
        owned = [k for k, ok in zip(keys, known) if ok]
        where = iter(self.store.fastest(owned))
        out = [next(where) if ok else None for ok in known]
        with self.index.lock:
            self.hits.lookups += 1
        return out

    def held_in_memory(self, namespace: str, keys: Sequence[bytes], max_bytes: int) -> bool:
        """Whether ``namespace`` owns every one of ``keys`` and the fastest tier, a memory tier, holds
        them in at most ``max_bytes`` together: a front end's quick-path test (a lookup, no read).
        Ownership first, from the index alone (no catch-up: the sharing layer may be remote), and a
        tier is asked only about owned keys, so the answer depends on the caller's own data only:
        another namespace's chunk in memory and a key nobody stored answer alike, in the same time."""
        check_keys(keys)
        infos = self._readable(self.index.owned(namespace, keys))
        return all(infos) and self.store.held_in_memory(keys, max_bytes)

    def owned(self, namespace: str, keys: Sequence[bytes]) -> list[bytes]:
        """The keys of ``keys`` that ``namespace`` owns and this store can verify: what a load of
        them reads (a prefetch asks for the same)."""
        check_namespace(namespace)
        check_keys(keys)
        return [k for k, info in zip(keys, self._readable(self.index.owned(namespace, keys))) if info is not None]

    @contextlib.contextmanager
    def read(self, namespace: str, keys: Sequence[bytes]) -> Iterator[list[Stored | None]]:
        """The verified value of each key (None for a miss) of those ``namespace`` owns, pinned while
        read, valid inside the ``with`` block only (views into a tier's storage: send or copy them
        there). Each tier is asked once for the keys no faster tier served, and its answers verified
        in one pass (``store/tiered/reads.py``; chunks by ``chunk_batch.check``, pages by ``pages_match``).
        Only chunks ``namespace`` owns are read at all, and nothing but an owned chunk's failing copy
        is ever deleted."""
        infos = self._checked(namespace, keys)
        owned = [k for k, info in zip(keys, infos) if info is not None]
        self.store.pin(owned)
        try:
            with self._batch(keys, infos) as out:
                yield out
        finally:
            self.store.unpin(owned)
            with self.index.lock:
                self.hits.loads += 1

    def windows(self, namespace: str, keys: Sequence[bytes], use: Callable[[int, list[Stored | None]], list[_T]]
                ) -> Iterator[_T]:
        """``read`` in windows, for an answer a remote caller drains at its own pace (the gRPC stream):
        each window is a batch read of a few MB whose values ``use(its first position in keys, its
        values)`` turns into what it returns (messages: copies), and whose read (an LMDB read
        transaction, the views) ends before they are yielded. The keys stay pinned across the windows,
        and are unpinned when the generator ends or is closed."""
        infos = self._checked(namespace, keys)
        owned = [k for k, info in zip(keys, infos) if info is not None]
        self.store.pin(owned)
        try:
            start, n = 0, FIRST_WINDOW_CHUNKS
            while start < len(keys):
                end = min(len(keys), start + n)
                with self._batch(keys[start:end], infos[start:end]) as values:
                    done = use(start, values)
                    got = [len(v) for v in values if v is not None]
                yield from done
                if got:  # about WINDOW_BYTES of chunks the size of these
                    n = max(1, min(WINDOW_CHUNKS, WINDOW_BYTES * len(got) // max(1, sum(got))))
                start = end
        finally:
            self.store.unpin(owned)
            with self.index.lock:
                self.hits.loads += 1

    def _checked(self, namespace: str, keys: Sequence[bytes]) -> list[ChunkInfo | None]:
        """A read's keys checked (before any tier is asked: InvalidArgument naming a bad one), then the
        index entry of each that ``namespace`` owns."""
        check_namespace(namespace)
        check_keys(keys)
        return self._owned(namespace, keys)

    @contextlib.contextmanager
    def _batch(self, keys: Sequence[bytes], infos: Sequence[ChunkInfo | None]) -> Iterator[list[Stored | None]]:
        """One batch read of the owned ones of ``keys`` (already pinned), verified, counted."""
        pos = [j for j, info in enumerate(infos) if info is not None]
        owned = [keys[j] for j in pos]
        verify = functools.partial(self._verify, owned, [infos[j] for j in pos])
        with self.sharing.read_ahead(owned, self.store), self.store.read_verified(owned, verify) as got:
            out: list[Stored | None] = [None] * len(keys)
            for j, value in zip(pos, got):
                out[j] = value
            served = sum(v is not None for v in got)
            with self.index.lock:
                self.hits.loaded_chunks += served
                self.hits.missed_chunks += len(keys) - served
            yield out

    def verifier(self, namespace: str, keys: Sequence[bytes]) -> Verify:
        """The verification a read of ``keys`` (owned by ``namespace``) applies, for a batch read of them
        outside a load (a prefetch: ``TieredStore.prefetch``); a key the index no longer knows fails."""
        infos = self._readable(self.index.owned(namespace, keys))
        return functools.partial(self._verify, keys, infos)

    def _verify(self, keys: Sequence[bytes], infos: Sequence[ChunkInfo | None], at: Sequence[int],
                values: Sequence[Stored]) -> list[bool]:
        """Whether each value (of ``keys[at[i]]``, known as ``infos[at[i]]``) is what the index says: each
        kind's in one batch by its own kernel (``SessionKind.verify``), a long load's over the cores."""
        mine = [infos[j] for j in at]
        kinds = {info.kind for info in mine if info is not None}
        if len(kinds) == 1 and all(mine):  # a load's: one kind, every blob known (a ChunkInfo is true)
            return self.index.kinds.of(kinds.pop()).verify([keys[j] for j in at], cast(list[ChunkInfo], mine), values)
        ok = [False] * len(at)
        for kind in kinds:
            run = [(i, info) for i, info in enumerate(mine) if info is not None and info.kind is kind]
            good = self.index.kinds.of(kind).verify([keys[at[i]] for i, _ in run], [info for _, info in run],
                                                    [values[i] for i, _ in run])
            for (i, _), g in zip(run, good):
                ok[i] = g
        return ok
