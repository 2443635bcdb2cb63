"""Sessions shared by several daemons through a Redis tier configured with ``share_sessions``.

Each daemon keeps its own durable tier (LMDB) and index; the shared tier holds, for every session
saved through any daemon, the chunks its versions name and its latest version, as a base manifest
plus the turns appended since, with a generation (``tiers/redis/sessions.py``). The rules:

- a save is published before the daemon commits it locally and before it is acknowledged: its
  chunks first, then its version by a compare-and-set on the generation this daemon last saw. Two
  daemons saving one session at once both expect the same generation; Redis runs one script at a
  time on the session's slot, so exactly one wins and the other's save fails whole
  (FAILED_PRECONDITION): never a version that mixes both;
- a turn appended to the version this daemon knows is published as what it adds: its new chunks
  only (those of earlier versions were published with them) and its turn record appended to the
  session's list, O(the turn); a whole save, a touch, a delete, or a turn that extends a version
  this daemon does not hold as published is written whole (its chunks the shared tier lacks
  included), as is a turn once the list holds as many bytes as the base (a compaction);
- a daemon catches up before it answers from its index: ``get`` reads the session's record,
  ``list`` and ``lookup`` the tenant's change counter (and, when it moved, the generations). A
  daemon that holds version g reads the turns after g only and applies them to what it holds
  (``turn_record.apply``); one that holds nothing, or whose g is no longer in the list (a
  compaction since), reads the base and every turn. A newer version is indexed as it is (in
  memory: the local durable tier keeps what was saved here), its chunks owned by its namespace, so
  loads read them from the shared tier and verify each against its key exactly as any other tier's;
- if the shared tier cannot be read, a daemon answers from what it knows (logged), and does not
  try to catch up again for ``RETRY_S`` (a hung Redis costs one timeout per second, not one per
  read); if it cannot be written, the save fails (UNAVAILABLE): an acknowledged save is always
  published.

Chunks in the shared tier are never deleted by a daemon (another may use them): they expire by
the tier's TTL, if any, or by Redis's maxmemory policy. A turn does not publish again a chunk of
an earlier version that expired (a whole save does).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from kvstore.errors import FailedPrecondition, KvstoreError, Unavailable
from kvstore.format.manifest import Manifest, ManifestError
from kvstore.format.turn_record import TurnRecord, apply
from kvstore.store.sessions.sharing import Accepted, SessionRef, Sharing, Update
from kvstore.tiers.base import TierError
from kvstore.tiers.redis.sessions import Appended

if TYPE_CHECKING:
    from kvstore.store.sessions.turn import Turn
    from kvstore.store.tiered.store import TieredStore
    from kvstore.tiers.redis.sessions import Record
    from kvstore.tiers.redis.tier import RedisTier

log = logging.getLogger(__name__)
RETRY_S = 1.0  # after a failed catch-up, answer from the local index this long before trying again


class Known(NamedTuple):
    """The shared version this daemon indexes: its generation, and its manifest (None: deleted, or
    not known here: then the next catch-up reads the session whole)."""

    generation: int = 0
    manifest: Manifest | None = None


class SharedSessions(Sharing):
    """This daemon's side of the shared session records: publishing, catching up, generations."""

    reads_remote = True

    def __init__(self, tier: RedisTier, chunk_tokens: int) -> None:
        self.tier = tier
        self.tiers = (tier.name,)
        self.chunk_tokens = chunk_tokens
        self.records = tier.sessions()
        self._lock = threading.Lock()
        self._known: dict[SessionRef, Known] = {}  # the version this daemon indexes
        self._fetched: dict[tuple[SessionRef, int], Manifest | None] = {}  # versions read, until ``advance``
        self._changes: dict[str, int] = {}  # tenant -> change counter last caught up with
        self._quiet_until = 0.0  # monotonic time before which catching up is not tried

    # -- generations ----------------------------------------------------------------------------
    def known(self, ref: SessionRef) -> Known:
        with self._lock:
            return self._known.get(ref) or Known()

    def generation(self, ref: SessionRef) -> int:
        return self.known(ref).generation

    def advance(self, ref: SessionRef, gen: int) -> bool:
        """Record that this daemon indexes version ``gen``; False if it already has it or a newer one."""
        with self._lock:
            m = self._fetched.pop((ref, gen), None)
            if gen <= (self._known.get(ref) or Known()).generation:
                return False
            self._known[ref] = Known(gen, m)
            return True

    def _published(self, ref: SessionRef, gen: int, m: Manifest | None) -> None:
        with self._lock:
            if gen > (self._known.get(ref) or Known()).generation:
                self._known[ref] = Known(gen, m)

    def forget(self, refs: Sequence[SessionRef]) -> None:
        """This daemon's index does not hold what it published for ``refs`` (its local commit
        failed): the next read catches up with the shared version."""
        with self._lock:
            for ref in refs:
                self._known.pop(ref, None)

    def expired(self, refs: Sequence[SessionRef]) -> None:
        """Sessions the index dropped when their TTL passed: their generation is kept (so a catch-up does
        not index them again), their manifests let go (a turn on one is then published whole)."""
        with self._lock:
            for ref in refs:
                known = self._known.get(ref)
                if known is not None and known.manifest is not None:
                    self._known[ref] = Known(known.generation)

    # -- publishing -----------------------------------------------------------------------------
    def publish_turns(self, accepted: list[Accepted], store: TieredStore,
                      starts: Mapping[SessionRef, int]) -> list[Accepted]:
        """Publish each accepted turn (pending call, manifest, new chunks; ``starts``: an append's chunk
        count of the version it extends): its chunks, then its version; fail the ones that cannot be,
        and return the others, to commit locally."""
        out = []
        for item in accepted:
            pending, m, _ = item
            try:
                self._publish_turn(pending.item, m, starts.get((m.namespace, m.session_id)), store)
            except KvstoreError as e:
                pending.fail(e)
                continue
            out.append(item)
        return out

    def _publish_turn(self, turn: Turn, m: Manifest, start: int | None, store: TieredStore) -> None:
        """One turn: appended (O(what it adds)) when it extends the version this daemon knows as
        published, else (or when Redis says so) written whole."""
        ref = (m.namespace, m.session_id)
        batch = dict(zip(turn.keys, turn.blobs))
        known = self.known(ref)
        prev, append = known.manifest, turn.append
        if start is not None and append is not None and prev is not None and \
                (prev.generation, len(prev.chunk_keys)) == (append.base, start):
            added = m.chunk_keys[start:]
            self._put_chunks(m, added, batch, store)  # the chunks of earlier versions were published with them
            rec = TurnRecord(append.base, m.generation, start, added, m.token_count, m.tail, m.last_token_ids,
                             m.updated_at)
            if self._append(m, known.generation, rec.encode()):
                return
        else:  # every chunk it names that the shared tier lacks, as a whole save always did
            self._put_chunks(m, m.chunk_keys, batch, store)
        self.publish(m)

    def _append(self, m: Manifest, expected: int, record: bytes) -> bool:
        """Compare-and-set a turn record as the session's next version; False: publish it whole instead."""
        ref = (m.namespace, m.session_id)
        try:
            done, gen = self.records.append(m.namespace, m.session_id, expected, record)
        except TierError as e:
            raise Unavailable(f"shared tier: the session was not published, nothing was acknowledged: {e}") from e
        if done is Appended.CONFLICT:
            self._conflict(m, expected, gen)
        if done is Appended.WHOLE:
            return False
        self._published(ref, gen, m)
        return True

    def publish(self, m: Manifest, deleted: bool = False) -> None:
        """Compare-and-set the session's shared version, written whole (``deleted``: delete it)."""
        ref = (m.namespace, m.session_id)
        expected = self.generation(ref)
        try:
            ok, gen = self.records.publish(m.namespace, m.session_id, expected, None if deleted else m.encode())
        except TierError as e:
            raise Unavailable(f"shared tier: the session was not published, nothing was acknowledged: {e}") from e
        if not ok:
            self._conflict(m, expected, gen)
        self._published(ref, gen, None if deleted else m)

    def _conflict(self, m: Manifest, expected: int, gen: int) -> None:
        """Another writer's version ``gen`` is there, not ``expected``: FailedPrecondition."""
        ref = (m.namespace, m.session_id)
        if gen < expected:  # the shared tier lost versions (a failover without WAIT, a flush)
            log.warning("shared tier has generation %d of session %s/%s, this daemon had %d: it lost "
                        "versions; the next save replaces them", gen, *ref, expected)
            with self._lock:
                self._known[ref] = Known(gen, None)
        raise FailedPrecondition(
            f"session {m.session_id!r} in namespace {m.namespace!r} was changed through another daemon "
            f"(shared version {gen}, this daemon's was {expected}): this change was not applied; "
            f"load the session again and retry")

    def _put_chunks(self, m: Manifest, keys: Sequence[bytes], batch: dict[bytes, Any], store: TieredStore) -> None:
        """Put the turn's chunks, and any other of ``keys`` (chunks ``m`` names) the shared tier lacks."""
        others = [k for k in dict.fromkeys(keys) if k not in batch]
        try:
            held = self.tier.contains_many(others) if others else []
            items = list(batch.items())
            lacking = [k for k, h in zip(others, held) if not h]
            for k, blob in zip(lacking, store.copies(lacking)):
                if blob is None:
                    raise Unavailable(f"chunk {k.hex()} of session {m.session_id!r} cannot be read to publish it")
                items.append((k, blob))
            self.tier.put_many(items)
        except TierError as e:
            raise Unavailable(f"shared tier: the session's chunks were not published: {e}") from e

    def held(self, keys: Sequence[bytes]) -> set[bytes]:
        """Which of ``keys`` the shared tier holds (none if it cannot be read)."""
        if not keys:
            return set()
        try:
            return {k for k, h in zip(keys, self.tier.contains_many(keys)) if h}
        except TierError as e:
            log.warning("shared tier unreadable, chunks only there count as missing: %s", e)
            return set()

    def read_ahead(self, keys: Sequence[bytes], store: TieredStore) -> contextlib.AbstractContextManager[None]:
        """For a load: fetch ahead the chunks of ``keys`` this daemon's own tiers do not hold."""
        return self.tier.read_ahead([k for k in keys if not store.holds_durably(k)])

    # -- catching up ----------------------------------------------------------------------------
    def _unreadable(self, e: TierError) -> None:
        log.warning("shared tier unreadable, answering from this daemon's index for %.0f s: %s", RETRY_S, e)
        self._quiet_until = time.monotonic() + RETRY_S

    def catch_up_session(self, ref: SessionRef) -> list[Update]:
        """The session's shared version, if newer than the one this daemon indexes."""
        if time.monotonic() < self._quiet_until:
            return []
        known = self.known(ref)
        try:
            rec = self.records.fetch(*ref, known.generation, _held(known))
            return self._updates(ref[0], [ref[1]], [rec], [known])
        except TierError as e:
            self._unreadable(e)
            return []

    def catch_up(self, namespace: str | None) -> list[Update]:
        """Every shared version of ``namespace`` (None: of every tenant) newer than this daemon's."""
        out: list[Update] = []
        if time.monotonic() < self._quiet_until:
            return out
        try:
            for tenant in [namespace] if namespace is not None else self.records.tenants():
                changes = self.records.changes(tenant)
                with self._lock:
                    if self._changes.get(tenant) == changes:
                        continue
                changes, gens = self.records.generations(tenant)
                newer = [sid for sid, g in gens.items() if g > self.generation((tenant, sid))]
                knowns = [self.known((tenant, sid)) for sid in newer]
                recs = self.records.fetch_many(tenant, [(s, k.generation, _held(k)) for s, k in zip(newer, knowns)])
                out += self._updates(tenant, newer, recs, knowns)
                with self._lock:
                    self._changes[tenant] = changes
        except TierError as e:
            self._unreadable(e)
        return out

    def _updates(self, tenant: str, sids: list[str], records: Sequence[Record | None],
                 knowns: Sequence[Known]) -> list[Update]:
        """The versions ``records`` hold, those newer than ``knowns`` and not damaged. A record of the
        turns after the version this daemon holds that do not extend it is read again whole."""
        out: list[Update] = []
        for sid, rec, known in zip(sids, records, knowns):
            ref = (tenant, sid)
            if rec is None or rec.generation <= known.generation:
                continue
            ok, m = self._version(ref, rec, known.manifest)
            if not ok and not rec.whole:
                log.warning("shared turns of %s/%s after generation %d do not extend this daemon's version: "
                            "reading it whole", tenant, sid, rec.after)
                rec = self.records.fetch(tenant, sid)
                if rec is None or rec.generation <= known.generation:
                    continue
                ok, m = self._version(ref, rec, None)
            if not ok:
                continue
            with self._lock:
                self._fetched[(ref, rec.generation)] = m
            out.append((ref, rec.generation, m))
        return out

    def _version(self, ref: SessionRef, rec: Record, held: Manifest | None) -> tuple[bool, Manifest | None]:
        """(True, the version ``rec`` makes: None if deleted), or (False, None) if it is damaged (logged
        when read whole) or (read as turns) its turns do not extend ``held``."""
        if rec.whole:
            if rec.after == 0 or (rec.manifest is None and rec.turns):
                log.error("shared record of %s/%s (generation %d) has no base, or turns after a delete: ignored",
                          *ref, rec.generation)
                return False, None
            if rec.manifest is None:
                return True, None
            m = self._base(ref, rec.generation, rec.manifest)
        else:
            m = held
        if m is None:
            return False, None
        gens = [t.generation for t in rec.turns]
        if gens != list(range(rec.after + 1, rec.generation + 1)):
            if rec.whole:
                log.error("shared turns of %s/%s are not generations %d..%d: ignored", *ref, rec.after + 1,
                          rec.generation)
            return False, None
        try:
            turns = [TurnRecord.decode(t.record) for t in rec.turns]
            out, applied = apply(m, turns)
        except ManifestError as e:
            if rec.whole:
                log.error("shared turns of %s/%s (generation %d) are damaged: ignored (%s)", *ref, rec.generation, e)
            return False, None
        if applied != len(turns):
            if rec.whole:
                log.error("shared turn %d of %s/%s does not extend the version before it: ignored",
                          rec.after + applied + 1, *ref)
            return False, None
        return True, out

    def _base(self, ref: SessionRef, gen: int, raw: bytes) -> Manifest | None:
        """The base manifest of a shared record, or None if it is damaged or not this daemon's to read (logged)."""
        tenant, sid = ref
        try:
            m = Manifest.decode(raw)
        except (ManifestError, ValueError) as e:
            log.error("shared manifest of %s/%s (generation %d) is damaged: ignored (%s)", tenant, sid, gen, e)
            return None
        if (m.namespace, m.session_id) != (tenant, sid):  # a record under another's name
            log.error("shared record %s/%s holds the manifest of %s/%s: ignored", tenant, sid, m.namespace,
                      m.session_id)
            return None
        if m.chunk_tokens not in (0, self.chunk_tokens):  # (0: engine pages, in no chain) its chunks
            # would all fail verification here,
            # and a chunk that fails verification is deleted from the tier that served it
            log.error("shared session %s/%s has chunks of %d tokens, this daemon's are %d: ignored",
                      tenant, sid, m.chunk_tokens, self.chunk_tokens)
            return None
        return m


def _held(known: Known) -> int:
    """The generation whose manifest ``known`` holds (0: none): a catch-up from it reads only the turns after it."""
    return known.generation if known.manifest is not None else 0
