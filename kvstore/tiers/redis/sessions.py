"""Shared session records in the redis tier: each session's latest manifest and its generation,
changed only by compare-and-set.

A record is ``b"<generation>\\n<writer>\\n" + manifest`` (nothing after the writer once deleted;
the writer is the publishing daemon's random id). The generation counts the session's versions
and is never reused: a delete is a version too, so a daemon holding version 3 cannot overwrite a
session deleted and saved again since. All of a
tenant's records, its generation hash (for listing) and its change counter (for cheap catch-up)
share one hash slot (``tiers/redis/keys.py``), so one Lua script checks and writes them atomically, on a
single server and on a cluster alike. The tier knows bytes only: ``store/sessions/shared_manifests.py``
gives them meaning.
"""

from __future__ import annotations

import uuid
from typing import NamedTuple

from kvstore.tiers.redis.keys import RedisKeys
from kvstore.tiers.redis.link import RedisLink

# KEYS: generation hash, record, change counter. ARGV: session id, expected generation, manifest
# ('' = delete), writer. Returns {1, new generation} or {0, current generation}. The version after
# the expected one counts as expected when this writer wrote it: its own write, applied but not
# acknowledged (an answer lost, a WAIT that timed out), does not block its retry.
_CAS = """
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local want = tonumber(ARGV[2])
if cur == want + 1 then
  local rec = redis.call('GET', KEYS[2])
  local head = tostring(cur) .. '\\n' .. ARGV[4] .. '\\n'
  if rec and string.sub(rec, 1, string.len(head)) == head then want = cur end
end
if cur ~= want then return {0, cur} end
local gen = cur + 1
redis.call('HSET', KEYS[1], ARGV[1], gen)
redis.call('SET', KEYS[2], tostring(gen) .. '\\n' .. ARGV[4] .. '\\n' .. ARGV[3])
redis.call('INCR', KEYS[3])
return {1, gen}
"""


class Record(NamedTuple):
    """A session's latest version as published: its generation and manifest (None: deleted)."""

    generation: int
    manifest: bytes | None


def _record(raw: bytes | None) -> Record | None:
    if raw is None:
        return None
    gen, _, rest = bytes(raw).partition(b"\n")
    manifest = rest.partition(b"\n")[2]
    return Record(int(gen), manifest or None)


class SessionRecords:
    """Compare-and-set and reads of the shared session records."""

    def __init__(self, link: RedisLink, keys: RedisKeys) -> None:
        self._link = link
        self._keys = keys
        self.writer = uuid.uuid4().hex  # this process's id in the records it writes

    def publish(self, tenant: str, session_id: str, expected: int, manifest: bytes | None) -> tuple[bool, int]:
        """Make ``manifest`` (None: a delete) the session's version ``expected + 1`` if its latest
        is ``expected`` (0: none yet). Returns (True, the new generation), or (False, the current
        one) if another writer got there first (this process's own unacknowledged version of
        ``expected + 1`` does not count: it is replaced). With ``wait_replicas`` it returns only once replicated."""
        k = self._keys
        record = k.record(tenant, session_id)
        cas = ("EVAL", _CAS, 3, k.generations(tenant), record, k.changes(tenant), session_id, expected,
               manifest or b"", self.writer)
        with self._link.errors("publish session"):
            _, (ok, gen) = self._link.write([(k.tenants(), ("SADD", k.tenants(), tenant)), (record, cas)])
        return bool(ok), int(gen)

    def fetch(self, tenant: str, session_id: str) -> Record | None:
        """The session's latest record, or None if it was never published."""
        with self._link.errors("fetch session"):
            return _record(self._link.client.get(self._keys.record(tenant, session_id)))

    def fetch_many(self, tenant: str, session_ids: list[str]) -> list[Record | None]:
        """Several records of one tenant: one MGET (one slot)."""
        if not session_ids:
            return []
        with self._link.errors("fetch sessions"):
            raws = self._link.client.mget([self._keys.record(tenant, s) for s in session_ids])
        return [_record(r) for r in raws]

    def changes(self, tenant: str) -> int:
        """The tenant's change counter: unchanged means no session of it changed."""
        with self._link.errors("read changes"):
            return int(self._link.client.get(self._keys.changes(tenant)) or 0)

    def generations(self, tenant: str) -> tuple[int, dict[str, int]]:
        """The tenant's change counter and every session's latest generation (deleted ones too)."""
        k = self._keys
        with self._link.errors("list sessions"):
            changes, gens = self._link.pipelined([("GET", k.changes(tenant)), ("HGETALL", k.generations(tenant))])
        return int(changes or 0), {bytes(s).decode(): int(g) for s, g in gens.items()}

    def tenants(self) -> list[str]:
        """Every tenant that ever published a session."""
        with self._link.errors("list tenants"):
            return sorted(bytes(t).decode() for t in self._link.client.smembers(self._keys.tenants()))
