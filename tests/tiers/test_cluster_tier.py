"""The redis tier on a real 3-master Redis Cluster (the tier contract, the hash-tagged layout,
read-ahead), and shared sessions and WAIT on a single Redis server."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis

from kvstore.errors import FailedPrecondition, Unavailable
from kvstore.format.manifest import Retention
from kvstore.store import SessionStore, StoreConfig, open_store
from kvstore.tiers import HostTierConfig, RedisTierConfig, SsdTierConfig, TierError
from kvstore.tiers.redis.keys import RedisKeys
from kvstore.tiers.redis.link import NotReplicated
from kvstore.tiers.redis.tier import RedisTier
from tests.helpers.cluster import RedisClusterProcess, require_cluster, running_cluster
from tests.helpers.daemon import make_session
from tests.helpers.store import load

if TYPE_CHECKING:
    from conftest import RedisServer

require_cluster()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcess]:
    with running_cluster(tmp_path_factory.mktemp("cluster"), masters=3) as c:
        yield c


@pytest.fixture
def tier(cluster: RedisClusterProcess) -> Iterator[RedisTier]:
    t = RedisTier(RedisTierConfig(url=cluster.url, cluster=True, namespace=f"t-{uuid.uuid4().hex[:8]}"))
    yield t
    t.close()


def test_the_tier_contract_holds_across_slots(cluster: RedisClusterProcess, tier: RedisTier) -> None:
    items = [(bytes([i]) * 16, bytes([i]) * (100 + i)) for i in range(64)]
    tier.put_many(items)
    tier.put_many([(b"\x05" * 16, b"replaced")])  # an overwrite is accounted by its size change
    expected = dict(items) | {b"\x05" * 16: b"replaced"}
    assert tier.get_many([k for k, _ in items] + [b"absent"]) == [*expected.values(), None]
    assert tier.contains_many([b"\x01" * 16, b"absent"]) == [True, False]
    assert set(tier.keys()) == set(expected)
    used = sum(len(v) for v in expected.values())
    assert (tier.stats().usage.items, tier.stats().usage.used_bytes) == (64, used)
    assert tier.size_of(b"\x07" * 16) == 107 and tier.size_of(b"absent") is None
    assert tier.delete_many([b"\x00" * 16, b"\x01" * 16, b"absent"]) == 2  # an empty value too
    assert tier.recount() == tier.stats().usage and tier.stats().usage.items == 62
    tier.meta().put(b"m:x", b"manifest")
    assert list(tier.meta().keys()) == [b"m:x"] and tier.meta().get(b"m:x") == b"manifest"
    keys = RedisKeys(tier.config.namespace, tagged=True)
    assert len({cluster.master_of(keys.value(k)) for k, _ in items}) == 3  # buckets spread over masters
    with tier.read_ahead([k for k, _ in items]):  # pipelined windows, the same answers
        assert [tier.get_many([k])[0] for k, _ in items[2:]] == list(expected.values())[2:]
        assert tier.get_many([b"\x00" * 16])[0] is None


def test_a_cluster_that_is_down_fails_as_a_tier_error() -> None:
    with pytest.raises(TierError, match="cannot read the cluster's slot map"):
        RedisTier(RedisTierConfig(url="redis://127.0.0.1:1/0", cluster=True, socket_timeout_s=0.2))


def _store(tmp: Path, url: str, name: str, namespace: str, chunk_tokens: int = 256) -> SessionStore:
    redis_tier = RedisTierConfig(url=url, namespace=namespace, share_sessions=True)
    return open_store(StoreConfig(tiers=(HostTierConfig(), SsdTierConfig(path=str(tmp / name)), redis_tier),
                                  chunk_tokens=chunk_tokens))


def test_sharing_is_chosen_once_from_the_config(redis_url: str, tmp_path: Path) -> None:
    """A Redis tier with share_sessions makes the store share sessions through it; without, a store
    has the same tiers and shares nothing (its sharing layer does nothing)."""
    ns = f"c-{uuid.uuid4().hex[:8]}"
    shared = _store(tmp_path, redis_url, "a", ns)
    alone = open_store(StoreConfig(tiers=(HostTierConfig(), SsdTierConfig(path=str(tmp_path / "b")),
                                          RedisTierConfig(url=redis_url, namespace=ns))))
    try:
        assert (shared.sharing_tiers(), shared.reads_remote) == (("redis",), True)
        assert (alone.sharing_tiers(), alone.reads_remote) == ((), False)
        s = make_session(namespace="ns", session_id="s", tokens=700)
        shared.save_session("ns", s.layout.layout_id, bytes(16), 0, s.blobs, s.manifest)
        assert alone.list_sessions("ns") == [] and [m.session_id for m in shared.list_sessions("ns")] == ["s"]
    finally:
        shared.close()
        alone.close()


def test_sessions_are_shared_through_a_single_server(redis_url: str, tmp_path: Path) -> None:
    prefix = f"p-{uuid.uuid4().hex[:8]}"
    a, b = _store(tmp_path, redis_url, "a", prefix), _store(tmp_path, redis_url, "b", prefix)
    try:
        s = make_session(namespace="ns", session_id="s", tokens=700)
        a.save_session("ns", s.layout.layout_id, bytes(16), 0, s.blobs, s.manifest)
        assert [m.session_id for m in b.list_sessions("ns")] == ["s"]
        assert [bytes(blob) for _, blob in load(b, "ns", b.get("ns", "s").chunk_keys)] == s.blobs  # type: ignore[arg-type]
        other = make_session(namespace="ns", session_id="s", tokens=700, seed=9)
        b.save_session("ns", other.layout.layout_id, bytes(16), 0, other.blobs, other.manifest)
        with pytest.raises(FailedPrecondition, match="changed through another daemon"):
            a.save_session("ns", s.layout.layout_id, bytes(16), 0, s.blobs, s.manifest)  # A had not seen B's
        assert a.get("ns", "s").chunk_keys == tuple(other.keys)
        b.touch("ns", "s", Retention(pinned=True))  # a retention change is a version too
        assert a.get("ns", "s").retention.pinned
        # the version deleted is B's (A caught up): its chunks, which no other session uses, are freed
        assert not set(other.keys) & set(s.keys)
        assert a.delete("ns", "s") == len(other.keys)
        with pytest.raises(KeyError):
            b.get("ns", "s")
    finally:
        a.close()
        b.close()


def test_wait_without_enough_replicas_fails_the_write(redis_url: str) -> None:
    t = RedisTier(RedisTierConfig(url=redis_url, namespace=f"w-{uuid.uuid4().hex[:8]}", wait_replicas=1,
                                  wait_timeout_ms=50))
    with pytest.raises(NotReplicated, match="0 of 1 replicas"):
        t.put_many([(b"k", b"v")])
    assert t.get_many([b"k"])[0] == b"v"  # applied on the master, just not acknowledged
    t.close()
    assert redis.Redis.from_url(redis_url).ping()


def test_without_its_shared_tier_a_daemon_reads_what_it_holds_and_refuses_saves(
        redis_server: RedisServer, tmp_path: Path) -> None:
    a = _store(tmp_path, redis_server.url, "a", "down")
    try:
        s = make_session(namespace="ns", session_id="s", tokens=700)
        a.save_session("ns", s.layout.layout_id, bytes(16), 0, s.blobs, s.manifest)
        redis_server.kill()
        assert [m.session_id for m in a.list_sessions("ns")] == ["s"]  # from its own index
        assert [bytes(b) for _, b in load(a, "ns", a.get("ns", "s").chunk_keys)] == s.blobs  # type: ignore[arg-type]
        t = make_session(namespace="ns", session_id="t", tokens=700, seed=3)
        with pytest.raises(Unavailable, match="chunks were not published"):
            a.save_session("ns", t.layout.layout_id, bytes(16), 0, t.blobs, t.manifest)
        assert [m.session_id for m in a.list_sessions("ns")] == ["s"]
    finally:
        a.close()


def test_a_daemon_with_other_chunk_sizes_ignores_shared_sessions_and_leaves_their_chunks(
        redis_url: str, tmp_path: Path) -> None:
    prefix = f"p-{uuid.uuid4().hex[:8]}"
    a, b = _store(tmp_path, redis_url, "a", prefix), _store(tmp_path, redis_url, "b", prefix, chunk_tokens=128)
    try:
        s = make_session(namespace="ns", session_id="s", tokens=700)
        a.save_session("ns", s.layout.layout_id, bytes(16), 0, s.blobs, s.manifest)
        assert b.list_sessions("ns") == [] and list(load(b, "ns", s.keys)) == [(k, None) for k in s.keys]
        shared = next(t for t in b.store.tiers if isinstance(t, RedisTier))
        assert shared.contains_many(s.keys) == [True] * len(s.keys)  # nothing deleted as "corrupt"
    finally:
        a.close()
        b.close()
