"""kvstore as vLLM 0.33's secondary tier, driven through vLLM's own stack (harness.py): its argument
parser, config, V4.1's cache modules, planner, Scheduler and both connector roles, with real daemons.
Only the GPU copy engine and the model forward are emulated.

Run in the vLLM environment (scripts/vllm_env.sh): ``.venv-vllm/bin/python -m pytest tests/engines/vllm_tier``;
the main suite runs this file there (tests/engines/test_vllm_env.py)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

pytest.importorskip("vllm", reason="vLLM runs in its own environment: scripts/vllm_env.sh")

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo: tests.helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BLOCK_TOKENS, FAMILIES, REPLAY_TOKENS, Engine, Family, fs_tier, kvstore_tier, prompt

from kvstore.client import Client
from kvstore.engines.vllm.tier import TESTED_VLLM
from tests.helpers.cluster import cluster_flags, running_cluster
from tests.helpers.daemon import Daemon, free_port, start_daemon

BLOCKS = 4
BLACKWELL = FAMILIES["blackwell"]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path / "data", "--port", str(free_port()))
    yield d
    d.stop()


def engine(address: str, family: Family = BLACKWELL, **tier: object) -> Engine:
    return Engine(family, [kvstore_tier(address, **tier)])


def assert_hit(eng: Engine, req: str, tokens: list[int], blocks: int = BLOCKS, **kw: object) -> None:
    """A request whose first ``blocks`` blocks the tier holds: vLLM finds them, loads them bit-equal and
    recomputes only the last 128 tokens of the hit (bounded replay)."""
    s = eng.serve(req, tokens, **kw)  # type: ignore[arg-type]
    assert eng.hit_tokens(s) == blocks * BLOCK_TOKENS, f"hit {eng.hit_tokens(s)} tokens"
    assert s.first_computed == blocks * BLOCK_TOKENS - REPLAY_TOKENS
    assert s.loaded == [True] * blocks, f"blocks that came back different: {s.loaded}"


def assert_miss(eng: Engine, req: str, tokens: list[int], **kw: object) -> None:
    s = eng.serve(req, tokens, **kw)  # type: ignore[arg-type]
    assert s.first_computed == 0


def test_the_tested_vllm_version_is_the_one_installed() -> None:
    import vllm

    assert vllm.__version__ in TESTED_VLLM


@pytest.mark.parametrize("family", list(FAMILIES.values()), ids=list(FAMILIES))
def test_store_restart_hit_bit_equal_with_bounded_replay(daemon: Daemon, family: Family) -> None:
    tokens = prompt("store", BLOCKS)
    eng = engine(daemon.address, family)
    try:
        assert_miss(eng, "r1", tokens)
        tier = eng.tiers[0]
        assert tier.stats.opaque_blocks == 0 and tier.stats.blocks_stored == BLOCKS
    finally:
        eng.shutdown()
    eng = engine(daemon.address, family)  # a restarted vLLM: empty GPU and CPU caches
    try:
        assert_hit(eng, "r2", tokens)
    finally:
        eng.shutdown()
    with Client(address=daemon.address) as c:  # what the daemon keeps: one page session of the blocks
        (s,) = c.list_sessions("vllm")
        assert (s.session_id, s.chunks) == ("vllm-r1", BLOCKS)


@pytest.mark.parametrize("family", list(FAMILIES.values()), ids=list(FAMILIES))
def test_the_page_layout_is_the_one_vllms_planner_made(daemon: Daemon, family: Family) -> None:
    """Every page where vLLM's KVCacheTensors put it, the block padding never stored, the dtypes named."""
    eng = engine(daemon.address, family)
    try:
        tier = eng.tiers[0]
        assert not tier.geometry.opaque, tier.geometry.reason
        (g,) = tier.layout.groups
        assert g.group == eng.group
        planned = {}
        for t in eng.kv_cache_config.kv_cache_tensors:
            for i, name in enumerate(t.layers):
                planned[name] = t.offset + i * t.layer_stride
        derived = {p.name.rsplit(".b", 1)[0]: p.offset for p in g.pages}
        want = {("index" if n.endswith("indexer.k_cache") else "main") + f".L{n.split('.')[2]}": off
                for n, off in planned.items() if n in eng.kv_cache_config.kv_cache_groups[eng.group].layer_names}
        assert derived == want
        assert g.block_bytes == eng.extent and tier.geometry.padding == eng.stride - eng.extent
        fp = dict(tier.layout.fingerprint)
        indexer = "mxfp4" if family is BLACKWELL else "fp8"  # the indexer's auto is fp8
        dtype = "fp8_ds_mla" if family.flags[1] == "auto" else family.flags[1]  # what vLLM resolves auto to
        assert (fp["kv_cache_dtype"], fp["indexer_dtype"]) == (dtype, indexer)
    finally:
        eng.shutdown()


def test_a_restarted_daemon_still_hits(tmp_path: Path) -> None:
    port = free_port()
    d = start_daemon(tmp_path / "data", "--port", str(port))
    tokens = prompt("restart", BLOCKS)
    eng = engine(d.address)
    try:
        assert_miss(eng, "r1", tokens)
        assert d.stop() == 0
        d = start_daemon(tmp_path / "data", "--port", str(port))
    finally:
        eng.shutdown()
    eng = engine(d.address)
    try:
        assert_hit(eng, "r2", tokens)
    finally:
        eng.shutdown()
        d.stop()


def test_a_down_daemon_means_misses_never_a_stall_or_an_exception(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "data", "--port", str(free_port()))
    tokens = prompt("down", BLOCKS)
    eng = engine(d.address, timeout_s=2.0, down_s=60.0)
    eng.serve("r1", tokens)
    eng.shutdown()
    d.stop()
    eng = engine(d.address, timeout_s=2.0, down_s=60.0)
    try:
        t0 = time.monotonic()
        assert_miss(eng, "while-down", tokens, timeout_s=20)  # recomputed; its stores fail quietly
        assert time.monotonic() - t0 < 20
    finally:
        eng.shutdown()


def test_a_damaged_block_is_never_served(tmp_path: Path) -> None:
    port = free_port()
    d = start_daemon(tmp_path / "data", "--port", str(port), "--host-capacity-bytes", "0")
    tokens = prompt("damage", BLOCKS)
    eng = engine(d.address)
    eng.serve("r1", tokens)
    eng.shutdown()
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
    eng = engine(d.address)
    try:
        s = eng.serve("r2", tokens)
        assert all(s.loaded), "a block vLLM took as cached came back different"
        assert eng.hit_tokens(s) < BLOCKS * BLOCK_TOKENS  # the damaged block and what follows: recomputed
    finally:
        eng.shutdown()
        d.stop()


def test_two_tenants_sending_the_same_tokens_share_nothing(tmp_path: Path) -> None:
    """The tenant rule (README): a request sends its tenant's salt as vLLM's ``cache_salt`` and as
    ``kv_transfer_params["cache_salt"]``; the first separates vLLM's own caches and the block hashes,
    the second picks the tier's namespace and token."""
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text('[tokens]\n"tok-a" = ["team-a"]\n"tok-b" = ["team-b"]\n')
    d = start_daemon(tmp_path / "data", "--port", str(free_port()), "--tokens-file", str(tokens_file))
    tenants = {"salt-a": {"namespace": "team-a", "token": "tok-a"},
               "salt-b": {"namespace": "team-b", "token": "tok-b"}}
    tokens = prompt("tenants", BLOCKS)
    a, b = ({"salt": s, "params": {"cache_salt": s}} for s in ("salt-a", "salt-b"))
    eng = engine(d.address, namespace="team-a", token="tok-a", tenants=tenants)
    try:
        assert_miss(eng, "a1", tokens, **a)
        assert_miss(eng, "b1", tokens, **b)  # vLLM's own GPU and CPU caches do not serve A's blocks to B
        assert_miss(eng, "x1", tokens, salt="nobody", params={"cache_salt": "nobody"})  # unmapped: not offloaded
    finally:
        eng.shutdown()
    with Client(address=d.address, token="tok-a") as c:
        assert [s.chunks for s in c.list_sessions("team-a")] == [BLOCKS]
    with Client(address=d.address, token="tok-b") as c:
        assert [s.chunks for s in c.list_sessions("team-b")] == [BLOCKS]
    eng = engine(d.address, namespace="team-a", token="tok-a", tenants=tenants)
    try:
        assert_hit(eng, "a2", tokens, **a)
        assert_hit(eng, "b2", tokens, **b)
        assert_miss(eng, "x2", tokens, salt="nobody", params={"cache_salt": "nobody"})
    finally:
        eng.shutdown()
    eng = engine(d.address, namespace="team-a", token="tok-a", tenants=tenants)
    try:
        # the two salts disagree: vLLM's block hashes follow its cache_salt (B's) and the tier looks them up in
        # A's namespace: neither tenant's blocks (the tier cannot compare them: vLLM 0.33's ReqContext does not
        # carry cache_salt)
        assert_miss(eng, "mixed", tokens, salt="salt-b", params={"cache_salt": "salt-a"})
    finally:
        eng.shutdown()
        d.stop()


def test_another_engine_configuration_never_gets_these_blocks(daemon: Daemon) -> None:
    tokens = prompt("config", BLOCKS)
    eng = engine(daemon.address)
    try:
        eng.serve("r1", tokens)
        layout = eng.tiers[0].layout.layout_id
    finally:
        eng.shutdown()
    other = engine(daemon.address, FAMILIES["indexer-auto"])  # the same model and dtype, the fp8 indexer
    try:
        assert other.tiers[0].layout.layout_id != layout
        assert_miss(other, "r2", tokens)
    finally:
        other.shutdown()


def test_a_second_node_resumes_through_its_own_daemon_via_a_redis_cluster(tmp_path: Path) -> None:
    tokens = prompt("cluster", BLOCKS)
    with running_cluster(tmp_path / "cluster") as cluster:
        flags = cluster_flags(cluster.url)
        a = start_daemon(tmp_path / "a", "--port", str(free_port()), *flags)
        b = start_daemon(tmp_path / "b", "--port", str(free_port()), *flags)
        try:
            node_a = engine(a.address)
            node_a.serve("r1", tokens, params={"kvstore_session": "agent-7"})
            node_a.shutdown()
            node_b = engine(b.address)
            assert_hit(node_b, "r2", tokens)
            node_b.shutdown()
            with Client(address=b.address) as c:
                assert [s.session_id for s in c.list_sessions("vllm")] == ["agent-7"]
        finally:
            a.stop()
            b.stop()


def test_evict_and_prefetch_work_on_a_page_session(daemon: Daemon) -> None:
    tokens = prompt("evict", BLOCKS)
    eng = engine(daemon.address)
    eng.serve("r1", tokens, params={"kvstore_session": "agent-8"})
    eng.shutdown()
    with Client(address=daemon.address) as c:
        c.evict("vllm", "agent-8", "ssd")
        assert set(c.get_session("vllm", "agent-8")[1]) == {"ssd"}
        c.prefetch("vllm", "agent-8")
        assert c.wait_prefetched("vllm", "agent-8", timeout_s=20) is not None
    eng = engine(daemon.address)
    try:
        assert_hit(eng, "r2", tokens)
    finally:
        eng.shutdown()


def test_the_fs_tier_beside_it_hits_the_same_tokens_and_serves_damage(tmp_path: Path) -> None:
    """vLLM's own fs tier in the same engine: the same hit, token for token; but a damaged file is
    served as it is (no check on read), and its blocks keep the padding."""
    root = str(tmp_path / "fs")
    tokens = prompt("fs", BLOCKS)
    d = start_daemon(tmp_path / "data", "--port", str(free_port()))
    try:
        eng = Engine(BLACKWELL, [fs_tier(root), kvstore_tier(d.address)])
        eng.serve("r1", tokens)
        stride = eng.stride
        eng.shutdown()
        for tiers in ([fs_tier(root)], [kvstore_tier(d.address)]):
            eng = Engine(BLACKWELL, tiers)
            assert_hit(eng, "r2", tokens)
            eng.shutdown()
        files = sorted(Path(root).rglob("*.bin"))
        assert len(files) == BLOCKS and all(f.stat().st_size >= stride for f in files)  # padding and all
        data = bytearray(files[0].read_bytes())
        data[200] ^= 0xFF
        files[0].write_bytes(bytes(data))
        eng = Engine(BLACKWELL, [fs_tier(root)])
        s = eng.serve("r3", tokens)
        assert eng.hit_tokens(s) == BLOCKS * BLOCK_TOKENS and not all(s.loaded)  # wrong bytes served as a hit
        eng.shutdown()
    finally:
        d.stop()


def test_a_session_only_grows_across_turns_engines_and_restarts(daemon: Daemon) -> None:
    """Turn 2 extends turn 1's prompt; its prefix stays in vLLM's own caches (never looked up here): its
    save must not drop turn 1's blocks from the session; nor may a restarted engine's first save."""
    agent = {"kvstore_session": "agent-9"}
    turn1 = prompt("turn", 2)
    turn2 = turn1[: 2 * BLOCK_TOKENS] + prompt("turn-2", 2)
    eng = engine(daemon.address)
    try:
        eng.serve("t1", turn1, params=agent)
        eng.serve("t2", turn2, params=agent)
    finally:
        eng.shutdown()
    eng = engine(daemon.address)
    try:
        eng.serve("t3", prompt("turn-3", 1), params=agent)
    finally:
        eng.shutdown()
    with Client(address=daemon.address) as c:
        m, _ = c.get_session("vllm", "agent-9")
    assert len(m.chunk_keys) == 2 + 2 + 1
    eng = engine(daemon.address)
    try:
        assert_hit(eng, "t4", turn2)
    finally:
        eng.shutdown()


def test_a_backpressure_detector_in_the_tier_config_sees_this_tiers_jobs(daemon: Daemon) -> None:
    eng = engine(daemon.address, backpressure={"backpressure_cls": "EMABackpressureDetector"})
    try:
        det = eng.tiers[0].bp_detector
        assert det is not None
        eng.serve("r1", prompt("bp", BLOCKS))
        assert det.stats and not det.is_under_pressure()
    finally:
        eng.shutdown()


def test_interleaved_requests_store_and_load_their_own_bytes(daemon: Daemon) -> None:
    prompts = [prompt(f"conc-{i}", 3) for i in range(6)]
    eng = engine(daemon.address, n_load_threads=3, n_store_threads=3)
    try:
        for i, p in enumerate(prompts):  # one scheduler step: six prefills, six store jobs at once
            eng.send(f"c{i}", p)
        eng.run()
    finally:
        eng.shutdown()
    eng = engine(daemon.address, n_load_threads=3, n_store_threads=3)
    try:
        sent = [eng.send(f"l{i}", p) for i, p in enumerate(prompts)]  # their lookups and loads side by side
        eng.run()
        for s in sent:
            assert eng.hit_tokens(s) == 3 * BLOCK_TOKENS and s.loaded == [True] * 3
    finally:
        eng.shutdown()


def test_a_lookup_racing_an_in_flight_store_is_never_a_wrong_hit(daemon: Daemon) -> None:
    """A second request for the same prompt arrives while the first one's blocks are still being stored:
    whatever vLLM finds (its own CPU tier, or nothing yet), what it loads is right."""
    tokens = prompt("race", BLOCKS)
    eng = engine(daemon.address)
    try:
        eng.send("first", tokens)
        eng.step()
        second = eng.send("second", tokens)
        eng.run()
        assert all(second.loaded)
    finally:
        eng.shutdown()
    eng = engine(daemon.address)
    try:
        assert_hit(eng, "third", tokens)
    finally:
        eng.shutdown()


def test_jobs_larger_than_the_arena_are_one_call_each_the_daemon_reading_and_writing_the_slots(
        daemon: Daemon) -> None:
    """Same host: a store job is one turn save whose blocks the daemon reads from the primary's slots,
    a load job one call whose blocks it writes there; no arena (here smaller than one block) or stream."""
    tokens = prompt("arena", 5)
    with Client(address=daemon.address) as c:
        before = c.stats().transport
    eng = engine(daemon.address, arena_bytes=100_000)
    eng.serve("r1", tokens)
    eng.shutdown()
    eng = engine(daemon.address, arena_bytes=100_000)
    try:
        assert_hit(eng, "r2", tokens, blocks=5)
    finally:
        eng.shutdown()
    with Client(address=daemon.address) as c:
        after = c.stats().transport
    assert after.caller_memory_calls >= before.caller_memory_calls + 2, after  # a store and a load at least
    assert (after.arena_calls, after.stream_calls) == (before.arena_calls, before.stream_calls), after


def test_a_full_store_fails_saves_but_the_tier_keeps_serving_what_it_holds(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "data", "--port", str(free_port()), "--ssd-max-map-bytes", str(4 << 20))
    kept = prompt("kept", BLOCKS)
    eng = engine(d.address)
    try:
        eng.serve("r1", kept)  # ~0.9 MB: fits
        eng.serve("big", prompt("too-much", 24))  # ~5.5 MB more: refused
        assert "RESOURCE_EXHAUSTED" in d.log() or "full" in d.log()
    finally:
        eng.shutdown()
    eng = engine(d.address)
    try:
        assert_hit(eng, "r2", kept)  # a full disk is no reason to stop reading
    finally:
        eng.shutdown()
        d.stop()


def test_one_lookup_call_per_tenant_and_step_however_many_requests_wait(daemon: Daemon) -> None:
    tokens = prompt("lookups", 2)
    eng = engine(daemon.address)
    eng.serve("r1", tokens)
    eng.shutdown()
    eng = engine(daemon.address)
    try:
        with Client(address=daemon.address) as c:
            before = c.stats().lookups
        for i in range(6):  # six requests ask in the same step
            eng.send(f"w{i}", tokens)
        eng.step()
        time.sleep(0.5)
        with Client(address=daemon.address) as c:
            assert c.stats().lookups - before == 1
        eng.run()
    finally:
        eng.shutdown()


def test_a_session_of_another_layout_is_never_overwritten(daemon: Daemon) -> None:
    """An agent session of the reference client (token chunks) and a vLLM request naming the same
    session: the tier fails its own store jobs rather than replace the other session."""
    from tests.helpers.daemon import make_session, save_session

    with Client(address=daemon.address) as c:
        save_session(c, make_session(namespace="vllm", session_id="shared-name"))
        before = c.get_session("vllm", "shared-name")[0]
    eng = engine(daemon.address)
    try:
        eng.serve("r", prompt("clash", 2), params={"kvstore_session": "shared-name"})
    finally:
        eng.shutdown()
    with Client(address=daemon.address) as c:
        assert c.get_session("vllm", "shared-name")[0].chunk_keys == before.chunk_keys


def test_kv_events_say_what_this_tier_stored(daemon: Daemon) -> None:
    from vllm.distributed.kv_events import BlockStored

    eng = Engine(BLACKWELL, [kvstore_tier(daemon.address, enable_kv_events=True)], kv_events=True)
    try:
        eng.serve("r1", prompt("events", 2))
        stored = [h for b in eng.published for e in b.events if isinstance(e, BlockStored)
                  and (e.medium or "").upper() == "STORAGE" for h in e.block_hashes]
        assert len(stored) == 2, [e for b in eng.published for e in b.events]
    finally:
        eng.shutdown()


def test_a_block_no_derived_layout_fits_is_kept_whole_counted_and_said(daemon: Daemon,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A tier told the wrong indexer dtype (fp8 pages do not fit Blackwell's MXFP4 block): every block is one
    opaque page, still bit-exact, counted in the tier's stats and named in a warning, never silently."""
    tokens = prompt("opaque", 2)
    with caplog.at_level("WARNING", logger="kvstore.engines.vllm.tier"):
        eng = engine(daemon.address, indexer_dtype="fp8")
    try:
        assert eng.tiers[0].geometry.opaque and "match no derived page layout" in caplog.text
        eng.serve("r1", tokens)
        assert eng.tiers[0].stats.opaque_blocks == 2
    finally:
        eng.shutdown()
    eng = engine(daemon.address, indexer_dtype="fp8")
    try:
        assert_hit(eng, "r2", tokens, blocks=2)
    finally:
        eng.shutdown()
