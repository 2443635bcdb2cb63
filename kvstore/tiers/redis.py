"""Redis tier: values as plain Redis strings under ``f"{namespace}:"`` + key.

Usage is O(1): a hash ``f"{namespace}#usage"`` (outside the key prefix, so no tier key can
collide with it and SCAN over the prefix never sees it) holds byte and item counters, updated in
the same Lua script as each write, so a write and its accounting are atomic and an overwrite
knows the old size. Meta records (manifests, when Redis is the durable tier) live under
``f"{namespace}#meta:"``: also outside the value prefix, never expiring. Redis evicts by
itself (``ttl_s``, maxmemory): the counters cannot see that, so with either in play ``usage()``
is an upper bound until ``recount()``.

Every Redis failure becomes a TierError. Timeouts are short, and a connection error is retried
once at once, which is what makes the first command after a server restart succeed (the pooled
socket is dead, the retry reconnects); a server that stays down fails fast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.tiers.base import MetaMap, Stored, Tier, TierError, Usage, Value, check_key, check_value
from kvstore.tiers.config import RedisTierConfig

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
redis.call('HINCRBY', KEYS[2], 'bytes', -size)
redis.call('HINCRBY', KEYS[2], 'items', -1)
return 1
"""
_SCAN_COUNT = 1000


class RedisTier(Tier):
    """A namespaced view of one Redis database. ``victims()`` is empty: Redis evicts by itself."""

    name = "redis"
    persistent = True

    def __init__(self, config: RedisTierConfig) -> None:
        self._config = config
        self._prefix = f"{config.namespace}:".encode()
        self._usage_key = f"{config.namespace}#usage".encode()
        self._ttl_ms = 0 if config.ttl_s is None else config.ttl_s * 1000
        # No connection is made here: a server that is down fails the first command, not startup.
        self._client = redis.Redis.from_url(
            config.url,
            socket_timeout=config.socket_timeout_s,
            socket_connect_timeout=config.socket_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        )
        conn = self._client.connection_pool.connection_kwargs  # for messages; never the password
        server = conn.get("path") or f"{conn.get('host')}:{conn.get('port')}"
        self._where = f"redis tier ({server}/{conn.get('db', 0)})"
        self._put_script = self._client.register_script(_PUT)
        self._delete_script = self._client.register_script(_DELETE)
        self._closed = False
        self._meta = _RedisMeta(self, f"{config.namespace}#meta:".encode())

    @contextlib.contextmanager
    def _errors(self, op: str) -> Iterator[None]:
        if self._closed:
            raise TierError(f"{self._where}: {op} after close()")
        try:
            yield
        except redis.RedisError as exc:
            raise TierError(f"{self._where}: {op} failed: {type(exc).__name__}: {exc}") from exc

    def _key(self, key: bytes) -> bytes:
        return self._prefix + check_key(key)

    def _touching(self) -> bool:
        return self._ttl_ms > 0 and self._config.touch_on_get

    def put(self, key: bytes, value: Value) -> None:
        rkey, view = self._key(key), check_value(value)
        with self._errors("put"):  # EVALSHA directly: a pipeline would first ask SCRIPT EXISTS
            self._put_script(keys=[rkey, self._usage_key], args=[view, self._ttl_ms])

    def put_many(self, items: Iterable[tuple[bytes, Value]]) -> None:
        batch = [(self._key(key), check_value(value)) for key, value in items]
        with self._errors("put_many"):
            pipe = self._client.pipeline(transaction=False)  # one round trip; each script is atomic
            for rkey, view in batch:
                self._put_script(keys=[rkey, self._usage_key], args=[view, self._ttl_ms], client=pipe)
            pipe.execute()

    def get(self, key: bytes) -> Stored | None:
        rkey = self._key(key)
        with self._errors("get"):
            if self._touching():
                return self._client.getex(rkey, px=self._ttl_ms)  # type: ignore[return-value]
            return self._client.get(rkey)  # type: ignore[return-value]

    def get_many(self, keys: Sequence[bytes]) -> list[Stored | None]:
        rkeys = [self._key(key) for key in keys]
        if not rkeys:
            return []
        with self._errors("get_many"):
            if not self._touching():
                return self._client.mget(rkeys)  # type: ignore[return-value]
            pipe = self._client.pipeline(transaction=False)
            for rkey in rkeys:
                pipe.getex(rkey, px=self._ttl_ms)
            return pipe.execute()

    def delete(self, key: bytes) -> bool:
        rkey = self._key(key)
        with self._errors("delete"):
            return bool(self._delete_script(keys=[rkey, self._usage_key]))

    def delete_many(self, keys: Iterable[bytes]) -> int:
        rkeys = [self._key(key) for key in keys]
        with self._errors("delete_many"):
            pipe = self._client.pipeline(transaction=False)
            for rkey in rkeys:
                self._delete_script(keys=[rkey, self._usage_key], client=pipe)
            return sum(pipe.execute())

    def meta(self) -> MetaMap:
        return self._meta

    def contains(self, key: bytes) -> bool:
        rkey = self._key(key)
        with self._errors("contains"):
            return bool(self._client.exists(rkey))

    def size_of(self, key: bytes) -> int | None:
        rkey = self._key(key)
        with self._errors("size_of"):
            # STRLEN alone cannot tell an empty value from a missing key.
            exists, size = self._client.pipeline(transaction=False).exists(rkey).strlen(rkey).execute()
        return int(size) if exists else None

    def usage(self) -> Usage:
        with self._errors("usage"):
            used, items = self._client.hmget(self._usage_key, ["bytes", "items"])  # type: ignore[misc]
        used_bytes = int(used or 0)
        return Usage(used_bytes, self._config.capacity_bytes, int(items or 0), used_bytes)

    def recount(self) -> Usage:
        """Rebuild the usage counters by scanning the namespace (O(keys)): after Redis expired or
        evicted keys itself. Writes racing with it can leave the counters off; run it when idle."""
        keys = [self._prefix + key for key in self.keys()]
        with self._errors("recount"):
            pipe = self._client.pipeline(transaction=False)
            for rkey in keys:
                pipe.strlen(rkey)
            sizes = pipe.execute()
            self._client.hset(self._usage_key, mapping={"bytes": sum(sizes), "items": len(keys)})
        return self.usage()

    def keys(self) -> Iterator[bytes]:
        # SCAN may repeat a key and is not a snapshot: collect and dedupe so errors surface here.
        start = len(self._prefix)
        with self._errors("keys"):
            found = {
                bytes(rkey)[start:] for rkey in self._client.scan_iter(match=self._prefix + b"*", count=_SCAN_COUNT)
            }
        return iter(found)

    def victims(self) -> Iterator[bytes]:
        with self._errors("victims"):
            return iter(())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(redis.RedisError):
                self._client.close()


class _RedisMeta(MetaMap):
    """Meta records as plain strings under their own prefix (no TTL, no usage accounting)."""

    def __init__(self, tier: RedisTier, prefix: bytes) -> None:
        self._tier = tier
        self._prefix = prefix

    def put(self, key: bytes, value: bytes) -> None:
        with self._tier._errors("meta put"):
            self._tier._client.set(self._prefix + check_key(key), value)

    def get(self, key: bytes) -> bytes | None:
        with self._tier._errors("meta get"):
            return self._tier._client.get(self._prefix + check_key(key))  # type: ignore[return-value]

    def delete(self, key: bytes) -> bool:
        with self._tier._errors("meta delete"):
            return bool(self._tier._client.delete(self._prefix + check_key(key)))

    def keys(self) -> Iterator[bytes]:
        start = len(self._prefix)
        with self._tier._errors("meta keys"):
            found = {bytes(k)[start:] for k in self._tier._client.scan_iter(match=self._prefix + b"*",
                                                                             count=_SCAN_COUNT)}
        return iter(found)
