"""Redis tier specifics, against real redis-server processes: namespacing, TTL, server loss."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from kvstore.tiers import RedisTierConfig, TierError
from kvstore.tiers.redis.tier import RedisTier

if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not on PATH; install it to run the redis tier tests", allow_module_level=True)

import redis

if TYPE_CHECKING:
    from conftest import RedisServer


def _tier(url: str, **kwargs: Any) -> RedisTier:
    return RedisTier(RedisTierConfig(url=url, **kwargs))


def test_namespaces_do_not_see_each_other(redis_url: str) -> None:
    a, b = _tier(redis_url, namespace="ns-a"), _tier(redis_url, namespace="ns-b")
    a.put_many([(b"shared", b"from a")])
    b.put_many([(b"shared", b"from b!")])
    b.put_many([(b"only-b", b"x")])
    assert a.get_many([b"shared"])[0] == b"from a" and b.get_many([b"shared"])[0] == b"from b!"
    assert not a.contains_many([b"only-b"])[0] and a.get_many([b"only-b"])[0] is None
    assert set(a.keys()) == {b"shared"} and set(b.keys()) == {b"shared", b"only-b"}
    assert (a.stats().usage.items, a.stats().usage.used_bytes) == (1, 6)
    assert (b.stats().usage.items, b.stats().usage.used_bytes) == (2, 8)
    assert a.delete_many([b"shared", b"only-b"]) == 1
    assert b.get_many([b"shared"])[0] == b"from b!"
    raw = redis.Redis.from_url(redis_url)
    assert raw.get(b"ns-b:shared") == b"from b!"  # the documented key layout
    raw.close()
    a.close()
    b.close()


def test_ttl_expires_values_and_recount_fixes_usage(redis_url: str) -> None:
    tier = _tier(redis_url, namespace="ttl", ttl_s=1)
    tier.put_many([(b"a", b"12345"), (b"b", b"678")])
    assert tier.get_many([b"a"])[0] == b"12345"
    time.sleep(1.5)
    assert tier.get_many([b"a"])[0] is None and not tier.contains_many([b"b"])[0]
    assert list(tier.keys()) == []
    assert tier.stats().usage.items == 2  # Redis expired them behind the counters' back ...
    assert tier.recount() == tier.stats().usage
    assert (tier.stats().usage.items, tier.stats().usage.used_bytes) == (0, 0)  # ... until a recount
    tier.close()


@pytest.mark.parametrize("touch", [True, False])
def test_get_refreshes_the_ttl_when_asked(redis_url: str, touch: bool) -> None:
    tier = _tier(redis_url, namespace=f"touch-{touch}", ttl_s=2, touch_on_get=touch)
    raw = redis.Redis.from_url(redis_url)
    tier.put_many([(b"k", b"v")])
    time.sleep(0.3)
    before = raw.pttl(b"touch-%s:k" % str(touch).encode())
    assert 0 < before <= 1700
    tier.get_many([b"k"])[0]
    tier.get_many([b"k"])
    after = raw.pttl(b"touch-%s:k" % str(touch).encode())
    assert (after > before) is touch
    raw.close()
    tier.close()


def _operations(tier: RedisTier) -> dict[str, Callable[[], object]]:
    return {
        "contains_many": lambda: tier.contains_many([b"k"]),
        "size_of": lambda: tier.size_of(b"k"),
        "stats": tier.stats,
        "keys": tier.keys,
        "put_many": lambda: tier.put_many([(b"k", b"v")]),
        "get_many": lambda: tier.get_many([b"k"]),
        "delete_many": lambda: tier.delete_many([b"k"]),
        "recount": tier.recount,
    }


def test_server_loss_raises_tier_error_and_recovers(redis_server: RedisServer) -> None:
    tier = _tier(redis_server.url, socket_timeout_s=1.0)
    tier.put_many([(b"k", b"before")])
    redis_server.kill()
    for call in _operations(tier).values():  # each fails cleanly: no redis exception, no hang
        with pytest.raises(TierError, match="redis tier"):
            call()
    redis_server.start()  # a fresh, empty server on the same port
    assert tier.get_many([b"k"])[0] is None
    tier.put_many([(b"k", b"after")])
    assert tier.get_many([b"k"])[0] == b"after"
    assert tier.stats().usage.items == 1
    tier.close()


def test_hung_server_times_out_as_tier_error(redis_server: RedisServer) -> None:
    tier = _tier(redis_server.url, socket_timeout_s=0.5)
    tier.put_many([(b"k", b"v")])
    redis_server.pause()
    try:
        with pytest.raises(TierError, match="Timeout"):
            tier.get_many([b"k"])[0]
    finally:
        redis_server.resume()
    assert tier.get_many([b"k"])[0] == b"v"  # the same server, answering again
    tier.close()


def test_down_at_startup_is_not_fatal(redis_server: RedisServer) -> None:
    redis_server.kill()
    tier = _tier(redis_server.url, socket_timeout_s=0.5)  # constructing never connects
    with pytest.raises(TierError):
        tier.stats()
    redis_server.start()
    assert tier.stats().usage.items == 0
    tier.close()


def test_config_rejects_glob_characters_in_namespace() -> None:
    with pytest.raises(ValueError, match="namespace"):
        RedisTierConfig(namespace="a*")
