"""Sessions, first-class: save chunks, commit manifests, look up prefixes, delete safely.

Invariants:
- a manifest is written in the same transaction as the new chunks it references (``save_session``)
  or after they are durable (``save_chunks`` then ``commit``), so a manifest never references a
  missing chunk and a crashed save leaves the previous version or the new one, complete;
- every call is one durable transaction (docs/FORMAT.md, "Transactions"); concurrent turn saves
  share one (group commit: ``group_commit.py``);
- chunks are content-addressed and shared by every session of a namespace with the same prefix;
  which sessions reference a chunk is derived from the manifests (``store/sessions/index.py``, rebuilt at
  open), so deleting one session never breaks another, and there is no refcount to drift;
- tiers slower than the durable tier may be shared by several daemons (Redis): this store never
  garbage-collects them; their copies expire by TTL. Whether sessions are shared with other
  daemons is the sharing layer's business (``sharing.py``), chosen once when the store is built:
  this class calls it the same way either way.

The parts: this class validates requests and owns the session lifecycle (save, get, list, touch,
delete, expire, GC); ``turn_commit.py`` commits turns; ``store/sessions/reads.py`` serves lookups and
loads; ``store/sessions/index.py`` is the in-memory index and its locks.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TypeVar

from kvstore.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from kvstore.format.keys import ROOT
from kvstore.format.manifest import (
    KEY_PREFIX,
    Manifest,
    ManifestError,
    Retention,
    check_namespace,
    check_retention,
    check_session_id,
    manifest_key,
)
from kvstore.format.turn_record import PREFIX as TURN_PREFIX
from kvstore.format.turn_record import TurnRecord
from kvstore.format.turn_record import apply as apply_turns
from kvstore.format.turn_record import parse_key as parse_turn_key
from kvstore.results import LookupResult, SaveResult
from kvstore.store.config import StoreConfig
from kvstore.store.sessions.admission import Admission
from kvstore.store.sessions.counters import DamageCounters, HitCounters
from kvstore.store.sessions.engine_pages import EnginePages
from kvstore.store.sessions.group_commit import GroupCommit
from kvstore.store.sessions.index import SessionIndex
from kvstore.store.sessions.kind import Kinds
from kvstore.store.sessions.layouts import Layouts
from kvstore.store.sessions.reads import SessionReads
from kvstore.store.sessions.sharing import NoSharing, SessionRef, Sharing
from kvstore.store.sessions.token_chain import TokenChain
from kvstore.store.sessions.turn import Append, SavedTurn, Turn
from kvstore.store.sessions.turn_commit import TurnCommit, new_chunks, next_generation
from kvstore.store.sessions.turn_log import TurnLog
from kvstore.store.sessions.turn_log import whole as whole_log
from kvstore.store.tiered.reads import Verify
from kvstore.store.tiered.store import TieredStore
from kvstore.tiers.base import Stored, WriteBatch

__all__ = ["SessionRef", "SessionStore"]
log = logging.getLogger(__name__)
_T = TypeVar("_T")


class SessionStore:
    def __init__(self, store: TieredStore, config: StoreConfig, sharing: Sharing | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self.hits = HitCounters()
        self.damage = DamageCounters()
        #: Shares sessions with other daemons, or not (``sharing.py``): chosen by whoever builds the store.
        self._sharing = sharing if sharing is not None else NoSharing()
        #: Token layouts (presets) and the engine page layouts clients registered.
        self.layouts = Layouts(store, config.max_layouts_per_namespace)
        #: Token chains and engine pages, one object each: a session's kind, chosen from its layout.
        self.kinds = Kinds(self.layouts, TokenChain(config.chunk_tokens), EnginePages(self.layouts))
        self._index = SessionIndex(store.pin, store.unpin, self.kinds, store.claim)
        #: Per-namespace quotas at the door of every save, and what each namespace holds (stats).
        self.admission = Admission(config.quotas, store, self._index, lambda: self.clock())
        #: Concurrent turn saves share one durable transaction (one fsync) per group; the clock is
        #: read through this store (tests set ``clock``).
        commit = TurnCommit(self._index, store, self._sharing, config.write_mode, lambda: self.clock(),
                            config.compact_turn_keys, self.admission)
        self._turns: GroupCommit[Turn, SavedTurn] = GroupCommit(self._index.write_lock, commit)
        self._reads = SessionReads(self._index, store, self._sharing, self.layouts, config.chunk_tokens, self.hits)
        self._load_manifests()

    @property
    def reads_remote(self) -> bool:
        """Whether reading a manifest may take a network round trip (a shared tier catches up first)."""
        return self._sharing.reads_remote

    def sharing_tiers(self) -> tuple[str, ...]:
        """The tiers sessions are shared through: every save needs them, as it needs the durable tier."""
        return self._sharing.tiers

    # -- startup --------------------------------------------------------------------------------
    def _load_manifests(self) -> None:
        """Index every session: its manifest and the turn records appended to it since it was last
        written whole (``kvstore.format.turn_record``), in key order, each while it extends the version
        read so far; a record that does not is damage (counted, and the next save writes it whole)."""
        records: dict[SessionRef, list[tuple[int, bytes]]] = {}
        for key in list(self.store.meta_keys(TURN_PREFIX)):
            parsed = parse_turn_key(key)
            if parsed is None:
                log.error("meta key %r is no turn record's: ignored", key)
                continue
            records.setdefault((parsed[0], parsed[1]), []).append((parsed[2], key))
        for key in list(self.store.meta_keys(KEY_PREFIX)):
            blob = self.store.get_meta(key)
            try:
                m = Manifest.decode(blob) if blob is not None else None
            except (ManifestError, ValueError) as e:
                log.error("manifest %r is damaged (%s): ignored", key, e)
                self.damage.manifests += 1
                continue
            if m is not None:
                ref = (m.namespace, m.session_id)
                m = self._with_turns(m, sorted(records.pop(ref, [])))
                self._index.add(m)
        for ref, found in records.items():  # records of no manifest: deleted by the session's next save
            self._index.logs[ref] = TurnLog(records=max(seq for seq, _ in found) + 1, chains=False)

    def _with_turns(self, m: Manifest, found: list[tuple[int, bytes]]) -> Manifest:
        """``m`` with the turn records ``found`` (seq, key) applied; its turn log noted in the index."""
        ref = (m.namespace, m.session_id)
        recs: list[TurnRecord] = []
        for _, key in found:
            blob = self.store.get_meta(key)
            try:
                recs.append(TurnRecord.decode(blob if blob is not None else b""))
            except (ManifestError, ValueError) as e:
                log.error("turn record %r is damaged (%s)", key, e)
                break
        try:
            out, applied = apply_turns(m, recs)
        except ManifestError as e:
            log.error("the turn records of session %s/%s break its manifest's rules (%s)", *ref, e)
            out, applied = m, 0
        if applied < len(found):  # the session is read as the version its turns extend cleanly
            log.error("session %s/%s: %d of its %d turn records extend its version, the rest are ignored",
                      *ref, applied, len(found))
            self.damage.manifests += 1
        records = max((seq for seq, _ in found), default=-1) + 1
        last = recs[applied - 1] if applied else None  # what made the version read: an append's retry is known
        self._index.logs[ref] = TurnLog(records, len(m.chunk_keys), len(out.chunk_keys) - len(m.chunk_keys),
                                        chains=applied == len(found) and [s for s, _ in found] == list(range(records)),
                                        last_base=last.base if last else 0, last_first=last.first_chunk if last else -1)
        return out

    def collect_garbage(self) -> int:
        """Delete chunks (on the durable tier and faster ones) that no manifest references, e.g.
        the chunks of a save that crashed before its commit. Returns how many were deleted."""
        with self._index.write_lock:
            orphans = self._index.unreferenced(self.store.chunk_keys(local_only=True))
            self.store.delete_many(orphans, local_only=True)
            self._index.forget_chunks(orphans)
            return len(orphans)

    def check_references(self) -> int:
        """Count (and log) chunks that live sessions reference but the durable tier lacks, e.g.
        after damage to its file: found at open rather than by a client's load."""
        with self._index.lock:
            # a chunk demoted below the durable tier (admin evict to redis) is not missing
            missing = [k for k in self._index.referenced() if not self.store.holds_durably(k)
                       and not self.store.contains(k)]
            self.damage.missing_chunks = len(missing)
        if missing:
            log.error("%d chunks referenced by sessions are missing from the durable tier (first: %s)",
                      len(missing), missing[0].hex())
        return len(missing)

    # -- saving ---------------------------------------------------------------------------------
    def save_chunks(self, namespace: str, layout_id: bytes, parent: bytes, first_index: int,
                    blobs: Sequence[bytes | memoryview], sealed: int = 0) -> SaveResult:
        """Validate and store consecutive complete chunks of one sequence, starting at chunk
        ``first_index`` whose parent key is ``parent``. Chunks the store already holds are not
        written again. Returns their keys. ``sealed``: the first blobs this daemon built and sealed
        itself (``SessionKind.batch_keys``)."""
        check_namespace(namespace)
        kind = self.kinds.for_layout(namespace, layout_id)
        keys = kind.batch_keys(namespace, layout_id, parent, first_index, blobs, sealed)
        # everything was validated first: bad input changes nothing stored; a failed write leaves
        # nothing behind either (put_many is all or nothing), and the index learns only of success
        self.store.claim(keys, namespace)
        new = new_chunks(self.store, keys, blobs)
        self.admission.check_bytes(namespace, new)
        self.store.put_many(new)
        with self._index.lock:
            kind.record(self._index.chunks, namespace, layout_id, keys, first_index, parent)
        return SaveResult(keys, len(new))

    def commit(self, m: Manifest) -> Manifest:
        """Atomically publish a session version. Every chunk it names must already be stored."""
        return self.save_session(m.namespace, m.layout_id, ROOT, 0, (), m)[0]

    def save_session(self, namespace: str, layout_id: bytes, parent: bytes, first_index: int,
                     blobs: Sequence[bytes | memoryview], manifest: Manifest, sealed: int = 0
                     ) -> tuple[Manifest, SaveResult]:
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
        kind = self.kinds.for_layout(namespace, layout_id)
        kind.check_manifest(manifest)
        keys = kind.batch_keys(namespace, layout_id, parent, first_index, blobs, sealed) if blobs else []
        at = kind.positions(manifest, first_index, keys)
        return self._turns.submit(Turn(namespace, layout_id, parent, first_index, keys, blobs, manifest, kind, at))

    def append_session(self, namespace: str, layout_id: bytes, parent: bytes, first_index: int,
                       blobs: Sequence[bytes | memoryview], append: Append, sealed: int = 0
                       ) -> tuple[Manifest, SaveResult]:
        """Save a turn named by what it adds (``Append``): store ``blobs`` as ``save_session`` does and
        append the keys, trailing span and last ids to the session's version ``append.base``, in one
        durable transaction, in O(the turn): its record on disk is what it adds (a turn record), its
        checks and the index's update are of the keys it adds. FailedPrecondition, nothing stored,
        unless ``append.base`` is the session's current version (or the version is the one this very
        append made: its retry, the answer lost, is answered that version and writes nothing); the keys it
        adds are checked as a
        commit's (stored in the namespace, or brought by ``blobs``; in place). Returns the new version
        and the chunks' keys with how many were new."""
        check_namespace(namespace)
        check_session_id(append.session_id)
        if (append.namespace, append.layout_id) != (namespace, layout_id):
            raise InvalidArgument("the append must name the save's namespace and layout")
        if append.base <= 0:
            raise InvalidArgument("an append names the version it extends (base > 0); a session is created by a "
                                  "whole save")
        kind = self.kinds.for_layout(namespace, layout_id)
        keys = kind.batch_keys(namespace, layout_id, parent, first_index, blobs, sealed) if blobs else []
        return self._turns.submit(Turn(namespace, layout_id, parent, first_index, keys, blobs, None, kind, range(0),
                                       append))

    # -- sessions -------------------------------------------------------------------------------
    def _catch_up(self, namespace: str | None) -> None:
        self._index.adopt(self._sharing.catch_up(namespace), self._sharing.advance)

    def get(self, namespace: str, session_id: str) -> Manifest:
        ref = (check_namespace(namespace), check_session_id(session_id))
        self._index.adopt(self._sharing.catch_up_session(ref), self._sharing.advance)
        m = self._index.get(ref)
        if m is None or m.expired(self.clock()):
            raise NotFound(f"no session {session_id!r} in namespace {namespace!r}")
        return m

    def list_sessions(self, namespace: str | None = None) -> list[Manifest]:
        """The live sessions (of ``namespace``; None: of every namespace), by namespace and id."""
        self._catch_up(namespace)
        return self._index.live(self.clock(), namespace)

    def delete(self, namespace: str, session_id: str) -> int:
        """Delete a session; returns how many chunks were freed (those no other session uses)."""
        with self._index.write_lock:
            m = self.get(namespace, session_id)
            ref = (m.namespace, m.session_id)
            self._sharing.publish(m, deleted=True)
            freed = self._index.replaced_only({ref}, set())
            # the manifest, its turn records and the chunks only it used: one transaction (one fsync)
            self.store.commit(WriteBatch(deletes=freed, meta_deletes=[m.key, *self._index.log(ref).keys(ref)]))
            self._index.remove(ref)
            self._index.logs.pop(ref, None)
            self._index.forget_chunks(freed)
        return len(freed)

    def touch(self, namespace: str, session_id: str, retention: Retention) -> Manifest:
        check_retention(retention)
        with self._index.write_lock:  # the version read here is the one replaced: no save slips in between
            old, now = self.get(namespace, session_id), self.clock()
            m = replace(old.with_retention(retention, now), generation=next_generation(old, now))
            self._sharing.publish(m)
            ref = (m.namespace, m.session_id)  # written whole, its turn records deleted: one transaction
            self.store.commit(WriteBatch(meta_puts=[(m.key, m.encode())], meta_deletes=self._index.log(ref).keys(ref)))
            self._index.replace(m)
            self._index.logs[ref] = whole_log(len(m.chunk_keys))
        return m

    def expire(self) -> int:
        """Delete every session whose TTL has passed; returns how many."""
        now = self.clock()
        with self._index.write_lock:
            with self._index.lock:
                gone = self._index.expired(now)
                freed = []
                for ref in gone:
                    freed.extend(self._index.remove(ref))
            # every expired manifest and the chunks only they used: one transaction
            try:
                self.store.commit(WriteBatch(deletes=freed, meta_deletes=[
                    k for ref in gone for k in (manifest_key(*ref), *self._index.log(ref).keys(ref))]))
                for ref in gone:
                    self._index.logs.pop(ref, None)
            except (Unavailable, ResourceExhausted) as e:  # the index forgot them: the next open retries
                log.error("could not delete %d expired sessions from the durable tier: %s", len(gone), e)
            self._index.forget_chunks(freed)
        self._sharing.expired(gone)
        return len(gone)

    def pinned_keys(self) -> set[bytes]:
        return self._index.pinned_keys()

    # -- reading (store/sessions/reads.py) -------------------------------------------------------------
    def lookup(self, namespace: str, layout_id: bytes, token_ids: Sequence[int]) -> LookupResult:
        """Longest cached prefix of ``token_ids`` (whole chunks), and which tiers hold it."""
        return self._reads.lookup(namespace, layout_id, token_ids)

    def lookup_keys(self, namespace: str, keys: Sequence[bytes]) -> list[str | None]:
        """For each key, the fastest tier holding a copy validated for ``namespace``, or None."""
        return self._reads.lookup_keys(namespace, keys)

    def held_in_memory(self, namespace: str, keys: Sequence[bytes], max_bytes: int) -> bool:
        """Whether ``namespace`` owns all of ``keys`` and the memory tier holds them within ``max_bytes``
        (``SessionReads.held_in_memory``: ownership first)."""
        return self._reads.held_in_memory(namespace, keys, max_bytes)

    def read(self, namespace: str, keys: Sequence[bytes]) -> contextlib.AbstractContextManager[list[Stored | None]]:
        """Verified chunks (None for a miss) of those ``namespace`` owns, as one batch, pinned while
        read, valid inside the ``with`` block (``SessionReads.read``): every load is this read."""
        return self._reads.read(namespace, keys)

    def windows(self, namespace: str, keys: Sequence[bytes], use: Callable[[int, list[Stored | None]], list[_T]]
                ) -> Iterator[_T]:
        """``read`` in windows of a few MB, none held open while its answer is yielded
        (``SessionReads.windows``): for a stream a remote caller drains."""
        return self._reads.windows(namespace, keys, use)

    def session_chunks(self, namespace: str, session_id: str) -> list[bytes]:
        """A live session's chunks that ``namespace`` owns: what a load of it reads (prefetch.py)."""
        m = self.get(namespace, session_id)
        return self._reads.owned(namespace, m.chunk_keys)

    def verifier(self, namespace: str, keys: Sequence[bytes]) -> Verify:
        """The verification a load of ``keys`` applies, for a batch read of them outside a load (prefetch.py)."""
        return self._reads.verifier(namespace, keys)

    def evict(self, namespace: str, session_id: str, tier: str) -> int:
        """Move a session's chunks down to ``tier`` (admin: simulate memory pressure); how many moved
        (``TieredStore.evict``)."""
        m = self.get(namespace, session_id)
        return self.store.evict(m.chunk_keys, tier, f"{namespace}/{session_id}")

    def close(self) -> None:
        self.store.close()

    def live_chunks(self) -> dict[bytes, bytes]:
        """Every chunk referenced by a live (unexpired) session, with its layout id: the sessions
        ``list_sessions`` returns, so that chunks and tokens are counted over the same sessions until
        the next GC."""
        return self._index.live_chunks(self.clock())
