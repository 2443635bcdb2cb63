"""TieredStore: write-through / write-back, promotion, capacity-driven demotion, pins,
corruption detection and a failing tier, on real host / LMDB / redis-server tiers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import lmdb
import pytest
import redis

from kvstore.store import StoreConfig, TieredStore, open_store
from kvstore.store.tiered.store import TierCounters
from kvstore.tiers.base import Tier, Views
from kvstore.tiers.ssd.tier import DB_NAME
from tests.helpers.store import (
    SSD_HEADER,
    Session,
    abandon,
    build_session,
    get,
    load,
    make_tiered,
    store_config,
    token_stream,
    unframe,
)
from tests.helpers.store import (
    save as save_session,
)

if TYPE_CHECKING:
    from conftest import RedisServer

HOST, SSD, REDIS = 0, 1, 2


def chunks(n: int, seed: int = 0) -> Session:
    """A session of ``n`` complete chunks (what the chunk-level tests put)."""
    return build_session("ns", f"s{seed}", token_stream(seed, n * 16))


def put_all(st: TieredStore, s: Session) -> None:
    for k, b in zip(s.keys, s.blobs):
        st.put_many([(k, b)])


def counters(st: TieredStore, tier: int) -> TierCounters:
    return st.counters[st.tiers[tier].name]


def ssd_path(config: StoreConfig) -> str:
    return config.tiers[SSD].path  # type: ignore[union-attr]


def rewrite_lmdb(path: str, key: bytes, edit: Callable[[bytes], bytes]) -> None:
    """Replace the ssd tier's stored record of ``key`` by ``edit(record)``, with the lmdb module."""
    env = lmdb.open(path, max_dbs=8)
    try:
        db = env.open_db(DB_NAME)
        with env.begin(write=True, db=db) as txn:
            record = txn.get(key)
            assert record is not None
            txn.put(key, edit(bytes(record)))
    finally:
        env.close()


def read_lmdb(path: str, key: bytes) -> bytes | None:
    env = lmdb.open(path, max_dbs=8, readonly=True)
    try:
        with env.begin(db=env.open_db(DB_NAME, create=False)) as txn:
            record = txn.get(key)
            return None if record is None else bytes(record)
    finally:
        env.close()


def flip(record: bytes, at: int) -> bytes:
    b = bytearray(record)
    b[at] ^= 0x40
    return bytes(b)


# -- write modes ------------------------------------------------------------------------------------
def test_write_through_chunk_is_durable_when_put_returns(tmp_path: Path) -> None:
    cfg = store_config(tmp_path)
    s = chunks(3)
    st = make_tiered(cfg)
    for k, b in zip(s.keys, s.blobs):
        st.put_many([(k, b)])
        assert st.where(k) == ["host", "ssd"]
    abandon(st)  # no store-level flush: only what put() made durable survives

    st = make_tiered(cfg)  # a fresh store over the same ssd dir
    try:
        for k, b in zip(s.keys, s.blobs):
            assert st.where(k) == ["ssd"]
            assert bytes(get(st, k)) == b
            assert st.where(k) == ["host", "ssd"]  # promoted on read
        assert counters(st, SSD).hits == 3 and counters(st, HOST).promotions == 3
    finally:
        st.close()


def test_write_back_is_not_durable_until_flush(tmp_path: Path) -> None:
    cfg = store_config(tmp_path, write_mode="back")
    s = chunks(3)
    st = make_tiered(cfg)
    put_all(st, s)
    assert [st.where(k) for k in s.keys] == [["host"]] * 3
    abandon(st)
    st = make_tiered(cfg)
    assert [get(st, k) for k in s.keys] == [None] * 3  # nothing had reached the disk
    put_all(st, s)
    st.flush()
    assert [st.where(k) for k in s.keys] == [["host", "ssd"]] * 3
    abandon(st)
    st = make_tiered(cfg)
    try:
        assert [bytes(get(st, k)) for k in s.keys] == list(s.blobs)
    finally:
        st.close()


def test_write_back_demotion_makes_chunks_durable(tmp_path: Path) -> None:
    s = chunks(5)
    cfg = store_config(tmp_path, write_mode="back", host_capacity=3 * len(s.blobs[0]))
    st = make_tiered(cfg)
    put_all(st, s)
    assert [st.where(k) for k in s.keys] == [["ssd"]] * 2 + [["host"]] * 3
    assert counters(st, HOST).demotions == 2
    abandon(st)
    st = make_tiered(cfg)
    try:
        assert [bytes(get(st, k)) for k in s.keys[:2]] == list(s.blobs[:2])
        assert [get(st, k) for k in s.keys[2:]] == [None] * 3
    finally:
        st.close()


def test_promote_on_read_off_leaves_chunks_where_they_are(tmp_path: Path) -> None:
    s = chunks(2)
    st = make_tiered(store_config(tmp_path, promote_on_read=False))
    try:
        put_all(st, s)
        assert all(st.evict([k], "ssd", "a test") == 1 for k in s.keys)
        assert counters(st, HOST).demotions == 2  # ssd already held them: moved down by dropping the host copy
        assert counters(st, HOST).evictions == 0
        assert bytes(get(st, s.keys[0])) == s.blobs[0]
        assert st.where(s.keys[0]) == ["ssd"]
        assert counters(st, SSD).hits == 1 and counters(st, HOST).promotions == 0
    finally:
        st.close()


def test_a_prefetch_reads_only_what_the_fastest_tier_lacks(tmp_path: Path) -> None:
    """A prefetch asks the fastest tier what it holds and reads (and verifies) only the rest from slower
    tiers: a session already in memory costs one presence check, not a second pass over its bytes that
    would run beside the load it was meant to speed up."""
    s = chunks(3)
    st = make_tiered(store_config(tmp_path))
    try:
        put_all(st, s)  # write-through: in host and ssd
        assert st.evict([s.keys[2]], "ssd", "a test") == 1
        asked: list[list[bytes]] = []
        verified: list[int] = []
        def spy(tier: Tier) -> None:
            inner = tier.read_views

            def read_views(keys: Sequence[bytes]) -> contextlib.AbstractContextManager[Views]:
                asked.append(list(keys))
                return inner(keys)

            tier.read_views = read_views  # type: ignore[method-assign]

        for tier in st.tiers:
            spy(tier)

        def verify(at: Sequence[int], values: Sequence[object]) -> list[bool]:
            verified.extend(at)
            return [True] * len(at)

        assert st.prefetch(s.keys, verify) == [None, None, True]
        assert asked == [[s.keys[2]]] and verified == [2]  # the ssd tier alone, for the one chunk host lacked
        assert st.where(s.keys[2]) == ["host", "ssd"]
    finally:
        st.close()


# -- capacity ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["through", "back"])
def test_capacity_pressure_demotes_least_recently_used(tmp_path: Path, mode: str) -> None:
    s = chunks(10)
    size = len(s.blobs[0])
    st = make_tiered(store_config(tmp_path, write_mode=mode, host_capacity=3 * size))
    try:
        host = st.tiers[HOST]
        for k, b in zip(s.keys[:3], s.blobs[:3]):
            st.put_many([(k, b)])
        assert bytes(get(st, s.keys[0])) == s.blobs[0]  # chunk 0 is now the most recently used
        for k, b in zip(s.keys[3:], s.blobs[3:]):
            st.put_many([(k, b)])
            u = host.stats().usage
            assert u.used_bytes <= u.capacity_bytes and u.items <= 3
        # LRU order: 1 went first (0 had been read), then 2, then 0, 3, 4, ...
        assert set(host.keys()) == set(s.keys[7:])
        c = counters(st, HOST)
        assert (c.evictions, c.demotions) == ((7, 0) if mode == "through" else (0, 7))
        for k, b in reversed([*zip(s.keys, s.blobs)]):  # newest first: 9, 8, 7 from host, the rest from ssd
            assert bytes(get(st, k)) == b
            u = host.stats().usage
            assert u.used_bytes <= u.capacity_bytes
        assert counters(st, HOST).hits == 1 + 3 and counters(st, SSD).hits == 7 and c.promotions == 7
    finally:
        st.close()


def test_pinned_chunks_are_never_demoted(tmp_path: Path) -> None:
    s = chunks(10)
    size = len(s.blobs[0])
    st = make_tiered(store_config(tmp_path, write_mode="back", host_capacity=3 * size))
    try:
        st.put_many([(s.keys[0], s.blobs[0])])
        st.pin([s.keys[0]])
        for k, b in zip(s.keys[1:], s.blobs[1:]):
            st.put_many([(k, b)])
            assert st.where(s.keys[0]) == ["host"]  # the LRU chunk, but pinned: not even copied down
        assert st.tiers[HOST].stats().usage.items == 3
        st.pin(s.keys[8:])  # everything on host pinned: the next put overshoots instead of demoting
        extra = chunks(1, seed=1)
        st.put_many([(extra.keys[0], extra.blobs[0])])
        assert st.tiers[HOST].stats().usage.items == 4
        assert all(st.where(k) == ["host"] for k in (s.keys[0], *s.keys[8:]))
        st.unpin([s.keys[0], *s.keys[8:]])
        st.put_many([(s.keys[1], s.blobs[1])])  # room is made again, least recently used first
        assert st.where(s.keys[0]) == ["ssd"]
        assert st.tiers[HOST].stats().usage.items <= 3
    finally:
        st.close()


def test_three_tiers_demote_into_redis_and_read_back(tmp_path: Path, redis_server: RedisServer) -> None:
    s = chunks(8)
    size = len(s.blobs[0])
    cfg = store_config(tmp_path, host_capacity=2 * size, ssd_capacity=3 * (size + SSD_HEADER.size),
                       redis_url=redis_server.url)
    st = make_tiered(cfg)
    try:
        for k, b in zip(s.keys, s.blobs):
            st.put_many([(k, b)])
            u = st.tiers[SSD].stats().usage
            assert u.used_bytes <= u.capacity_bytes
        assert [st.where(k) for k in s.keys] == [["redis"]] * 5 + [["ssd"]] + [["host", "ssd"]] * 2
        assert counters(st, SSD).demotions == 5
        raw = redis.Redis.from_url(redis_server.url)
        assert raw.get(b"kvtest:" + s.keys[0]) == s.blobs[0]  # stored as is, under the namespace
        raw.close()
        # Newest first, so each chunk is read before promotions push it further down.
        for k, b in reversed([*zip(s.keys, s.blobs)]):
            assert bytes(get(st, k)) == b
            u = st.tiers[SSD].stats().usage
            assert u.used_bytes <= u.capacity_bytes
        assert (counters(st, HOST).hits, counters(st, SSD).hits, counters(st, REDIS).hits) == (2, 1, 5)
        assert counters(st, SSD).promotions == 5 and counters(st, HOST).promotions == 6
        for k, b in zip(s.keys, s.blobs):  # and again, wherever the promotions left them
            assert bytes(get(st, k)) == b
    finally:
        st.close()


# -- corruption -------------------------------------------------------------------------------------
def test_corrupt_lmdb_value_is_detected_and_deleted(tmp_path: Path) -> None:
    s = chunks(4)
    cfg = store_config(tmp_path)
    st = make_tiered(cfg)
    put_all(st, s)
    st.close()
    path = ssd_path(cfg)
    # A flipped bit inside the chunk; another chunk's (valid) bytes under this key; a torn record.
    rewrite_lmdb(path, s.keys[0], lambda r: flip(r, SSD_HEADER.size + 700))
    other = read_lmdb(path, s.keys[2])
    rewrite_lmdb(path, s.keys[1], lambda r: other)
    rewrite_lmdb(path, s.keys[3], lambda r: r[: len(r) // 2])

    st = make_tiered(cfg)
    try:
        assert get(st, s.keys[0]) is None and get(st, s.keys[1]) is None
        assert counters(st, SSD).verify_failures == 2
        assert not st.tiers[SSD].contains_many([s.keys[0]])[0] and not st.tiers[SSD].contains_many([s.keys[1]])[0]
        assert get(st, s.keys[3]) is None  # torn framing: a miss, never served, deleted like the others
        assert counters(st, SSD).verify_failures == 3 and not st.tiers[SSD].contains_many([s.keys[3]])[0]
        assert counters(st, SSD).errors == 0 and not counters(st, SSD).degraded  # the tier itself is fine
        assert bytes(get(st, s.keys[2])) == s.blobs[2]
        assert counters(st, HOST).verify_failures == 0
    finally:
        st.close()
    assert read_lmdb(path, s.keys[0]) is None and read_lmdb(path, s.keys[1]) is None
    assert read_lmdb(path, s.keys[3]) is None


def test_corrupt_lmdb_value_falls_back_to_a_good_redis_copy(tmp_path: Path, redis_server: RedisServer) -> None:
    s = chunks(2)
    cfg = store_config(tmp_path, redis_url=redis_server.url)
    st = make_tiered(cfg)
    put_all(st, s)
    assert st.evict([s.keys[0]], "redis", "a test") == 1
    assert st.where(s.keys[0]) == ["ssd", "redis"]  # the durable copy stays
    assert bytes(get(st, s.keys[0])) == s.blobs[0]  # promoted back: now on all three tiers
    assert st.where(s.keys[0]) == ["host", "ssd", "redis"]
    st.close()
    path = ssd_path(cfg)
    rewrite_lmdb(path, s.keys[0], lambda r: flip(r, len(r) - 3))  # hits the checksum itself

    st = make_tiered(cfg)
    try:
        assert bytes(get(st, s.keys[0])) == s.blobs[0]
        assert counters(st, SSD).verify_failures == 1 and counters(st, REDIS).hits == 1
        assert st.where(s.keys[0]) == ["host", "ssd", "redis"]  # the good copy was promoted back
    finally:
        st.close()
    assert unframe(read_lmdb(path, s.keys[0])) == s.blobs[0]


def test_corrupt_redis_value_is_detected_and_deleted(tmp_path: Path, redis_server: RedisServer) -> None:
    s = chunks(3)
    st = make_tiered(store_config(tmp_path, redis_url=redis_server.url))
    raw = redis.Redis.from_url(redis_server.url)
    try:
        for k, b in zip(s.keys, s.blobs):  # chunks only the shared tier holds (e.g. another daemon's)
            st.tiers[REDIS].put_many([(k, b)])
        raw.set(b"kvtest:" + s.keys[0], b"garbage")
        bad = bytearray(s.blobs[1])
        bad[100] ^= 1
        raw.set(b"kvtest:" + s.keys[1], bytes(bad))
        raw.set(b"kvtest:" + s.keys[2], s.blobs[0])  # a valid chunk, but not the one this key names
        assert [get(st, k) for k in s.keys] == [None] * 3
        assert counters(st, REDIS).verify_failures == 3 and counters(st, REDIS).hits == 0
        assert [raw.exists(b"kvtest:" + k) for k in s.keys] == [0] * 3
        assert st.where(s.keys[0]) == []
    finally:
        raw.close()
        st.close()


# -- a failing tier ---------------------------------------------------------------------------------
def test_dead_redis_is_reported_and_the_store_keeps_serving(tmp_path: Path, redis_server: RedisServer) -> None:
    s = chunks(6)
    size = len(s.blobs[0])
    cfg = store_config(tmp_path, host_capacity=2 * size, ssd_capacity=3 * (size + SSD_HEADER.size),
                       redis_url=redis_server.url)
    st = make_tiered(cfg)
    try:
        put_all(st, s)
        local = [k for k in s.keys if st.where(k) != ["redis"]]
        assert len(local) == 3
        redis_server.kill()

        assert get(st, s.keys[0]) is None  # it lived only in redis: a miss, not an exception
        report = {r.name: r for r in st.reports()}["redis"]
        assert report.counters.errors > 0 and report.counters.degraded and report.counters.last_error
        for k, b in zip(s.keys[3:], s.blobs[3:]):
            assert bytes(get(st, k)) == b

        more = chunks(4, seed=1)
        put_all(st, more)  # write-through still succeeds: ssd is the durable tier
        # The full ssd cannot demote into the dead redis: it must keep its chunks, not drop them.
        for k, b in [*zip(s.keys[3:], s.blobs[3:]), *zip(more.keys, more.blobs)]:
            assert bytes(get(st, k)) == b
            assert st.tiers[SSD].contains_many([k])[0]
        assert counters(st, REDIS).degraded
    finally:
        st.close()


def test_redis_killed_mid_workload_then_back_the_sessions_store_serves_on_and_reconnects(
        tmp_path: Path, redis_server: RedisServer) -> None:
    ss = open_store(store_config(tmp_path, redis_url=redis_server.url))
    try:
        saved = []
        for i in range(8):
            if i == 3:
                redis_server.kill()
            if i == 6:
                redis_server.start()  # same port: the pooled socket is dead, the retry reconnects
            s = build_session("ns", f"s{i}", token_stream(i, 3 * 16 + 1))
            save_session(ss, s)  # the durable tier is ssd: saves never need redis
            saved.append(s)
            for t in saved:  # lookups ask every tier, redis included; loads come from host or ssd
                assert ss.lookup("ns", t.layout.layout_id, t.token_ids).cached_tokens == 3 * 16
                assert all(bytes(b) == want for (_, b), want in zip(load(ss, "ns", t.keys), t.blobs))
        assert counters(ss.store, REDIS).errors > 0  # the outage was noticed...
        assert ss.evict("ns", "s7", "redis") == 3  # ...and redis takes chunks again
        assert not counters(ss.store, REDIS).degraded
        assert ss.store.where(saved[7].keys[0]) == ["ssd", "redis"]  # the durable copy stays
        assert [bytes(b) for _, b in load(ss, "ns", saved[7].keys)] == list(saved[7].blobs)
    finally:
        ss.store.close()


# -- failures of the fast tier, pins under admin demotion --------------------------------------------
def test_write_back_falls_back_to_write_through_when_the_fast_tier_fails(tmp_path: Path) -> None:
    s = chunks(3)
    cfg = store_config(tmp_path, write_mode="back")
    st = make_tiered(cfg)
    try:
        st.tiers[HOST].close()  # every host call now raises TierError: the tier has failed
        put_all(st, s)  # acknowledged: must be durable somewhere, not "dirty" in a dead tier
        assert all(st.holds_durably(k) for k in s.keys)
        assert all(st.tiers[SSD].contains_many([k])[0] for k in s.keys)
        assert counters(st, HOST).errors > 0 and counters(st, HOST).degraded
        assert [bytes(get(st, k)) for k in s.keys] == list(s.blobs)
    finally:
        st.close()


def test_admin_demotion_leaves_pinned_chunks_where_they_are(tmp_path: Path) -> None:
    s = chunks(4)
    st = make_tiered(store_config(tmp_path))
    try:
        put_all(st, s)
        st.pin(s.keys[:2])
        moved = [st.evict([k], "ssd", "a test") == 1 for k in s.keys]
        assert moved == [False, False, True, True]
        assert all(st.tiers[HOST].contains_many([k])[0] for k in s.keys[:2])
        assert not any(st.tiers[HOST].contains_many([k])[0] for k in s.keys[2:])
        st.unpin(s.keys[:2])
        assert st.evict([s.keys[0]], "ssd", "a test") == 1 and not st.tiers[HOST].contains_many([s.keys[0]])[0]
    finally:
        st.close()


def test_demoting_below_the_durable_tier_keeps_the_durable_copy(tmp_path: Path, redis_server: RedisServer) -> None:
    """An admin eviction to Redis (shared, may expire, may restart empty) must not take an
    acknowledged chunk off the durable tier: the session still commits and survives Redis losing it."""
    s = chunks(3)
    st = make_tiered(store_config(tmp_path, redis_url=redis_server.url))
    try:
        put_all(st, s)
        assert all(st.evict([k], "redis", "a test") == 1 for k in s.keys)
        assert [st.where(k) for k in s.keys] == [["ssd", "redis"]] * 3
        assert counters(st, HOST).demotions == 3 and counters(st, HOST).evictions == 0
        assert all(st.holds_durably(k) for k in s.keys)
        redis_server.kill()
        redis_server.start()  # no persistence: Redis comes back empty
        assert [bytes(get(st, k)) for k in s.keys] == list(s.blobs)
    finally:
        st.close()


def test_the_store_answers_what_the_daemon_asks_of_its_tiers(tmp_path: Path, redis_server: RedisServer) -> None:
    """Names, the durable tier, the HBM tier, what the fastest tier holds in memory, a probe: the
    daemon's questions, answered without handing it a tier."""
    st = make_tiered(store_config(tmp_path, redis_url=redis_server.url, redis_namespace=f"ask-{tmp_path.name}"))
    try:
        s = chunks(3)
        put_all(st, s)
        assert (st.tier_names(), st.durable_name(), st.hbm_tier()) == (["host", "ssd", "redis"], "ssd", None)
        sizes = [st.tiers[HOST].size_of(k) or 0 for k in s.keys]
        assert st.held_in_memory(s.keys, sum(sizes)) and not st.held_in_memory(s.keys, sum(sizes) - 1)
        assert st.in_fastest(s.keys[0])
        st.tiers[HOST].delete_many([s.keys[0]])
        assert not st.held_in_memory(s.keys, 1 << 30) and not st.in_fastest(s.keys[0])
        assert st.probe() == {"host": None, "ssd": None, "redis": None}
        redis_server.kill()
        failed = st.probe()
        assert failed["redis"] is not None and (failed["host"], failed["ssd"]) == (None, None)
        assert counters(st, REDIS).errors == 0  # a probe is not counted against the tier
    finally:
        redis_server.start()
        st.close()
    only_ssd = make_tiered(StoreConfig(tiers=(store_config(tmp_path / "b").tiers[SSD],)))
    try:
        put_all(only_ssd, s)
        assert not only_ssd.held_in_memory(s.keys, 1 << 30)  # the fastest tier is no memory tier
    finally:
        only_ssd.close()
