"""Shared session records in the redis tier: each session's latest version as a base manifest plus
the turns appended to it since, and its generation, changed only by compare-and-set.

A session has two keys (docs/FORMAT.md, "Shared sessions in Redis"): its **base**, the string
``b"<generation>\\n<writer>\\n" + manifest`` (nothing after the writer once deleted; the writer is
the publishing daemon's random id), and its **turns**, a list of ``b"<generation>\\n<writer>\\n<used>\\n"
+ turn record`` (``kvstore.format.turn_record``; ``used``: the bytes of the records up to this one).
The turns' generations follow the base's one by one, so the session's latest generation is the
base's plus the list's length, and a reader at generation g reads only the turns after it. A turn
is appended in O(the turn) until the records hold as many bytes as the base's manifest; then the
version is written whole as the new base and the list emptied, in one script (a compaction, paid
for by the bytes appended since the last one).

The generation counts the session's versions and is never reused: a delete is a version too, so a
daemon holding version 3 cannot overwrite a session deleted and saved again since. All of a
tenant's records, its generation hash (for listing) and its change counter (for cheap catch-up)
share one hash slot (``tiers/redis/keys.py``), so one Lua script checks and writes them atomically,
on a single server and on a cluster alike. The tier knows bytes only:
``store/sessions/shared_manifests.py`` gives them meaning.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvstore.tiers.base import TierError
from kvstore.tiers.redis.keys import RedisKeys
from kvstore.tiers.redis.link import RedisLink

# What every script knows of a session's keys (KEYS[2]: its base, KEYS[3]: its turns): a record's
# head, and the generation and writer of the latest version stored.
_PRELUDE = r"""
local function head(s)
  if not s then return nil end
  local g, w = string.match(s, '^(%d+)\n(%x*)\n')
  if not g then return nil end
  return tonumber(g), w, string.len(g) + string.len(w) + 2
end
local function latest()
  local last = redis.call('LINDEX', KEYS[3], -1)
  if last then return head(last) end
  return head(redis.call('GETRANGE', KEYS[2], 0, 63))
end
"""
# KEYS: generation hash, base, turns, change counter. ARGV: session id, expected generation, manifest
# ('' = delete), writer. Returns {1, new generation} or {0, current generation}. The version after
# the expected one counts as expected when this writer wrote it: its own write, applied but not
# acknowledged (an answer lost, a WAIT that timed out), does not block its retry.
_CAS = _PRELUDE + r"""
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local want = tonumber(ARGV[2])
if cur == want + 1 then
  local g, w = latest()
  if g == cur and w == ARGV[4] then want = cur end
end
if cur ~= want then return {0, cur} end
local gen = cur + 1
redis.call('HSET', KEYS[1], ARGV[1], gen)
redis.call('SET', KEYS[2], tostring(gen) .. '\n' .. ARGV[4] .. '\n' .. ARGV[3])
redis.call('DEL', KEYS[3])
redis.call('INCR', KEYS[4])
return {1, gen}
"""
# KEYS: as _CAS. ARGV: session id, expected generation, turn record, writer. Returns {1, new
# generation}, {0, current generation} (another writer's version), or {2, current generation}: write
# the version whole instead (a compaction is due, the stored version is no base plus its turns, or
# the latest is this writer's own unacknowledged one, which _CAS replaces). O(the record).
_APPEND = _PRELUDE + r"""
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local want = tonumber(ARGV[2])
if cur ~= want then
  if cur == want + 1 then
    local g, w = latest()
    if g == cur and w == ARGV[4] then return {2, cur} end
  end
  return {0, cur}
end
local base, _, hlen = head(redis.call('GETRANGE', KEYS[2], 0, 63))
local size = redis.call('STRLEN', KEYS[2])
local n = redis.call('LLEN', KEYS[3])
if not base or size == hlen or base + n ~= cur then return {2, cur} end
local used = 0
if n > 0 then
  local u = string.match(redis.call('LINDEX', KEYS[3], -1), '^%d+\n%x*\n(%d+)\n')
  if not u then return {2, cur} end
  used = tonumber(u)
end
used = used + string.len(ARGV[3])
if used >= size - hlen then return {2, cur} end
local gen = cur + 1
redis.call('RPUSH', KEYS[3], tostring(gen) .. '\n' .. ARGV[4] .. '\n' .. tostring(used) .. '\n' .. ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], gen)
redis.call('INCR', KEYS[4])
return {1, gen}
"""
# KEYS: generation hash, base, turns. ARGV: session id, the reader's generation, the generation
# whose manifest it holds (0: none). Returns {current generation} when that is not newer; {current,
# held, 0, '', the turns after held} when the reader can extend what it holds; else {current, the
# base's generation (0: no base), 1, the base ('' if none), every turn}.
_FETCH = _PRELUDE + r"""
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if cur <= tonumber(ARGV[2]) then return {cur} end
local held = tonumber(ARGV[3])
local base = head(redis.call('GETRANGE', KEYS[2], 0, 63))
local n = redis.call('LLEN', KEYS[3])
if held > 0 and base and held >= base and base + n == cur then
  return {cur, held, 0, '', redis.call('LRANGE', KEYS[3], held - base, -1)}
end
return {cur, base or 0, 1, redis.call('GET', KEYS[2]) or '', redis.call('LRANGE', KEYS[3], 0, -1)}
"""


class Appended(enum.Enum):
    """What an append's compare-and-set did."""

    APPLIED = 1  # the turn is the session's new version
    CONFLICT = 0  # another writer's version is there: nothing applied
    WHOLE = 2  # nothing applied: publish the version whole (``SessionRecords.publish``)


class Turn(NamedTuple):
    """One turn of a session's list: the generation it makes and its turn record's bytes."""

    generation: int
    record: bytes


class Record(NamedTuple):
    """A session's versions as read: the latest generation; then either the base (``whole``: its
    manifest, None if deleted, at generation ``after``; ``after`` 0: no base, the record is damaged)
    and every turn since, or (not ``whole``) the turns after the reader's own generation ``after``.
    Nothing newer: no turns, not whole, and ``after`` the latest generation."""

    generation: int
    after: int
    whole: bool
    manifest: bytes | None
    turns: tuple[Turn, ...]


def _split(raw: bytes, fields: int) -> tuple[list[bytes], bytes]:
    """A record's head (``fields`` newline-terminated fields) and its body; TierError if it has none."""
    *head, body = bytes(raw).split(b"\n", fields)
    if len(head) != fields:
        raise TierError(f"shared session record with a damaged head ({bytes(raw)[:64]!r})")
    return head, body


def _turn(raw: bytes) -> Turn:
    (gen, _, _), record = _split(raw, 3)
    return Turn(int(gen), record)


def _record(answer: Sequence[Any]) -> Record | None:
    """Parse ``_FETCH``'s answer: None if the session was never published."""
    cur = int(answer[0])
    if cur == 0:
        return None
    if len(answer) == 1:
        return Record(cur, cur, False, None, ())
    _, after, whole, base, turns = answer
    manifest = _split(base, 2)[1] or None if base else None
    return Record(cur, int(after), bool(whole), manifest, tuple(_turn(t) for t in turns))


class SessionRecords:
    """Compare-and-set and reads of the shared session records."""

    def __init__(self, link: RedisLink, keys: RedisKeys) -> None:
        self._link = link
        self._keys = keys
        self.writer = uuid.uuid4().hex  # this process's id in the records it writes

    def _keys_of(self, tenant: str, session_id: str) -> tuple[bytes, bytes, bytes]:
        k = self._keys
        return k.generations(tenant), k.record(tenant, session_id), k.turns(tenant, session_id)

    def _cas(self, script: str, tenant: str, session_id: str, expected: int, value: bytes) -> tuple[int, int]:
        """Run a compare-and-set script; its (status, generation). With ``wait_replicas`` it returns only
        once replicated."""
        k = self._keys
        gens, base, turns = self._keys_of(tenant, session_id)
        cas = ("EVAL", script, 4, gens, base, turns, k.changes(tenant), session_id, expected, value, self.writer)
        _, (status, gen) = self._link.write([(k.tenants(), ("SADD", k.tenants(), tenant)), (base, cas)])
        return int(status), int(gen)

    def publish(self, tenant: str, session_id: str, expected: int, manifest: bytes | None) -> tuple[bool, int]:
        """Make ``manifest`` (None: a delete) the session's version ``expected + 1``, written whole (its
        turns dropped), if its latest is ``expected`` (0: none yet). Returns (True, the new generation),
        or (False, the current one) if another writer got there first (this process's own
        unacknowledged version of ``expected + 1`` does not count: it is replaced)."""
        with self._link.errors("publish session"):
            status, gen = self._cas(_CAS, tenant, session_id, expected, manifest or b"")
        return bool(status), gen

    def append(self, tenant: str, session_id: str, expected: int, record: bytes) -> tuple[Appended, int]:
        """Append a turn ``record`` as the session's version ``expected + 1`` if its latest is
        ``expected``: O(the record). Returns what was done and the new (applied) or current generation;
        ``Appended.WHOLE``: nothing was, publish the version whole instead."""
        with self._link.errors("publish session turn"):
            status, gen = self._cas(_APPEND, tenant, session_id, expected, record)
        return Appended(status), gen

    def fetch(self, tenant: str, session_id: str, known: int = 0, held: int = 0) -> Record | None:
        """The session's versions after ``known`` (``held``: the generation whose manifest the reader
        holds, 0: none; then only the turns after it are read when they extend it), or None if it was
        never published."""
        return self.fetch_many(tenant, [(session_id, known, held)])[0]

    def fetch_many(self, tenant: str, wanted: Sequence[tuple[str, int, int]]) -> list[Record | None]:
        """``fetch`` of several sessions of one tenant, each (session id, known, held): one round trip
        (one slot)."""
        if not wanted:
            return []
        calls = [("EVAL", _FETCH, 3, *self._keys_of(tenant, sid), sid, known, held) for sid, known, held in wanted]
        with self._link.errors("fetch sessions"):
            answers = self._link.pipelined(calls)
        return [_record(a) for a in answers]

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
