"""Sessions shared by several daemons through a Redis tier configured with ``share_sessions``.

Each daemon keeps its own durable tier (LMDB) and index; the shared tier holds, for every session
saved through any daemon, the chunks its manifest names and its latest manifest, with a
generation (``tiers/redis/sessions.py``). The rules:

- a save is published before the daemon commits it locally and before it is acknowledged: its
  chunks first (the turn's own, and any older one the shared tier lacks), then the manifest by a
  compare-and-set on the generation this daemon last saw. Two daemons saving one session at once
  both expect the same generation; Redis runs one script at a time on the session's slot, so
  exactly one wins and the other's save fails whole (FAILED_PRECONDITION): never a manifest that
  mixes both;
- a daemon catches up before it answers from its index: ``get`` reads the session's record,
  ``list`` and ``lookup`` the tenant's change counter (and, when it moved, the generations). A
  newer version is indexed as it is (in memory: the local durable tier keeps what was saved
  here), its chunks owned by its namespace, so loads read them from the shared tier and verify
  each against its key exactly as any other tier's;
- if the shared tier cannot be read, a daemon answers from what it knows (logged), and does not
  try to catch up again for ``RETRY_S`` (a hung Redis costs one timeout per second, not one per
  read); if it cannot be written, the save fails (UNAVAILABLE): an acknowledged save is always
  published.

Chunks in the shared tier are never deleted by a daemon (another may use them): they expire by
the tier's TTL, if any, or by Redis's maxmemory policy.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvstore.errors import FailedPrecondition, KvstoreError, Unavailable
from kvstore.format.manifest import Manifest, ManifestError
from kvstore.store.sessions.sharing import Accepted, SessionRef, Sharing, Update
from kvstore.tiers.base import TierError

if TYPE_CHECKING:
    from kvstore.store.tiered.store import TieredStore
    from kvstore.tiers.redis.sessions import Record
    from kvstore.tiers.redis.tier import RedisTier

log = logging.getLogger(__name__)
RETRY_S = 1.0  # after a failed catch-up, answer from the local index this long before trying again


class SharedSessions(Sharing):
    """This daemon's side of the shared session records: publishing, catching up, generations."""

    reads_remote = True

    def __init__(self, tier: RedisTier, chunk_tokens: int) -> None:
        self.tier = tier
        self.tiers = (tier.name,)
        self.chunk_tokens = chunk_tokens
        self.records = tier.sessions()
        self._lock = threading.Lock()
        self._gens: dict[SessionRef, int] = {}  # generation of the version this daemon indexes
        self._changes: dict[str, int] = {}  # tenant -> change counter last caught up with
        self._quiet_until = 0.0  # monotonic time before which catching up is not tried

    # -- generations ----------------------------------------------------------------------------
    def generation(self, ref: SessionRef) -> int:
        with self._lock:
            return self._gens.get(ref, 0)

    def advance(self, ref: SessionRef, gen: int) -> bool:
        """Record that this daemon indexes version ``gen``; False if it already has it or a newer one."""
        with self._lock:
            if gen <= self._gens.get(ref, 0):
                return False
            self._gens[ref] = gen
            return True

    def forget(self, refs: Sequence[SessionRef]) -> None:
        """This daemon's index does not hold what it published for ``refs`` (its local commit
        failed): the next read catches up with the shared version."""
        with self._lock:
            for ref in refs:
                self._gens.pop(ref, None)

    # -- publishing -----------------------------------------------------------------------------
    def publish_turns(self, accepted: list[Accepted], store: TieredStore) -> list[Accepted]:
        """Publish each accepted turn (pending call, manifest, new chunks): its chunks, then its
        manifest; fail the ones that cannot be, and return the others, to commit locally."""
        out = []
        for item in accepted:
            pending, m, _ = item
            try:
                self._put_chunks(m, dict(zip(pending.item.keys, pending.item.blobs)), store)
                self.publish(m)
            except KvstoreError as e:
                pending.fail(e)
                continue
            out.append(item)
        return out

    def publish(self, m: Manifest, deleted: bool = False) -> None:
        """Compare-and-set the session's shared manifest (``deleted``: delete it)."""
        ref = (m.namespace, m.session_id)
        expected = self.generation(ref)
        try:
            ok, gen = self.records.publish(m.namespace, m.session_id, expected, None if deleted else m.encode())
        except TierError as e:
            raise Unavailable(f"shared tier: the session was not published, nothing was acknowledged: {e}") from e
        if not ok:
            if gen < expected:  # the shared tier lost versions (a failover without WAIT, a flush)
                log.warning("shared tier has generation %d of session %s/%s, this daemon had %d: it lost "
                            "versions; the next save replaces them", gen, *ref, expected)
                with self._lock:
                    self._gens[ref] = gen
            raise FailedPrecondition(
                f"session {m.session_id!r} in namespace {m.namespace!r} was changed through another daemon "
                f"(shared version {gen}, this daemon's was {expected}): this change was not applied; "
                f"load the session again and retry")
        self.advance(ref, gen)

    def _put_chunks(self, m: Manifest, batch: dict[bytes, Any], store: TieredStore) -> None:
        """Put the turn's chunks, and any other chunk ``m`` names that the shared tier lacks."""
        others = [k for k in dict.fromkeys(m.chunk_keys) if k not in batch]
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
        try:
            rec = self.records.fetch(*ref)
        except TierError as e:
            self._unreadable(e)
            return []
        if rec is None or rec.generation <= self.generation(ref):
            return []
        return self._updates(ref[0], [ref[1]], [rec])

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
                out += self._updates(tenant, newer, self.records.fetch_many(tenant, newer))
                with self._lock:
                    self._changes[tenant] = changes
        except TierError as e:
            self._unreadable(e)
        return out

    def _updates(self, tenant: str, sids: list[str], records: Sequence[Record | None]) -> list[Update]:
        out: list[Update] = []
        for sid, rec in zip(sids, records):
            if rec is None:
                continue
            m = None
            if rec.manifest is not None:
                try:
                    m = Manifest.decode(rec.manifest)
                except (ManifestError, ValueError) as e:
                    log.error("shared manifest of %s/%s (generation %d) is damaged: ignored (%s)",
                              tenant, sid, rec.generation, e)
                    continue
                if (m.namespace, m.session_id) != (tenant, sid):  # a record under another's name
                    log.error("shared record %s/%s holds the manifest of %s/%s: ignored", tenant, sid,
                              m.namespace, m.session_id)
                    continue
                if m.chunk_tokens not in (0, self.chunk_tokens):  # (0: engine pages, in no chain) its chunks
                    # would all fail verification here,
                    # and a chunk that fails verification is deleted from the tier that served it
                    log.error("shared session %s/%s has chunks of %d tokens, this daemon's are %d: ignored",
                              tenant, sid, m.chunk_tokens, self.chunk_tokens)
                    continue
            out.append(((tenant, sid), rec.generation, m))
        return out
