"""kvstore as vLLM 0.33's secondary tier, driven by vLLM's own offloading manager (harness.py) with
DeepSeek-V4.1's KV cache specs, a real CPU primary tier in shared memory and real daemons.

Run in the vLLM environment (scripts/vllm_env.sh): ``.venv-vllm/bin/python -m pytest tests/vllm_tier``;
the main suite runs this file there (tests/test_vllm_env.py)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

pytest.importorskip("vllm", reason="vLLM runs in its own environment: scripts/vllm_env.sh")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: daemon_helpers, cluster_helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_helpers import cluster_flags, running_cluster
from daemon_helpers import Daemon, free_port, start_daemon
from harness import Engine, block_hashes, expected, fs_tier, keys_of, kvstore_tier, page_filler
from vllm.v1.kv_offload.base import LookupResult

from kvstore.client import Client
from kvstore.engines.vllm.tier import TESTED_VLLM

BLOCKS = 6


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path / "data", "--port", str(free_port()))
    yield d
    d.stop()


def engine(address: str, **tier: object) -> Engine:
    return Engine.start([kvstore_tier(address, **tier)])


def saved(eng: Engine, seed: int, req: str = "r1", params: dict[str, object] | None = None,
          blocks: int = BLOCKS) -> list[bytes]:
    """Blocks of one request stored through ``eng`` into every tier; their keys."""
    ctx = eng.request(req, params)
    keys = keys_of(block_hashes(f"prompt-{seed}", blocks))
    eng.store(ctx, keys, page_filler(seed))
    eng.wait_idle()
    eng.finish(ctx)
    return keys


def assert_loads(eng: Engine, keys: list[bytes], seed: int, req: str = "again",
                 params: dict[str, object] | None = None) -> None:
    ctx = eng.request(req, params)
    assert [eng.lookup(ctx, k) for k in keys] == [LookupResult.HIT] * len(keys)
    for i, (k, got) in enumerate(zip(keys, eng.read(ctx, keys))):
        n = eng.extent(k)
        assert got[:n] == expected(seed, i, len(got))[:n], f"block {i} differs"
    eng.finish(ctx)


def test_the_tested_vllm_version_is_the_one_installed() -> None:
    import vllm

    assert vllm.__version__ in TESTED_VLLM


def test_store_drop_lookup_load_back_bit_exact(daemon: Daemon) -> None:
    eng = engine(daemon.address)
    try:
        keys = saved(eng, seed=1)
        eng.drop_primary()
        assert_loads(eng, keys, seed=1)
    finally:
        eng.shutdown()
    with Client(address=daemon.address) as c:  # what the daemon keeps: one page session, pages only
        (s,) = c.list_sessions("vllm")
        assert (s.session_id, s.token_count, s.chunks) == ("vllm-r1", BLOCKS * 256, BLOCKS * 2)
        bpt = c.stats().bytes_per_token
        assert bpt.formula == pytest.approx(890.0)


def test_a_restarted_daemon_still_hits(tmp_path: Path) -> None:
    port = free_port()
    d = start_daemon(tmp_path / "data", "--port", str(port))
    eng = engine(d.address)
    try:
        keys = saved(eng, seed=2)
        assert d.stop() == 0
        d = start_daemon(tmp_path / "data", "--port", str(port))
        eng.drop_primary()
        assert_loads(eng, keys, seed=2)
        eng.shutdown()
        eng = engine(d.address)  # and a restarted engine too
        assert_loads(eng, keys, seed=2)
    finally:
        eng.shutdown()
        d.stop()


def test_a_down_daemon_means_misses_never_a_stall_or_an_exception(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "data", "--port", str(free_port()))
    eng = engine(d.address, timeout_s=2.0, down_s=60.0)
    try:
        keys = saved(eng, seed=3)
        d.stop()
        eng.drop_primary()
        ctx = eng.request("while-down")
        t0 = time.monotonic()
        assert [eng.lookup(ctx, k, timeout_s=10) for k in keys] == [LookupResult.MISS] * len(keys)
        eng.store(ctx, keys_of(block_hashes("new", 2)), page_filler(9))  # a store fails, quietly
        eng.wait_idle(timeout_s=10)
        eng.finish(ctx)
        assert time.monotonic() - t0 < 10
    finally:
        eng.shutdown()


def test_a_damaged_block_is_a_miss_and_the_rest_load(tmp_path: Path) -> None:
    port = free_port()
    d = start_daemon(tmp_path / "data", "--port", str(port), "--host-capacity-bytes", "0")
    eng = engine(d.address)
    try:
        keys = saved(eng, seed=4)
        d.stop()
        env = lmdb.open(str(tmp_path / "data" / "ssd"), max_dbs=4, subdir=True)
        db = env.open_db(b"chunks", create=False)
        with env.begin(write=True, db=db) as txn:
            victim, record = next(iter(txn.cursor()))
            rec = bytearray(record)
            rec[200] ^= 0xFF  # inside the page blob's data rows (kept raw): its checksum no longer holds
            txn.put(victim, bytes(rec))
        env.close()
        d = start_daemon(tmp_path / "data", "--port", str(port), "--host-capacity-bytes", "0")
        eng.drop_primary()
        ctx = eng.request("after-damage")
        with Client(address=d.address) as c:
            where = c.lookup_keys("vllm", [eng.tiers[0]._key(eng.tiers[0].default, k) for k in keys])
        bad = [i for i, k in enumerate(keys) if eng.tiers[0]._key(eng.tiers[0].default, k) == victim]
        assert len(bad) == 1 and where[bad[0]] is not None  # lookup does not read bytes: the load does
        results = []
        for k in keys:
            r = eng.lookup(ctx, k)
            if r is LookupResult.HIT:
                eng.read(ctx, [k])
            results.append(r)
        for _ in range(3):  # the failed promotion marks the key a miss; asked again it stays one
            eng.step()
        assert eng.lookup(ctx, keys[bad[0]]) is LookupResult.MISS
        good = [i for i in range(len(keys)) if i != bad[0]]
        assert all(results[i] is LookupResult.HIT for i in good)
        for i in good:
            got = eng.read(ctx, [keys[i]])[0]
            n = eng.extent(keys[i])
            assert got[:n] == expected(4, i, len(got))[:n]
        eng.finish(ctx)
    finally:
        eng.shutdown()
        d.stop()


def test_two_tenants_never_see_each_others_blocks(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[tokens]\n"tok-a" = ["team-a"]\n"tok-b" = ["team-b"]\n')
    d = start_daemon(tmp_path / "data", "--port", str(free_port()), "--tokens-file", str(tokens))
    tenants = {"salt-a": {"namespace": "team-a", "token": "tok-a"},
               "salt-b": {"namespace": "team-b", "token": "tok-b"}}
    eng = engine(d.address, namespace="team-a", token="tok-a", tenants=tenants)
    try:
        keys = saved(eng, seed=5, params={"cache_salt": "salt-a"})
        eng.drop_primary()
        ctx = eng.request("b", {"cache_salt": "salt-b"})
        assert [eng.lookup(ctx, k) for k in keys] == [LookupResult.MISS] * len(keys)
        eng.finish(ctx)
        unknown = eng.request("x", {"cache_salt": "nobody"})  # an unmapped salt is never offloaded
        assert [eng.lookup(unknown, k) for k in keys] == [LookupResult.MISS] * len(keys)
        eng.finish(unknown)
        assert_loads(eng, keys, seed=5, params={"cache_salt": "salt-a"})
    finally:
        eng.shutdown()
        d.stop()


def test_another_engine_configuration_never_gets_these_blocks(daemon: Daemon) -> None:
    eng = engine(daemon.address)
    other = Engine.start([kvstore_tier(daemon.address)], cache_dtype="fp8_ds_mla")
    try:
        keys = saved(eng, seed=6)
        assert eng.tiers[0].layout.layout_id != other.tiers[0].layout.layout_id
        ctx = other.request("fp8")
        assert [other.lookup(ctx, k) for k in keys] == [LookupResult.MISS] * len(keys)
        other.finish(ctx)
    finally:
        eng.shutdown()
        other.shutdown()


def test_a_second_node_resumes_through_its_own_daemon_via_a_redis_cluster(tmp_path: Path) -> None:
    with running_cluster(tmp_path / "cluster") as cluster:
        flags = cluster_flags(cluster.url)
        a = start_daemon(tmp_path / "a", "--port", str(free_port()), *flags)
        b = start_daemon(tmp_path / "b", "--port", str(free_port()), *flags)
        node_a, node_b = engine(a.address), engine(b.address)
        try:
            keys = saved(node_a, seed=7, params={"kvstore_session": "agent-7"})
            assert_loads(node_b, keys, seed=7)
            with Client(address=b.address) as c:
                assert [s.session_id for s in c.list_sessions("vllm")] == ["agent-7"]
        finally:
            node_a.shutdown()
            node_b.shutdown()
            a.stop()
            b.stop()


def test_evict_and_prefetch_work_on_a_page_session(daemon: Daemon) -> None:
    eng = engine(daemon.address)
    try:
        keys = saved(eng, seed=8, params={"kvstore_session": "agent-8"})
        with Client(address=daemon.address) as c:
            c.evict("vllm", "agent-8", "ssd")
            assert set(c.get_session("vllm", "agent-8")[1]) == {"ssd"}
            c.prefetch("vllm", "agent-8")
            assert c.wait_prefetched("vllm", "agent-8", timeout_s=20) is not None
        eng.drop_primary()
        assert_loads(eng, keys, seed=8)
    finally:
        eng.shutdown()


def test_the_fs_tier_beside_it_serves_any_reader_of_its_directory(tmp_path: Path) -> None:
    """What vLLM's own fs tier does: a block one engine wrote is served to another tenant's requests
    (no namespace), and a damaged file is served as it is (no check on read)."""
    root = str(tmp_path / "fs")
    eng = Engine.start([fs_tier(root)])
    try:
        keys = saved(eng, seed=9, params={"cache_salt": "salt-a"})
        eng.drop_primary()
        ctx = eng.request("b", {"cache_salt": "salt-b"})
        assert [eng.lookup(ctx, k) for k in keys] == [LookupResult.HIT] * len(keys)
        eng.finish(ctx)
        files = sorted(Path(root).rglob("*.bin"))
        data = bytearray(files[0].read_bytes())
        data[200] ^= 0xFF
        files[0].write_bytes(bytes(data))
        eng.drop_primary()
        ctx = eng.request("c")
        hits = [eng.lookup(ctx, k) for k in keys]
        assert hits == [LookupResult.HIT] * len(keys)  # the damaged block is a hit: wrong bytes served
        eng.finish(ctx)
    finally:
        eng.shutdown()


def test_a_session_only_grows_across_turns_engines_and_restarts(daemon: Daemon) -> None:
    """Turn 2's prefix stays in vLLM's CPU tier (never looked up here): its save must not drop turn 1's
    blocks from the session (which would free them); nor may a restarted engine's first save."""
    agent = {"kvstore_session": "agent-9"}
    eng = engine(daemon.address)
    try:
        turn1 = saved(eng, seed=10, req="t1", params=agent, blocks=3)
        ctx = eng.request("t2", agent)
        turn2 = keys_of(block_hashes("turn-2", 2))
        eng.store(ctx, turn2, page_filler(11))
        eng.wait_idle()
        eng.finish(ctx)
    finally:
        eng.shutdown()
    eng = engine(daemon.address)  # a restarted vLLM: its first save starts from the daemon's version
    try:
        turn3 = saved(eng, seed=12, req="t3", params=agent, blocks=1)
        with Client(address=daemon.address) as c:
            m, _ = c.get_session("vllm", "agent-9")
        names = set(m.chunk_keys)
        tier = eng.tiers[0]
        for k in (*turn1, *turn2, *turn3):
            assert tier._key(tier.default, k) in names
        eng.drop_primary()
        assert_loads(eng, turn1, seed=10)
    finally:
        eng.shutdown()


def test_a_backpressure_detector_in_the_tier_config_sees_this_tiers_jobs(daemon: Daemon) -> None:
    eng = Engine.start([kvstore_tier(daemon.address, backpressure={"backpressure_cls": "EMABackpressureDetector"})])
    try:
        det = eng.tiers[0].bp_detector
        assert det is not None
        keys = saved(eng, seed=13)
        assert det.stats and not det.is_under_pressure()
        eng.drop_primary()
        assert_loads(eng, keys, seed=13)
    finally:
        eng.shutdown()


def test_concurrent_requests_store_and_load_their_own_bytes(daemon: Daemon) -> None:
    eng = engine(daemon.address, n_load_threads=3, n_store_threads=3)
    try:
        ctxs = [eng.request(f"c{i}") for i in range(8)]
        keys = [keys_of(block_hashes(f"conc-{i}", 3)) for i in range(8)]
        for i, (ctx, ks) in enumerate(zip(ctxs, keys)):  # one scheduler step: eight store jobs at once
            eng.store(ctx, ks, page_filler(100 + i))
        eng.wait_idle()
        for ctx in ctxs:
            eng.finish(ctx)
        eng.drop_primary()
        ctxs = [eng.request(f"l{i}") for i in range(8)]
        pending = {(i, j) for i in range(8) for j in range(len(keys[i]))}
        while pending:  # every request asks in every step: their promotions run side by side
            for i, j in sorted(pending):
                with eng.manager.lock:
                    r = eng.manager.lookup(keys[i][j], ctxs[i])
                assert r is not LookupResult.MISS
                if r is LookupResult.HIT:
                    pending.discard((i, j))
            eng.step()
        for i, ctx in enumerate(ctxs):
            for j, got in enumerate(eng.read(ctx, keys[i])):
                n = eng.extent(keys[i][j])
                assert got[:n] == expected(100 + i, j, len(got))[:n]
            eng.finish(ctx)
    finally:
        eng.shutdown()


def test_jobs_larger_than_the_arena_go_in_arena_sized_batches(daemon: Daemon) -> None:
    eng = engine(daemon.address, arena_bytes=300_000)  # two or three blobs a batch
    try:
        keys = saved(eng, seed=14, blocks=5)
        eng.drop_primary()
        assert_loads(eng, keys, seed=14)
    finally:
        eng.shutdown()
    with Client(address=daemon.address) as c:
        (s,) = c.list_sessions("vllm")
        assert s.chunks == 10
        overflow = c.stats().transport
    assert overflow.arena_calls > 0 and overflow.overflow_calls == 0, overflow


def test_a_full_store_fails_saves_but_the_tier_keeps_serving_what_it_holds(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "data", "--port", str(free_port()), "--ssd-max-map-bytes", str(4 << 20))
    eng = engine(d.address)
    try:
        keys = saved(eng, seed=15, blocks=4)  # ~0.9 MB: fits
        ctx = eng.request("big")
        eng.store(ctx, keys_of(block_hashes("too-much", 24)), page_filler(16))  # ~5.5 MB more: refused
        eng.wait_idle()
        eng.finish(ctx)
        assert "RESOURCE_EXHAUSTED" in d.log() or "full" in d.log()
        eng.drop_primary()
        assert_loads(eng, keys, seed=15)  # a full disk is no reason to stop reading (it was for 5 s)
    finally:
        eng.shutdown()
        d.stop()


def test_one_lookup_call_per_tenant_and_step_however_many_requests_wait(daemon: Daemon) -> None:
    eng = engine(daemon.address)
    try:
        keys = saved(eng, seed=17, blocks=2)
        eng.drop_primary()
        with Client(address=daemon.address) as c:
            before = c.stats().lookups
        ctxs = [eng.request(f"w{i}") for i in range(6)]
        for ctx in ctxs:  # six requests ask in the same step
            with eng.manager.lock:
                eng.manager.lookup(keys[0], ctx)
        eng.step()
        time.sleep(0.5)
        with Client(address=daemon.address) as c:
            assert c.stats().lookups - before == 1
        for ctx in ctxs:
            assert eng.lookup(ctx, keys[0]) is LookupResult.HIT
            eng.finish(ctx)
    finally:
        eng.shutdown()


def test_a_session_of_another_layout_is_never_overwritten(daemon: Daemon) -> None:
    """An agent session of the reference client (token chunks) and a vLLM request naming the same
    session: the tier fails its own store jobs rather than replace the other session."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from daemon_helpers import make_session, save_session

    with Client(address=daemon.address) as c:
        save_session(c, make_session(namespace="vllm", session_id="shared-name"))
        before = c.get_session("vllm", "shared-name")[0]
    eng = engine(daemon.address)
    try:
        ctx = eng.request("r", {"kvstore_session": "shared-name"})
        eng.store(ctx, keys_of(block_hashes("clash", 2)), page_filler(18))
        eng.wait_idle()
        eng.finish(ctx)
    finally:
        eng.shutdown()
    with Client(address=daemon.address) as c:
        assert c.get_session("vllm", "shared-name")[0].chunk_keys == before.chunk_keys


def test_kv_events_say_what_this_tier_stored(daemon: Daemon) -> None:
    from vllm.v1.kv_offload.base import Medium

    eng = Engine.start([kvstore_tier(daemon.address, enable_kv_events=True)], kv_events=True)
    try:
        keys = saved(eng, seed=19, blocks=2)
        with eng.manager.lock:
            events = list(eng.manager.take_events())
        mine = [k for e in events if e.medium is Medium.STORAGE and not e.removed for k in e.keys]
        assert sorted(mine) == sorted(keys)
    finally:
        eng.shutdown()
