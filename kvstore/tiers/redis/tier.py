"""Redis tier: values as plain Redis strings, on one server or a Redis Cluster.

The key layout is ``tiers/redis/keys.py``'s. Usage is O(1): usage hashes (one per server; one per
value bucket on a cluster, in the bucket's slot) hold byte and item counters, updated in the same
Lua script as each write, so a write and its accounting are atomic and an overwrite knows the old
size. Meta records (manifests, when Redis is the durable tier) live under ``f"{namespace}#meta:"``,
never expiring. Redis evicts by itself (``ttl_s``, maxmemory): the counters cannot see that, so
with either in play ``stats().usage`` is an upper bound until ``recount()``.

Every write goes through ``RedisLink.write`` (one pipeline; with ``wait_replicas``, followed by
WAIT on each master); every Redis failure becomes a TierError. Scripts are sent with EVAL, not
EVALSHA: a replica promoted by a failover may not have a script cached, and the script text is
tiny next to a chunk.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvstore.tiers.base import MetaMap, Stored, Tier, TierStats, Usage, Value, check_key, check_value
from kvstore.tiers.config import RedisTierConfig
from kvstore.tiers.redis.keys import RedisKeys
from kvstore.tiers.redis.link import Command, RedisLink
from kvstore.tiers.redis.read_ahead import ReadAhead
from kvstore.tiers.redis.sessions import SessionRecords

# KEYS: value key, usage hash. ARGV: value, TTL in ms (0 = none).
_PUT = """
local old = redis.call('STRLEN', KEYS[1])
local existed = redis.call('EXISTS', KEYS[1])
if tonumber(ARGV[2]) > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('HINCRBY', KEYS[2], 'bytes', string.len(ARGV[1]) - old)
redis.call('HINCRBY', KEYS[2], 'items', 1 - existed)
return 1
"""
# KEYS: value key, usage hash. Returns 1 if the key was there.
_DELETE = """
local size = redis.call('STRLEN', KEYS[1])
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], 'bytes', 0 - size)  -- not -size: Lua prints -0
redis.call('HINCRBY', KEYS[2], 'items', -1)
return 1
"""
_SCAN_COUNT = 1000


class RedisTier(Tier):
    """A namespaced view of one Redis database or cluster. ``victims()`` is empty: Redis evicts
    by itself."""

    name = "redis"
    persistent = True

    def __init__(self, config: RedisTierConfig) -> None:
        self.config = config
        self._ttl_ms = config.ttl_s * 1000  # 0: no expiry
        self._keys = RedisKeys(config.namespace, tagged=config.cluster)
        # No connection is made here on one server: a server that is down fails the first
        # command, not startup. A cluster client reads the slot map now.
        self._link = RedisLink(config)
        self._meta = _RedisMeta(self._link, self._keys)
        self._sessions = SessionRecords(self._link, self._keys)
        self._ahead: dict[bytes, ReadAhead] = {}  # key -> the load's read-ahead that expects it
        self._ahead_lock = threading.Lock()
        self._ahead_pool = ThreadPoolExecutor(4, thread_name_prefix="redis-read-ahead")

    @property
    def where(self) -> str:
        return self._link.where

    def _touching(self) -> bool:
        return self._ttl_ms > 0 and self.config.touch_on_get

    def _put(self, key: bytes, value: Value) -> Command:
        rkey = self._keys.value(check_key(key))
        return rkey, ("EVAL", _PUT, 2, rkey, self._keys.usage(key), check_value(value), self._ttl_ms)

    def _delete(self, key: bytes) -> Command:
        rkey = self._keys.value(check_key(key))
        return rkey, ("EVAL", _DELETE, 2, rkey, self._keys.usage(key))

    def put_many(self, items: Iterable[tuple[bytes, Value]]) -> None:
        batch = [self._put(key, value) for key, value in items]  # validated before anything is sent
        with self._link.errors("put_many"):
            self._link.write(batch)  # one round trip (per master); each script is atomic

    @contextlib.contextmanager
    def read_ahead(self, keys: Sequence[bytes]) -> Iterator[None]:
        """While in the block, gets of ``keys`` are served from pipelined windows (tiers/redis/read_ahead.py).
        A key another load's read-ahead already expects stays with it."""
        ra = ReadAhead(keys, self._fetch, self._ahead_pool)
        with self._ahead_lock:
            mine = [k for k in ra.keys if self._ahead.setdefault(k, ra) is ra]
        ra.start()
        try:
            yield
        finally:
            with self._ahead_lock:
                for k in mine:
                    del self._ahead[k]
            ra.close()

    def get_many(self, keys: Sequence[bytes]) -> list[Stored | None]:
        """The values, a key a load's read-ahead expects taken from its windows, the rest fetched
        in one round trip (per master)."""
        keys = [check_key(key) for key in keys]
        out: list[Stored | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        if self._ahead:
            todo = []
            for i, key in enumerate(keys):
                ra = self._ahead.get(key)
                if ra is not None:
                    with self._link.errors("get"):
                        found, out[i] = ra.take(key)
                    if found:
                        continue
                todo.append(i)
        for i, value in zip(todo, self._fetch([keys[i] for i in todo])):
            out[i] = value
        return out

    def _fetch(self, keys: Sequence[bytes]) -> list[Stored | None]:
        rkeys = [self._keys.value(key) for key in keys]
        if not rkeys:
            return []
        with self._link.errors("get_many"):
            if self._touching():
                return self._link.pipelined([("GETEX", rkey, "PX", self._ttl_ms) for rkey in rkeys])
            if not self._link.cluster:
                return self._link.client.mget(rkeys)  # type: ignore[no-any-return]
            return self._link.pipelined([("GET", rkey) for rkey in rkeys])  # MGET cannot span slots

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """One round trip (per master) for the batch."""
        rkeys = [self._keys.value(check_key(key)) for key in keys]
        if not rkeys:
            return []
        with self._link.errors("contains_many"):
            return [bool(n) for n in self._link.pipelined([("EXISTS", rkey) for rkey in rkeys])]

    def delete_many(self, keys: Iterable[bytes]) -> int:
        batch = [self._delete(key) for key in keys]
        with self._link.errors("delete_many"):
            return sum(self._link.write(batch))

    def meta(self) -> MetaMap:
        return self._meta

    def sessions(self) -> SessionRecords:
        """The shared session records (``share_sessions``)."""
        return self._sessions

    def size_of(self, key: bytes) -> int | None:
        rkey = self._keys.value(check_key(key))
        with self._link.errors("size_of"):
            # STRLEN alone cannot tell an empty value from a missing key.
            exists, size = self._link.pipelined([("EXISTS", rkey), ("STRLEN", rkey)])
        return int(size) if exists else None

    def stats(self, pages: bool = False) -> TierStats:
        with self._link.errors("usage"):
            counts = self._link.pipelined([("HMGET", h, "bytes", "items") for h in self._keys.usage_hashes()])
        used_bytes = sum(int(used or 0) for used, _ in counts)
        items = sum(int(n or 0) for _, n in counts)
        return TierStats(Usage(used_bytes, self.config.capacity_bytes, items, used_bytes))

    def recount(self) -> Usage:
        """Rebuild the usage counters by scanning the namespace (O(keys)): after Redis expired or
        evicted keys itself. Writes racing with it can leave the counters off; run it when idle."""
        keys = list(self.keys())
        with self._link.errors("recount"):
            sizes = self._link.pipelined([("STRLEN", self._keys.value(k)) for k in keys])
            totals = {h: [0, 0] for h in self._keys.usage_hashes()}
            for key, size in zip(keys, sizes):
                total = totals[self._keys.usage(key)]
                total[0] += int(size)
                total[1] += 1
            self._link.write([(h, ("HSET", h, "bytes", b, "items", n)) for h, (b, n) in totals.items()])
        return self.stats().usage

    def keys(self) -> Iterator[bytes]:
        # SCAN may repeat a key and is not a snapshot: collect and dedupe so errors surface here.
        with self._link.errors("keys"):
            found = self._link.scan(self._keys.value_pattern(), _SCAN_COUNT)
        return iter({self._keys.key_of_value(rkey) for rkey in found})

    def victims(self) -> Iterator[bytes]:
        with self._link.errors("victims"):
            return iter(())

    def close(self) -> None:
        self._ahead_pool.shutdown(wait=False, cancel_futures=True)
        self._link.close()


class _RedisMeta(MetaMap):
    """Meta records as plain strings under their own prefix (no TTL, no usage accounting)."""

    def __init__(self, link: RedisLink, keys: RedisKeys) -> None:
        self._link = link
        self._keys = keys

    def put(self, key: bytes, value: bytes) -> None:
        rkey = self._keys.meta(check_key(key))
        with self._link.errors("meta put"):
            self._link.write([(rkey, ("SET", rkey, value))])

    def get(self, key: bytes) -> bytes | None:
        with self._link.errors("meta get"):
            return self._link.client.get(self._keys.meta(check_key(key)))  # type: ignore[no-any-return]

    def delete(self, key: bytes) -> bool:
        rkey = self._keys.meta(check_key(key))
        with self._link.errors("meta delete"):
            return bool(self._link.write([(rkey, ("DEL", rkey))])[0])

    def keys(self) -> Iterator[bytes]:
        with self._link.errors("meta keys"):
            found = self._link.scan(self._keys.meta_pattern(), _SCAN_COUNT)
        return iter({self._keys.key_of_meta(rkey) for rkey in found})
