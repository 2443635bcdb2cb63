"""Reading through the session store: prefix lookups, key lookups and loads.

Each sees only chunks the asking namespace owns (``chunk_index.py``): another namespace's chunk is a
miss exactly like an absent one. Lookups answer from the index and the tiers' presence, not the
bytes; a load verifies every chunk it serves against the index (``matcher``), and a copy that fails
is a miss there (deleted from the tier that held it, ``tiered.py``). A chunk the index does not
know may have been saved through another daemon: the sharing layer catches up first.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import cast

from kvstore.format.manifest import check_namespace
from kvstore.results import LookupResult
from kvstore.store.chunk_index import ChunkInfo, chunk_matches
from kvstore.store.counters import HitCounters
from kvstore.store.layouts import Layouts
from kvstore.store.pages import page_matches
from kvstore.store.session_index import SessionIndex
from kvstore.store.sharing import Sharing
from kvstore.store.tiered import TieredStore
from kvstore.tiers.base import Stored

#: How a read verifies one stored copy: True to serve it.
Check = Callable[[Stored], bool]


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
        infos = self._readable(self.index.owned(namespace, keys))
        return all(infos) and self.store.held_in_memory(keys, max_bytes)

    def load(self, namespace: str, keys: Sequence[bytes]) -> Iterator[tuple[bytes, memoryview | bytes | None]]:
        """Verified chunks in order (None for a miss), pinned while they are read. Only chunks
        ``namespace`` owns are read at all, and nothing but an owned chunk's failing copy is ever
        deleted."""
        check_namespace(namespace)
        infos = self._owned(namespace, keys)
        owned = [k for k, info in zip(keys, infos) if info is not None]
        self.store.pin(owned)
        durable_later: list[tuple[bytes, Stored]] = []  # read from a shared tier: one batch, one fsync
        try:
            # chunks only a shared tier holds are fetched ahead, a pipelined window at a time
            with self.sharing.read_ahead(owned, self.store):
                for k, info in zip(keys, infos):
                    blob = None if info is None else self.store.get(k, self.matcher(k, info), durable_later)
                    with self.index.lock:
                        self.hits.loaded_chunks += blob is not None
                        self.hits.missed_chunks += blob is None
                    yield k, blob
            self.store.promote_durably(durable_later)
        finally:
            self.store.unpin(owned)
            with self.index.lock:
                self.hits.loads += 1

    @contextlib.contextmanager
    def read(self, namespace: str, keys: Sequence[bytes]) -> Iterator[list[Stored | None]]:
        """``load`` as one batch: the verified value of each key (None for a miss), valid inside the
        ``with`` block only (views into a tier's storage: send or copy them there). Each tier is asked
        once for the keys no faster tier served, and its answers verified in one pass
        (``batch_reads.py``; chunks by ``chunk_batch.check``, pages blob by blob)."""
        check_namespace(namespace)
        infos = self._owned(namespace, keys)
        pos = [j for j, info in enumerate(infos) if info is not None]
        owned = [keys[j] for j in pos]
        self.store.pin(owned)
        verify = functools.partial(self._verify, owned, [infos[j] for j in pos])
        try:
            with self.sharing.read_ahead(owned, self.store), self.store.read_verified(owned, verify) as got:
                out: list[Stored | None] = [None] * len(keys)
                for j, value in zip(pos, got):
                    out[j] = value
                served = sum(v is not None for v in got)
                with self.index.lock:
                    self.hits.loaded_chunks += served
                    self.hits.missed_chunks += len(keys) - served
                yield out
        finally:
            self.store.unpin(owned)
            with self.index.lock:
                self.hits.loads += 1

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

    def checks(self, namespace: str, keys: Sequence[bytes]) -> list[tuple[bytes, Check]]:
        """The chunks of ``keys`` that ``namespace`` owns, each with the verification a load applies."""
        infos = self._readable(self.index.owned(namespace, keys))
        return [(k, self.matcher(k, i)) for k, i in zip(keys, infos) if i is not None]

    def matcher(self, key: bytes, info: ChunkInfo) -> Check:
        """The verification a read of ``key`` applies: chunk (key from its token ids) or page blob."""
        if info.page:
            play = self.layouts.page(info.layout_id)
            assert play is not None, "an unreadable layout's blob is never read (_readable): a failed check deletes"
            return functools.partial(page_matches, key, info.namespace, play)
        return functools.partial(chunk_matches, key, info, self.chunk_tokens)
