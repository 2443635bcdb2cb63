"""Sessions, first-class: save chunks, commit manifests, look up prefixes, delete safely.

Invariants:
- a manifest is written in the same transaction as the new chunks it references (``save_session``)
  or after they are durable (``save_chunks`` then ``commit``), so a manifest never references a
  missing chunk and a crashed save leaves the previous version or the new one, complete;
- every call is one durable transaction (docs/FORMAT.md, "Transactions"); concurrent turn saves
  share one (group commit);
- chunks are content-addressed and shared by every session of a namespace with the same prefix;
  which sessions reference a chunk is derived from the manifests (a reachability index rebuilt at
  open), so deleting one session never breaks another, and there is no refcount to drift;
- tiers slower than the durable tier may be shared by several daemons (Redis): this store never
  garbage-collects them; their copies expire by TTL. A Redis tier with ``share_sessions`` also
  gets every save before it is acknowledged, and sessions other daemons saved are caught up from
  it (``shared_manifests.py``).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from kvstore.format.keys import ROOT, chain_keys
from kvstore.format.manifest import (
    KEY_PREFIX,
    Manifest,
    ManifestError,
    Retention,
    check_namespace,
    check_retention,
    check_session_id,
    is_legacy_manifest,
    manifest_key,
)
from kvstore.format.page_layout import PageLayout
from kvstore.results import LookupResult, SaveResult
from kvstore.store.chunk_index import ChunkIndex, ChunkInfo, chunk_matches
from kvstore.store.config import StoreConfig
from kvstore.store.counters import DamageCounters, HitCounters
from kvstore.store.group_commit import GroupCommit, Pending
from kvstore.store.layouts import AnyLayout, Layouts
from kvstore.store.pages import check_page_manifest, page_batch_keys, page_matches
from kvstore.store.shared_manifests import SharedSessions, Update
from kvstore.store.tiered import TieredStore
from kvstore.store.turn import SavedTurn, Turn
from kvstore.store.validate import chunk_batch_keys, chunk_layout, manifest_layout
from kvstore.tiers.base import Stored, WriteBatch

log = logging.getLogger(__name__)
SessionRef = tuple[str, str]  # (namespace, session id)


def same_content(a: Manifest, b: Manifest) -> bool:
    """Whether two versions of a session store the same thing (their times and stamps aside)."""
    return (a.layout_id, a.token_count, a.chunk_tokens, a.chunk_keys, a.tail, a.last_token_ids, a.retention,
            a.metadata) == (b.layout_id, b.token_count, b.chunk_tokens, b.chunk_keys, b.tail, b.last_token_ids,
                            b.retention, b.metadata)


def next_generation(old: Manifest | None, now: float) -> int:
    """The version stamp of a session's next version (``Manifest.generation``): larger than
    ``old``'s, and the store clock's microseconds when that is larger still, so that a session
    deleted and saved again never reuses a stamp a client may still hold as its base."""
    return max((old.generation if old is not None else 0) + 1, int(now * 1_000_000))


class SessionStore:
    def __init__(self, store: TieredStore, config: StoreConfig, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self.hits = HitCounters()
        self.damage = DamageCounters()
        #: Two locks, taken in this order. ``_write_lock`` orders every change of a manifest (save,
        #: commit, delete, touch, expiry, GC) and is held across its durable commit (its fsync), so a
        #: check and the write it guards see one state. ``_lock`` guards the in-memory index and the
        #: counters and is never held across a tier call that writes: loads, lookups and listings
        #: never wait behind a save's fsync.
        self._write_lock = threading.RLock()
        self._lock = threading.RLock()
        #: Concurrent turn saves share one durable transaction (one fsync) per group.
        self._turns: GroupCommit[Turn, SavedTurn] = GroupCommit(self._write_lock, self._commit_turns)
        self._manifests: dict[SessionRef, Manifest] = {}
        self._refs: dict[bytes, set[SessionRef]] = defaultdict(set)
        #: Owner and place of every chunk saved or named by a manifest: reads, lookups and commits
        #: see only their own namespace's chunks, and every hit is verified against it.
        self._chunks = ChunkIndex()
        #: With a shared tier: sessions published to it and caught up from it (shared_manifests.py).
        self._shared = SharedSessions.of(store)
        #: Token layouts (presets) and the engine page layouts clients registered.
        self.layouts = Layouts(store)
        self._load_manifests()

    @property
    def reads_remote(self) -> bool:
        """Whether reading a manifest may take a network round trip (a shared tier catches up first)."""
        return self._shared is not None

    # -- startup --------------------------------------------------------------------------------
    def _load_manifests(self) -> None:
        # Data dirs of the old format kept manifests among the chunks: move them out first, once.
        self.store.migrate_meta(KEY_PREFIX, is_legacy_manifest)
        for key in list(self.store.meta_keys(KEY_PREFIX)):
            blob = self.store.get_meta(key)
            try:
                m = Manifest.decode(blob) if blob is not None else None
            except (ManifestError, ValueError) as e:
                log.error("manifest %r is damaged (%s): ignored", key, e)
                self.damage.manifests += 1
                continue
            if m is not None:
                self._index(m)

    def collect_garbage(self) -> int:
        """Delete chunks (on the durable tier and faster ones) that no manifest references, e.g.
        the chunks of a save that crashed before its commit. Returns how many were deleted."""
        with self._write_lock:
            held = self.store.chunk_keys(local_only=True)
            with self._lock:
                orphans = [k for k in held if not self._refs.get(k)]
            self._free(orphans)
            return len(orphans)

    def check_references(self) -> int:
        """Count (and log) chunks that live sessions reference but the durable tier lacks, e.g.
        after damage to its file: found at open rather than by a client's load."""
        with self._lock:
            # a chunk demoted below the durable tier (admin evict to redis) is not missing
            missing = [k for k in self._refs if not self.store.holds_durably(k) and not self.store.contains(k)]
            self.damage.missing_chunks = len(missing)
        if missing:
            log.error("%d chunks referenced by sessions are missing from the durable tier (first: %s)",
                      len(missing), missing[0].hex())
        return len(missing)

    def _index(self, m: Manifest) -> None:
        ref = (m.namespace, m.session_id)
        self._manifests[ref] = m
        for k in m.chunk_keys:
            self._refs[k].add(ref)
        if m.engine_pages:
            self._chunks.add_pages(m.namespace, m.layout_id, m.chunk_keys)
        else:
            self._chunks.add_sequence(m.namespace, m.layout_id, m.chunk_keys)
        if m.retention.pinned:  # a pinned session's chunks are never demoted or evicted
            self.store.pin(m.chunk_keys)

    def _unindex(self, ref: SessionRef) -> list[bytes]:
        """Drop a session from the index; returns the chunk keys nobody references any more."""
        old = self._manifests.pop(ref, None)
        if old is not None and old.retention.pinned:
            self.store.unpin(old.chunk_keys)
        freed = []
        for k in old.chunk_keys if old else ():
            refs = self._refs.get(k)
            if refs is not None:
                refs.discard(ref)
                if not refs:
                    del self._refs[k]
                    freed.append(k)
        return freed

    def _free(self, keys: Sequence[bytes]) -> None:
        """Delete chunks nobody references, in one batch (one transaction on the durable tier)."""
        self.store.delete_many(keys, local_only=True)
        self._forget(keys)

    def _forget(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._chunks.discard(k)

    def save_chunks(self, namespace: str, layout_id: bytes, parent: bytes, first_index: int,
                    blobs: Sequence[bytes | memoryview]) -> SaveResult:
        """Validate and store consecutive complete chunks of one sequence, starting at chunk
        ``first_index`` whose parent key is ``parent``. Chunks the store already holds are not
        written again. Returns their keys."""
        check_namespace(namespace)
        play = self.layouts.page(layout_id)
        if play is not None:
            keys = page_batch_keys(namespace, play, blobs)
        else:
            lay = chunk_layout(layout_id, self.config.chunk_tokens)
            keys = chunk_batch_keys(namespace, lay, self.config.chunk_tokens, parent, first_index, blobs)
        # everything was validated first: bad input changes nothing stored; a failed write leaves
        # nothing behind either (put_many is all or nothing), and the index learns only of success
        new = self._new_chunks(keys, blobs)
        self.store.put_many(new)
        with self._lock:
            if play is not None:
                self._chunks.add_pages(namespace, layout_id, keys)
            else:
                self._chunks.add_sequence(namespace, layout_id, keys, first_index, parent)
        return SaveResult(keys, len(new))

    def _new_chunks(self, keys: Sequence[bytes], blobs: Sequence[bytes | memoryview]
                    ) -> list[tuple[bytes, bytes | memoryview]]:
        """The chunks of a batch the durable tier does not hold yet, each once."""
        new: dict[bytes, bytes | memoryview] = {}
        for key, blob in zip(keys, blobs):
            if key not in new and not self.store.holds_durably(key):
                new[key] = blob
        return list(new.items())

    def commit(self, m: Manifest) -> Manifest:
        """Atomically publish a session version. Every chunk it names must already be stored."""
        return self.save_session(m.namespace, m.layout_id, ROOT, 0, (), m)[0]

    def save_session(self, namespace: str, layout_id: bytes, parent: bytes, first_index: int,
                     blobs: Sequence[bytes | memoryview], manifest: Manifest) -> tuple[Manifest, SaveResult]:
        """Save a turn: store ``blobs`` (consecutive complete chunks from chunk ``first_index``,
        whose parent key is ``parent``) and publish ``manifest``, in one durable transaction: one
        fsync, and a crash at any point leaves the previous version or this one, complete.

        ``manifest`` must name the blobs' keys at positions ``first_index...``; every other chunk
        it names must already be stored. Everything is validated before anything is written: bad
        input changes nothing. Returns the committed manifest (stamped with the store's clock)
        and the chunks' keys with how many were new. With no blobs this is ``commit``.

        Concurrent calls share transactions (group commit): a call returns once the transaction
        holding its turn is durable, or with its own error."""
        check_namespace(namespace)
        if manifest.namespace != namespace or manifest.layout_id != layout_id:
            raise InvalidArgument("the manifest must name the save's namespace and layout")
        check_retention(manifest.retention)
        ct = self.config.chunk_tokens
        play = self.layouts.page(layout_id)
        if play is not None:  # a turn of engine pages: the manifest names them wherever it likes
            check_page_manifest(manifest)
            keys = page_batch_keys(namespace, play, blobs)
            if not set(keys) <= set(manifest.chunk_keys):
                raise InvalidArgument("the manifest does not name every saved page blob")
            return self._turns.submit(Turn(namespace, layout_id, ROOT, 0, keys, blobs, manifest, pages=True))
        manifest_layout(manifest, ct)
        keys = []
        if blobs:
            lay = chunk_layout(layout_id, ct)
            keys = chunk_batch_keys(namespace, lay, ct, parent, first_index, blobs)
            end = first_index + len(keys)
            if list(manifest.chunk_keys[first_index:end]) != keys:
                raise InvalidArgument(f"the manifest does not name the saved chunks as its chunks "
                                      f"{first_index} to {end - 1}")
        return self._turns.submit(Turn(namespace, layout_id, parent, first_index, keys, blobs, manifest))

    def _commit_turns(self, group: list[Pending[Turn, SavedTurn]]) -> list[Pending[Turn, SavedTurn]]:
        """Commit a group of turns (``group_commit.py``) in one durable transaction, under the write
        lock: each turn is checked against the index as the group found it (a failing one fails
        alone), then every accepted turn's new chunks and manifest, and the chunks only the
        versions they replace used, go in one WriteBatch. A second turn of one session waits for
        the next group. If the transaction fails, every turn of the group fails with it and the
        index is untouched."""
        accepted: list[tuple[Pending[Turn, SavedTurn], Manifest, list[tuple[bytes, bytes | memoryview]]]] = []
        later: list[Pending[Turn, SavedTurn]] = []
        refs: set[SessionRef] = set()
        for p in group:
            t = p.item
            ref = (t.manifest.namespace, t.manifest.session_id)
            if ref in refs:
                later.append(p)
                continue
            batch = t.batch  # a page turn's positions are found in its manifest: once
            try:
                self._check_chunks(t.manifest, skip=batch)
                self._check_base(t.manifest)  # after what the request names: its own errors come first
                if self.config.write_mode == "back":
                    self.store.flush([k for i, k in enumerate(t.manifest.chunk_keys) if i not in batch])
            except Exception as e:  # this turn's own error, raised to its caller
                p.fail(e)
                continue
            refs.add(ref)
            old = self._manifests.get(ref)
            now = self.clock()  # the store's clock stamps versions: TTLs never trust a caller's times
            m = replace(t.manifest, created_at=old.created_at if old is not None else now, updated_at=now,
                        generation=next_generation(old, now))
            accepted.append((p, m, self._new_chunks(t.keys, t.blobs)))
        if self._shared is not None:  # published first: the shared compare-and-set decides races
            accepted = self._shared.publish_turns(accepted, self.store)
            refs = {(m.namespace, m.session_id) for _, m, _ in accepted}
        if not accepted:
            return later
        puts = {k: blob for _, _, new in accepted for k, blob in new}
        doomed = self._replaced_only(refs, {k for _, m, _ in accepted for k in m.chunk_keys})
        try:
            self.store.commit(WriteBatch(puts=list(puts.items()), deletes=doomed,
                                         meta_puts=[(m.key, m.encode()) for _, m, _ in accepted]))
        except Exception as e:  # nothing of the group is stored: every turn of it fails
            if self._shared is not None:
                self._shared.forget(list(refs))
            for p, _, _ in accepted:
                p.fail(e)
            return later
        with self._lock:
            for p, m, _ in accepted:
                t = p.item
                if t.keys and t.pages:
                    self._chunks.add_pages(t.namespace, t.layout_id, t.keys)
                elif t.keys:
                    self._chunks.add_sequence(t.namespace, t.layout_id, t.keys, t.first_index, t.parent)
                self._unindex((m.namespace, m.session_id))
                self._index(m)
        self._forget(doomed)
        for p, m, new in accepted:
            p.succeed((m, SaveResult(p.item.keys, len(new))))
        return later

    def _check_base(self, m: Manifest) -> None:
        """A save based on version ``m.generation`` (0: no base, the save replaces whatever is stored)
        replaces only that version: FailedPrecondition, the stored version kept, if the session was
        changed since (saved through another client, touched, deleted). A save that stores exactly the
        current version (the retry of a save that was applied but whose answer was lost) is no change
        and goes through. With a shared tier a base newer than this daemon's version (loaded through
        another daemon) catches up first."""
        if m.generation == 0:
            return
        ref = (m.namespace, m.session_id)
        old = self._manifests.get(ref)
        if self._shared is not None and (old is None or old.generation != m.generation):
            self._adopt(self._shared.catch_up_session(ref))
            old = self._manifests.get(ref)
        if old is not None and (old.generation == m.generation or same_content(old, m)):
            return
        now = f"it is at version {old.generation}" if old is not None else "it was deleted since"
        raise FailedPrecondition(f"session {m.session_id!r} in namespace {m.namespace!r} was changed through another "
                                 f"client: this save was based on version {m.generation}, {now}. This change was "
                                 f"not applied; load the session again and retry")

    def _replaced_only(self, refs: set[SessionRef], kept: set[bytes]) -> list[bytes]:
        """Chunks that only the current versions of ``refs`` use and no new version names: what
        replacing them frees."""
        out: dict[bytes, None] = {}
        for ref in refs:
            old = self._manifests.get(ref)
            for k in old.chunk_keys if old is not None else ():
                if k not in kept and self._refs.get(k, set()) <= refs:
                    out[k] = None
        return list(out)

    def _check_chunks(self, m: Manifest, skip: range | frozenset[int] = range(0)) -> None:
        """Every chunk ``m`` names is stored, owned by its namespace, and in its place; except the
        positions in ``skip``, whose chunks this save brings (validated against their keys)."""
        with self._lock:
            infos = [self._chunks.owned(m.namespace, k) for k in m.chunk_keys]
        # Another namespace's chunk and an absent one are one case, answered with one message:
        # a commit must not tell a tenant what another one holds.
        absent = [i for i, (k, info) in enumerate(zip(m.chunk_keys, infos))
                  if i not in skip and (info is None or not self.store.holds_durably(k))]
        if absent and self._shared is not None:  # a chunk published to the shared tier is stored
            shared = self._shared.held([m.chunk_keys[i] for i in absent if infos[i] is not None])
            absent = [i for i in absent if m.chunk_keys[i] not in shared]
        missing = [m.chunk_keys[i].hex() for i in absent]
        if missing:
            raise FailedPrecondition(f"{len(missing)} referenced chunks are not stored in namespace "
                                     f"{m.namespace!r} (first: {missing[0]}); save them before committing")
        for i, (k, info) in enumerate(zip(m.chunk_keys, infos)):
            if i in skip:
                continue
            assert info is not None
            if info.layout_id != m.layout_id:
                raise InvalidArgument(f"chunk {i} ({k.hex()}) was saved under layout {info.layout_id.hex()}, "
                                      f"the manifest's is {m.layout_id.hex()}")
            if m.engine_pages:  # in no chain
                continue
            parent = m.chunk_keys[i - 1] if i else ROOT
            if info.index != i or info.parent != parent:
                raise InvalidArgument(f"chunk {i} ({k.hex()}) is out of place: it is chunk {info.index} of its "
                                      f"sequence and follows {info.parent.hex()}, not {parent.hex()}")

    # -- sessions -------------------------------------------------------------------------------
    def get(self, namespace: str, session_id: str) -> Manifest:
        ref = (check_namespace(namespace), check_session_id(session_id))
        if self._shared is not None:
            self._adopt(self._shared.catch_up_session(ref))
        m = self._manifests.get(ref)
        if m is None or m.expired(self.clock()):
            raise NotFound(f"no session {session_id!r} in namespace {namespace!r}")
        return m

    def list(self, namespace: str | None = None) -> list[Manifest]:
        if self._shared is not None:
            self._adopt(self._shared.catch_up(namespace))
        now = self.clock()
        with self._lock:
            ms = [m for (ns, _), m in self._manifests.items() if namespace in (None, ns) and not m.expired(now)]
        return sorted(ms, key=lambda m: (m.namespace, m.session_id))

    def delete(self, namespace: str, session_id: str) -> int:
        """Delete a session; returns how many chunks were freed (those no other session uses)."""
        with self._write_lock:
            m = self.get(namespace, session_id)
            ref = (m.namespace, m.session_id)
            if self._shared is not None:
                self._shared.publish(m, None)
            with self._lock:
                freed = self._replaced_only({ref}, set())
            # the manifest and the chunks only it used: one transaction (one fsync)
            self.store.commit(WriteBatch(deletes=freed, meta_deletes=[m.key]))
            with self._lock:
                self._unindex(ref)
            self._forget(freed)
        return len(freed)

    def touch(self, namespace: str, session_id: str, retention: Retention) -> Manifest:
        check_retention(retention)
        with self._write_lock:  # the version read here is the one replaced: no save slips in between
            old, now = self.get(namespace, session_id), self.clock()
            m = replace(old.with_retention(retention, now), generation=next_generation(old, now))
            if self._shared is not None:
                self._shared.publish(m, m.encode())
            self.store.put_meta(m.key, m.encode())
            with self._lock:
                self._unindex((m.namespace, m.session_id))
                self._index(m)
        return m

    def expire(self) -> int:
        """Delete every session whose TTL has passed; returns how many."""
        now = self.clock()
        with self._write_lock:
            with self._lock:
                gone = [ref for ref, m in self._manifests.items() if m.expired(now)]
                freed = []
                for ref in gone:
                    freed.extend(self._unindex(ref))
            # every expired manifest and the chunks only they used: one transaction
            try:
                self.store.commit(WriteBatch(deletes=freed, meta_deletes=[manifest_key(*ref) for ref in gone]))
            except (Unavailable, ResourceExhausted) as e:  # the index forgot them: the next open retries
                log.error("could not delete %d expired sessions from the durable tier: %s", len(gone), e)
            self._forget(freed)
        return len(gone)

    def _adopt(self, updates: builtins.list[Update]) -> None:
        """Index the versions other daemons published (shared_manifests.py), in memory."""
        if not updates:
            return
        assert self._shared is not None
        with self._write_lock, self._lock:
            for ref, gen, m in updates:
                if self._shared.advance(ref, gen):  # not if a save here got a newer one meanwhile
                    self._unindex(ref)
                    if m is not None:
                        self._index(m)

    def pinned_keys(self) -> set[bytes]:
        return {k for m in self._manifests.values() if m.retention.pinned for k in m.chunk_keys}

    # -- reading --------------------------------------------------------------------------------
    def lookup(self, namespace: str, layout_id: bytes, token_ids: Sequence[int]) -> LookupResult:
        """Longest cached prefix of ``token_ids`` (whole chunks), and which tiers hold it."""
        check_namespace(namespace)
        if isinstance(self.layouts.known(layout_id), PageLayout):
            raise InvalidArgument("engine page blobs are looked up by key (LookupKeys), not by token ids")
        if self._shared is not None:
            self._adopt(self._shared.catch_up(namespace))
        tiers: dict[str, int] = defaultdict(int)
        n = 0
        for key in chain_keys(layout_id, namespace, token_ids, self.config.chunk_tokens):
            # Index and presence, not the bytes: a load verifies those (docs/FORMAT.md).
            with self._lock:
                known = self._chunks.owned(namespace, key) is not None
            where = self.store.where(key) if known else []
            if not where:
                break
            tiers[where[0]] += 1
            n += 1
        cached = n * self.config.chunk_tokens
        with self._lock:
            self.hits.lookups += 1
            self.hits.requested_tokens += len(token_ids)
            self.hits.hit_tokens += cached
        return LookupResult(cached, len(token_ids), n, dict(tiers))

    def lookup_keys(self, namespace: str, keys: Sequence[bytes]) -> builtins.list[str | None]:
        """For each key (an engine block's, or a chunk's), the fastest tier holding a copy that this
        store validated for ``namespace``, or None. As ``lookup``: the index and presence, not the
        bytes (a load verifies those, and a copy damaged since is a miss there)."""
        check_namespace(namespace)
        with self._lock:
            known = [self._chunks.owned(namespace, k) is not None for k in keys]
        if self._shared is not None and not all(known):  # maybe published by another daemon
            self._adopt(self._shared.catch_up(namespace))
            with self._lock:
                known = [self._chunks.owned(namespace, k) is not None for k in keys]
        owned = [k for k, ok in zip(keys, known) if ok]
        where = iter(self.store.fastest(owned))
        out = [next(where) if ok else None for ok in known]
        with self._lock:
            self.hits.lookups += 1
        return out

    def load(self, namespace: str, keys: Sequence[bytes]) -> Iterator[tuple[bytes, memoryview | bytes | None]]:
        """Verified chunks in order (None for a miss), pinned while they are read. Only chunks
        ``namespace`` owns are read at all: another namespace's is a miss, exactly like an absent
        one, and nothing but an owned chunk's failing copy is ever deleted."""
        check_namespace(namespace)
        with self._lock:
            infos = [self._chunks.owned(namespace, k) for k in keys]
        if self._shared is not None and None in infos:  # maybe named by a session published elsewhere
            self._adopt(self._shared.catch_up(namespace))
            with self._lock:
                infos = [self._chunks.owned(namespace, k) for k in keys]
        owned = [k for k, info in zip(keys, infos) if info is not None]
        ct = self.config.chunk_tokens
        self.store.pin(owned)
        durable_later: list[tuple[bytes, Stored]] = []  # read from the shared tier: one batch, one fsync
        try:
            # chunks only the shared tier holds are fetched ahead, a pipelined window at a time
            with self._shared.read_ahead(owned, self.store) if self._shared else contextlib.nullcontext():
                for k, info in zip(keys, infos):
                    blob = None if info is None else self.store.get(k, self._matcher(k, info, ct), durable_later)
                    with self._lock:
                        self.hits.loaded_chunks += blob is not None
                        self.hits.missed_chunks += blob is None
                    yield k, blob
            self.store.promote_durably(durable_later)
        finally:
            self.store.unpin(owned)
            with self._lock:
                self.hits.loads += 1

    def chunk_checks(self, namespace: str, session_id: str) -> builtins.list[tuple[bytes, Callable[[Stored], bool]]]:
        """A live session's chunks, each with the verification a load applies to it (prefetch.py)."""
        m = self.get(namespace, session_id)
        with self._lock:
            infos = [self._chunks.owned(namespace, k) for k in m.chunk_keys]
        ct = self.config.chunk_tokens
        return [(k, self._matcher(k, i, ct)) for k, i in zip(m.chunk_keys, infos) if i is not None]

    def _matcher(self, key: bytes, info: ChunkInfo, chunk_tokens: int) -> Callable[[Stored], bool]:
        """The verification a read of ``key`` applies: chunk (key from its token ids) or page blob."""
        if info.page:
            play = self.layouts.page(info.layout_id)
            if play is None:  # a page layout this daemon was never told of: nothing can pass
                return lambda blob: False
            return functools.partial(page_matches, key, info.namespace, play)
        return functools.partial(chunk_matches, key, info, chunk_tokens)

    def evict(self, namespace: str, session_id: str, tier: str) -> int:
        """Move a session's chunks down to ``tier`` (admin: simulate memory pressure); how many moved.

        A chunk already there is left alone and not counted (nor is a missing one): a chunk is there
        when no tier faster than ``tier`` holds it, except the durable tier, which keeps its copy
        when ``tier`` is below it (a shared tier may expire by TTL). Evict only moves down: a session
        with a chunk held only by slower tiers is refused before anything moves (prefetch moves
        chunks up). A chunk that cannot move now (a load has it pinned, ``tier`` has no room) stays
        where it is and is not counted, as under real memory pressure; the same call again moves it."""
        m = self.get(namespace, session_id)
        names = [t.name for t in self.store.tiers]
        if tier not in names:
            raise InvalidArgument(f"unknown tier {tier!r}; this store has {', '.join(names)}")
        to, durable = names.index(tier), self.store.durable
        down: list[bytes] = []
        below: dict[str, int] = defaultdict(int)
        for k in m.chunk_keys:
            held = [names.index(n) for n in self.store.where(k)]
            if not held:
                continue
            if min(held) > to:
                below[names[min(held)]] += 1
            elif max(held) < to or any(i < to and i != durable for i in held):
                down.append(k)
        where = f"{namespace}/{session_id}"
        if below:
            n = sum(below.values())
            raise InvalidArgument(f"evict moves chunks down; use prefetch to move them up ({n} of "
                                  f"{len(m.chunk_keys)} chunks of {where} are below {tier}: "
                                  f"{', '.join(f'{t} {c}' for t, c in below.items())})")
        return sum(self.store.demote(k, to) for k in down)

    def close(self) -> None:
        self.store.close()

    def live_chunks(self) -> dict[bytes, AnyLayout]:
        """Every chunk referenced by a live (unexpired) session, with its layout: the sessions ``list``
        returns, so that chunks and tokens are counted over the same sessions until the next GC."""
        now = self.clock()
        with self._lock:
            return {k: lay for m in self._manifests.values() if not m.expired(now)
                    for lay in (self.layouts.known(m.layout_id),) for k in m.chunk_keys}
