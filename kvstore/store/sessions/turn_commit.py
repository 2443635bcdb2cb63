"""Committing validated turns (``turn.py``), a group at a time (``group_commit.py``): each turn
checked against the index as the group found it, the accepted ones published (``sharing.py``),
then written in one durable transaction with the chunks only the versions they replace used.

A turn's checks, in order: every chunk its manifest names is stored, owned by its namespace and in
its place (``check_chunks``); then its base version is the session's current one (``check_base``):
a request's own errors come before a race's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.format.manifest import Manifest
from kvstore.format.turn_record import TurnRecord, turn_key
from kvstore.results import SaveResult
from kvstore.store.sessions.admission import Admission
from kvstore.store.sessions.chunk_index import ChunkInfo
from kvstore.store.sessions.group_commit import Pending
from kvstore.store.sessions.index import SessionIndex
from kvstore.store.sessions.kind import Positions, SessionKind
from kvstore.store.sessions.sharing import Accepted, SessionRef, Sharing
from kvstore.store.sessions.turn import SavedTurn, Turn
from kvstore.store.sessions.turn_log import whole as whole_log
from kvstore.store.tiered.store import TieredStore
from kvstore.tiers.base import WriteBatch

Chunks = list[tuple[bytes, bytes | memoryview]]


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


def new_chunks(store: TieredStore, keys: Sequence[bytes], blobs: Sequence[bytes | memoryview]) -> Chunks:
    """The chunks of a batch the durable tier does not hold yet, each once."""
    new: dict[bytes, bytes | memoryview] = {}
    for key, blob in zip(keys, blobs):
        if key not in new and not store.holds_durably(key):
            new[key] = blob
    return list(new.items())


class Applied(Exception):
    """The turn is an append this store already applied (``TurnCommit.applied``): ``version`` is what it made."""

    def __init__(self, version: Manifest) -> None:
        super().__init__("applied already")
        self.version = version


class TurnCommit:
    """The ``CommitGroup`` of the session store's turn saves; called with ``index.write_lock`` held.

    A turn is written as a turn record (``kvstore.format.turn_record``: O(what it adds)) when it is an
    append to the version on disk and no compaction is due (``turn_log.py``), else as the whole
    manifest, the session's turn records deleted in the same transaction."""

    def __init__(self, index: SessionIndex, store: TieredStore, sharing: Sharing, write_mode: str,
                 clock: Callable[[], float], compact_keys: int = 256, admission: Admission | None = None) -> None:
        self.admission = admission  # per-namespace quotas: a turn past them fails alone (admission.py)
        self.index = index
        self.store = store
        self.sharing = sharing
        self.write_mode = write_mode
        self.clock = clock  # the store's clock stamps versions: TTLs never trust a caller's times
        self.compact_keys = compact_keys

    def __call__(self, group: list[Pending[Turn, SavedTurn]]) -> list[Pending[Turn, SavedTurn]]:
        """Commit what it can of ``group``; the turns left for the next group (a second turn of one
        session). If the transaction fails, every turn of the group fails with it and the index is
        untouched."""
        accepted: list[Accepted] = []
        later: list[Pending[Turn, SavedTurn]] = []
        refs: set[SessionRef] = set()
        pending_bytes: dict[str, int] = {}  # net new bytes and sessions of the turns accepted so far, by namespace
        pending_sessions: dict[str, int] = {}
        starts: dict[SessionRef, int] = {}  # an append's session: the chunk count of the version it extends
        named = self.admission.named(p.item for p in group) if self.admission is not None else set()
        for p in group:
            t = p.item
            ref = (t.namespace, t.session_id)
            if ref in refs:
                later.append(p)
                continue
            try:
                if t.append is not None:
                    m, start = self.extend(t)
                    check = range(start, len(m.chunk_keys))
                else:
                    m, start = t.manifest, -1  # type: ignore[assignment]
                    self.check_chunks(m, t.kind, skip=t.positions)
                    self.check_base(m)
                    check = range(len(m.chunk_keys))
                new = new_chunks(self.store, t.keys, t.blobs)
                size, begins = 0, False
                if self.admission is not None:  # the quotas, before anything of this turn is written
                    self.store.claim(t.keys, t.namespace)
                    begins = self.admission.check_session(t.namespace, t.session_id,
                                                          pending_sessions.get(t.namespace, 0))
                    size = self.admission.check_bytes(t.namespace, new, pending_bytes.get(t.namespace, 0),
                                                      ref if start < 0 else None, named)  # net of what it frees
                if self.write_mode == "back":
                    batch = set(t.keys)
                    self.store.flush([k for k in (m.chunk_keys[i] for i in check) if k not in batch])
            except Applied as done:  # the retry of an append this store applied: its version, nothing written
                p.succeed((done.version, SaveResult(t.keys, 0)))
                continue
            except Exception as e:  # this turn's own error, raised to its caller
                p.fail(e)
                continue
            pending_bytes[t.namespace] = pending_bytes.get(t.namespace, 0) + size
            pending_sessions[t.namespace] = pending_sessions.get(t.namespace, 0) + begins
            refs.add(ref)
            now = self.clock()
            if start >= 0:  # stamped by ``extend``
                starts[ref] = start
            else:
                old = self.index.get(ref)
                m = replace(m, created_at=old.created_at if old is not None else now, updated_at=now,
                            generation=next_generation(old, now))
            accepted.append((p, m, new))
        # published first: a shared tier's compare-and-set decides races between daemons
        accepted = self.sharing.publish_turns(accepted, self.store, starts)
        refs = {(m.namespace, m.session_id) for _, m, _ in accepted}
        if not accepted:
            return later
        puts = {k: blob for _, _, new in accepted for k, blob in new}
        whole = {ref for ref in refs if ref not in starts}
        # an append frees nothing; the keys it adds are kept from a whole save's frees in the same group
        kept = {k for _, m, _ in accepted for k in m.chunk_keys[starts.get((m.namespace, m.session_id), 0):]}
        doomed = self.index.replaced_only(whole, kept)
        meta_puts, meta_deletes, logs = [], [], {}
        for _, m, _ in accepted:
            ref = (m.namespace, m.session_id)
            log, start = self.index.log(ref), starts.get(ref, -1)
            old = self.index.get(ref)
            if start >= 0 and old is not None and not log.due(len(m.chunk_keys) - start, self.compact_keys):
                rec = TurnRecord(old.generation, m.generation, start, m.chunk_keys[start:], m.token_count, m.tail,
                                 m.last_token_ids, m.updated_at)
                meta_puts.append((turn_key(*ref, log.records), rec.encode()))
                logs[ref] = log.appended(len(m.chunk_keys) - start, old.generation, start)
            else:  # the manifest whole, the session's turn records deleted: one transaction
                meta_puts.append((m.key, m.encode()))
                meta_deletes += log.keys(ref)
                logs[ref] = (whole_log(len(m.chunk_keys), old.generation, start) if start >= 0 and old is not None
                             else whole_log(len(m.chunk_keys)))
        try:
            self.store.commit(WriteBatch(puts=list(puts.items()), deletes=doomed, meta_puts=meta_puts,
                                         meta_deletes=meta_deletes))
        except Exception as e:  # nothing of the group is stored: every turn of it fails
            self.sharing.forget(list(refs))
            for p, _, _ in accepted:
                p.fail(e)
            return later
        with self.index.lock:
            for p, m, _ in accepted:
                t, ref = p.item, (m.namespace, m.session_id)
                t.kind.record(self.index.chunks, t.namespace, t.layout_id, t.keys, t.first_index, t.parent)
                if ref in starts:
                    self.index.append(m, starts[ref])
                else:
                    self.index.replace(m)
                self.index.logs[ref] = logs[ref]
        self.index.forget_chunks(doomed)
        for p, m, new in accepted:
            p.succeed((m, SaveResult(p.item.keys, len(new))))
        return later

    def extend(self, t: Turn) -> tuple[Manifest, int]:
        """An append's new version (stamped) and the chunk count of the version it extends: its base
        checked (``check_base``'s error), then the keys it adds (``check_added``), O(what it adds)."""
        a = t.append
        assert a is not None
        ref = (t.namespace, a.session_id)
        old = self.index.get(ref)
        if old is None or old.generation != a.base:
            self.index.adopt(self.sharing.catch_up_session(ref), self.sharing.advance)
            old = self.index.get(ref)
        if old is not None and old.generation != a.base and self.applied(old, t):
            raise Applied(old)
        if old is None or old.generation != a.base:
            where = f"it is at version {old.generation}" if old is not None else "it does not exist (deleted since?)"
            raise FailedPrecondition(f"session {a.session_id!r} in namespace {t.namespace!r} was changed through "
                                     f"another client: this turn extends version {a.base}, {where}. This change was "
                                     f"not applied; load the session again and retry")
        if old.layout_id != t.layout_id:
            raise InvalidArgument(f"session {a.session_id!r} holds layout {old.layout_id.hex()}; this turn is of "
                                  f"{t.layout_id.hex()}: save it whole to replace the session")
        start, now = len(old.chunk_keys), self.clock()
        m = old.extended(a.chunk_keys, a.token_count, a.tail, a.last_token_ids, next_generation(old, now), now)
        t.kind.check_manifest(m)
        at = t.kind.positions_added(m, start, t.first_index, t.parent, t.keys)
        self.check_added(m, t.kind, start, at)
        return m, start

    def applied(self, current: Manifest, t: Turn) -> bool:
        """Whether ``current``, the session's version, is what append ``t`` makes of its base: an append
        retried because its answer was lost (the daemon applied it, then the connection or the daemon
        went). Then the retry is answered that version, as a whole save that stores the current version
        goes through (``check_base``)."""
        a = t.append
        assert a is not None
        log = self.index.log((current.namespace, current.session_id))
        if log.last_base != a.base or log.last_first < 0:
            return False
        same = (current.layout_id, current.chunk_keys[log.last_first :], current.token_count, current.tail,
                current.last_token_ids) == (t.layout_id, a.chunk_keys, a.token_count, a.tail, a.last_token_ids)
        return same and all(self.store.holds_durably_many(list(t.keys)))

    def check_added(self, m: Manifest, kind: SessionKind, start: int, skip: Positions) -> None:
        """``check_chunks`` of the keys an append adds (chunks ``start``...), the others checked when
        their versions were committed."""
        added = m.chunk_keys[start:]
        infos = self.index.owned(m.namespace, added)
        held = self.store.holds_durably_many(added)
        absent = [start + j for j, (info, h) in enumerate(zip(infos, held))
                  if start + j not in skip and (info is None or not h)]
        if absent:
            unowned = {i for i in absent if infos[i - start] is None}
            shared = self.sharing.held([m.chunk_keys[i] for i in absent if i not in unowned])
            absent = [i for i in absent if m.chunk_keys[i] not in shared]
        if absent:
            raise FailedPrecondition(f"{len(absent)} referenced chunks are not stored in namespace "
                                     f"{m.namespace!r} (first: {m.chunk_keys[absent[0]].hex()}); save them before "
                                     f"committing")
        _check_places(m, kind, start, infos, skip)

    def check_base(self, m: Manifest) -> None:
        """A save based on version ``m.generation`` (0: no base, the save replaces whatever is stored)
        replaces only that version: FailedPrecondition, the stored version kept, if the session was
        changed since (saved through another client, touched, deleted). A save that stores exactly the
        current version (the retry of a save that was applied but whose answer was lost) is no change
        and goes through. A base newer than this daemon's version (loaded through another daemon)
        catches up first."""
        if m.generation == 0:
            return
        ref = (m.namespace, m.session_id)
        old = self.index.get(ref)
        if old is None or old.generation != m.generation:
            self.index.adopt(self.sharing.catch_up_session(ref), self.sharing.advance)
            old = self.index.get(ref)
        if old is not None and (old.generation == m.generation or same_content(old, m)):
            return
        now = f"it is at version {old.generation}" if old is not None else "it was deleted since"
        raise FailedPrecondition(f"session {m.session_id!r} in namespace {m.namespace!r} was changed through another "
                                 f"client: this save was based on version {m.generation}, {now}. This change was "
                                 f"not applied; load the session again and retry")

    def check_chunks(self, m: Manifest, kind: SessionKind, skip: Positions = range(0)) -> None:
        """Every chunk ``m`` names is stored, owned by its namespace, and in its place (as its
        ``kind`` places them); except the positions in ``skip``, whose chunks this save brings
        (validated against their keys)."""
        # Chunks in the places the session's current version has them passed the checks below when
        # it was committed (a chunk's owner and place never change while a version names it): a turn
        # checks what it adds. Whether they are still stored is asked of every one.
        same = self.index.unchanged_prefix(m)
        infos = self.index.owned(m.namespace, m.chunk_keys[same:])  # of chunk same + j
        unowned = {same + j for j, info in enumerate(infos) if info is None}
        held = self.store.holds_durably_many(m.chunk_keys)
        # Another namespace's chunk and an absent one are one case, answered with one message:
        # a commit must not tell a tenant what another one holds.
        absent = [i for i, h in enumerate(held) if i not in skip and (i in unowned or not h)]
        if absent:  # a chunk published to a shared tier is stored
            shared = self.sharing.held([m.chunk_keys[i] for i in absent if i not in unowned])
            absent = [i for i in absent if m.chunk_keys[i] not in shared]
        missing = [m.chunk_keys[i].hex() for i in absent]
        if missing:
            raise FailedPrecondition(f"{len(missing)} referenced chunks are not stored in namespace "
                                     f"{m.namespace!r} (first: {missing[0]}); save them before committing")
        _check_places(m, kind, same, infos, skip)


def _check_places(m: Manifest, kind: SessionKind, first: int, infos: Sequence[ChunkInfo | None],
                  skip: Positions) -> None:
    """Each chunk ``first + j`` of ``m`` (owner ``infos[j]``, known to be owned) saved under ``m``'s layout
    and in its place as its ``kind`` places chunks; the positions in ``skip`` (this save's own) aside."""
    for j, info in enumerate(infos):
        i = first + j
        if i in skip:
            continue
        assert info is not None
        if info.layout_id != m.layout_id:
            raise InvalidArgument(f"chunk {i} ({m.chunk_keys[i].hex()}) was saved under layout "
                                  f"{info.layout_id.hex()}, the manifest's is {m.layout_id.hex()}")
        kind.check_place(m, i, info)
