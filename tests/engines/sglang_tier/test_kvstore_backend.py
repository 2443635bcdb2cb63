"""kvstore's own behaviour as SGLang 0.5.23's HiCache L3 for DeepSeek-V4.1, under SGLang's real controller
threads (harness.py), with real daemons (``kvstore serve`` on real ports, real LMDB files, a real Redis
Cluster): what a restart, a down daemon, a damaged record, another tenant, another configuration, a second
node and an ``swa`` pool do. The scenarios every backend runs (HiCacheFile beside it) are test_sglang_tier.py's.

Run in the SGLang environment (scripts/sglang_env.sh):
``.venv-sglang/bin/python -m pytest tests/engines/sglang_tier``."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
from harness import PAGE_TOKENS, V41_L3_POOLS, Engine, stop_orphaned_storage_threads
from test_sglang_tier import kvstore_backend, tokens, write

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo: tests.helpers

from kvstore.client import Client
from kvstore.engines.sglang.backend import TESTED_SGLANG, KVStoreHiCache, SwaPoolRefused
from kvstore.format.page_layout import INTERLEAVED, SPLIT
from tests.helpers.cluster import cluster_flags, running_cluster
from tests.helpers.daemon import Daemon, free_port, start_daemon, transport_stats

pytestmark = pytest.mark.timeout(180)
NS = "team-a"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path / "data", "--port", str(free_port()))
    yield d
    d.stop()


def backend_of(engine: Engine) -> KVStoreHiCache:
    b = engine.storage_backend
    assert isinstance(b, KVStoreHiCache)
    return b


def test_the_tested_sglang_version_is_the_one_installed() -> None:
    import sglang

    assert sglang.__version__ in TESTED_SGLANG


def test_a_chain_is_one_page_session_of_every_pool_at_890_bytes_a_token(daemon: Daemon) -> None:
    """The pages of one key chain are one page session in the server's namespace (kvstore sessions ls):
    every pool's page, the layout SGLang's pools make, the bytes SGLang holds; a longer turn of the same
    chain grows the same session."""
    kv = kvstore_backend(daemon.address, NS)
    toks = tokens(3, seed=11)
    stored = write(kv, toks)
    with kv.engine() as engine:
        b = backend_of(engine)
        assert b.geometry is not None and b.geometry.bytes_per_token == 890.0 and not b.geometry.opaque
        layout = b.geometry.layout
    with Client(address=daemon.address) as c:
        (s,) = c.list_sessions(NS)
        assert s.session_id == f"sglang-{layout.layout_hex[:12]}-{stored.keys[0][:32]}"
        assert s.chunks == 3 * len(V41_L3_POOLS)
        assert s.token_count == 0  # SGLang hands no prefix keys by default: the pages' positions are not known
        m, where = c.get_session(NS, s.session_id)
        assert m.layout_id == layout.layout_id and len(m.chunk_keys) == 12 and set(where) == {"host"}
    longer = tokens(5, seed=11)  # the next turn: the same chain, two pages more
    write(kv, longer)
    with Client(address=daemon.address) as c:
        (s,) = c.list_sessions(NS)
        assert s.chunks == 5 * len(V41_L3_POOLS)


def test_with_prefix_keys_a_conversation_is_one_session_and_a_branch_its_own(daemon: Daemon) -> None:
    """With SGLang's ``hicache_storage_pass_prefix_keys`` the backend learns which page a written node follows:
    the next turn's pages (a child node) join the session of the conversation they continue, which knows its
    length; a second conversation branching off the same prompt is a session of its own (the prompt's pages
    stay in the first one's), and both resume whole."""
    kv = kvstore_backend(daemon.address, NS, hicache_storage_pass_prefix_keys=True)
    prompt = tokens(2, seed=12)
    first = tokens(5, seed=12)  # the prompt, then three pages of one conversation
    second = prompt[: 2 * PAGE_TOKENS] + tokens(2, seed=13)[: 2 * PAGE_TOKENS] + [7]  # the prompt, then another two
    with kv.engine() as engine:
        assert engine.write_through(prompt).completed_tokens == 2 * PAGE_TOKENS
        assert engine.write_through(first, after=2).completed_tokens == 3 * PAGE_TOKENS
        assert engine.write_through(second, after=2).completed_tokens == 2 * PAGE_TOKENS
    with Client(address=daemon.address) as c:
        sessions = sorted((s.token_count, s.chunks) for s in c.list_sessions(NS))
    assert sessions == [(4 * PAGE_TOKENS, 2 * len(V41_L3_POOLS)), (5 * PAGE_TOKENS, 5 * len(V41_L3_POOLS))]
    with kv.engine() as engine:
        assert engine.prefetch(first).hit_pages == 5 and engine.prefetch(second).hit_pages == 4
        # a restarted server knows no conversation's last page yet: its next turn starts a session
        assert engine.write_through(tokens(6, seed=12), after=5).completed_tokens == PAGE_TOKENS
    with Client(address=daemon.address) as c:
        assert len(c.list_sessions(NS)) == 3


def test_pages_of_a_layer_first_host_pool_are_the_same_pages(daemon: Daemon) -> None:
    """``--hicache-mem-layout layer_first`` keeps a page's layers apart (no slot to read or write whole): the
    backend gathers and scatters them through the pool, and the stored pages are the ones a ``page_first``
    server stores and loads: each loads into the other, bit-exact."""
    kv = kvstore_backend(daemon.address, NS)
    toks, other = tokens(3, seed=22), tokens(2, seed=23)
    with kv.engine(mem_layout="layer_first") as engine:
        assert {e.host_pool.layout for e in engine.host_pool_group.entries if e.host_pool.layer_num} == {"layer_first"}
        stored = engine.write_through(toks)
        assert stored.completed_tokens == 3 * PAGE_TOKENS
    with kv.engine() as engine:
        assert engine.prefetch(toks).pool_pages == stored.pool_pages
        stored_pf = engine.write_through(other)
    with kv.engine(mem_layout="layer_first") as engine:
        assert engine.prefetch(other).pool_pages == stored_pf.pool_pages


def test_a_restarted_daemon_still_hits(tmp_path: Path) -> None:
    port = free_port()
    d = start_daemon(tmp_path / "data", "--port", str(port))
    kv = kvstore_backend(d.address, NS)
    toks = tokens(3, seed=13)
    stored = write(kv, toks)
    d.stop()
    d = start_daemon(tmp_path / "data", "--port", str(port))
    try:
        with kv.engine() as engine:
            loaded = engine.prefetch(toks)
        assert loaded.hit_pages == 3 and loaded.pool_pages == stored.pool_pages
    finally:
        d.stop()


def test_a_down_daemon_means_misses_never_a_stall_or_an_exception(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "data", "--port", str(free_port()))
    kv = kvstore_backend(d.address, NS, timeout_s=2.0, down_s=60.0)
    toks = tokens(2, seed=14)
    write(kv, toks)
    d.stop()
    t0 = time.monotonic()
    with kv.engine() as engine:  # attaches without the daemon: it may start after SGLang
        assert engine.prefetch(toks).hit_tokens == 0
        assert engine.write_through(tokens(2, seed=15)).completed_tokens == 0  # its stores fail quietly
        assert engine.prefetch(toks).hit_tokens == 0
    assert time.monotonic() - t0 < 30  # each call failed fast; no harness timeout (30 s a call) was reached


def test_a_damaged_record_is_a_miss_and_the_pages_before_it_load(tmp_path: Path) -> None:
    port = free_port()
    d = start_daemon(tmp_path / "data", "--port", str(port), "--host-capacity-bytes", "0")
    kv = kvstore_backend(d.address, NS)
    toks = tokens(4, seed=16)
    stored = write(kv, toks)
    with kv.engine() as engine:
        victim = backend_of(engine)._key("deepseek_v4_c2", stored.keys[2])
    d.stop()
    env = lmdb.open(str(tmp_path / "data" / "ssd"), max_dbs=4, subdir=True)
    db = env.open_db(b"chunks", create=False)
    with env.begin(write=True, db=db) as txn:
        record = txn.get(victim)
        assert record is not None
        rec = bytearray(record)
        rec[300] ^= 0xFF  # inside the page's data rows (kept raw): the blob's checksum no longer holds
        txn.put(victim, bytes(rec))
    env.close()
    d = start_daemon(tmp_path / "data", "--port", str(port), "--host-capacity-bytes", "0")
    try:
        with kv.engine() as engine:
            loaded = engine.prefetch(toks)
            again = engine.prefetch(toks)  # the damaged copy was dropped: now a miss from the query on
        for got in (loaded, again):
            assert got.hit_pages == 2, got
            assert got.pool_pages == {pool: pages[:2] for pool, pages in stored.pool_pages.items()}
    finally:
        d.stop()


def test_two_tenants_with_the_same_tokens_and_salt_share_nothing(daemon: Daemon) -> None:
    """Two SGLang servers on one daemon, each its own namespace: the same tokens and the same ``cache_salt``
    make the same SGLang keys, and still neither reads the other's pages (HiCacheFile has only the salt)."""
    toks = tokens(2, seed=17)
    a, b = kvstore_backend(daemon.address, "tenant-a"), kvstore_backend(daemon.address, "tenant-b")
    stored = write(a, toks, cache_salt="shared-salt")
    with b.engine() as engine:
        assert engine.prefetch(toks, cache_salt="shared-salt").hit_tokens == 0
    with a.engine() as engine:
        own = engine.prefetch(toks, cache_salt="shared-salt")
    assert own.hit_pages == 2 and own.pool_pages == stored.pool_pages
    with Client(address=daemon.address) as c:
        assert len(c.list_sessions("tenant-a")) == 1 and c.list_sessions("tenant-b") == []


def test_another_record_family_never_gets_these_pages(daemon: Daemon) -> None:
    """Hopper's V4 records and SM100's V4.1 FP4 ones are other page layouts: never served to each other."""
    kv = kvstore_backend(daemon.address, NS)
    toks = tokens(2, seed=18)
    write(kv, toks, family="sm100")
    with kv.engine("hopper") as engine:
        assert engine.prefetch(toks).hit_tokens == 0
        hopper = backend_of(engine).geometry
        assert hopper is not None and hopper.layout.bytes_per_token == 1630
    stored = write(kv, toks, family="hopper")
    with kv.engine("hopper") as engine:
        loaded = engine.prefetch(toks)
    assert loaded.hit_pages == 2 and loaded.pool_pages == stored.pool_pages


def test_a_second_node_resumes_through_its_own_daemon_via_a_redis_cluster(tmp_path: Path) -> None:
    toks = tokens(3, seed=19)
    with running_cluster(tmp_path / "cluster") as cluster:
        flags = cluster_flags(cluster.url)
        a = start_daemon(tmp_path / "a", "--port", str(free_port()), *flags)
        b = start_daemon(tmp_path / "b", "--port", str(free_port()), *flags)
        try:
            stored = write(kvstore_backend(a.address, NS), toks)
            with kvstore_backend(b.address, NS).engine() as engine:
                loaded = engine.prefetch(toks)
            assert loaded.hit_pages == 3 and loaded.pool_pages == stored.pool_pages
            with Client(address=b.address) as c:
                (s,) = c.list_sessions(NS)
                assert s.session_id.startswith("sglang-") and s.session_id.endswith(stored.keys[0][:32])
        finally:
            a.stop()
            b.stop()


def test_an_swa_pool_is_refused_at_attach_naming_the_flag(daemon: Daemon) -> None:
    """SGLang without --enable-encoder-swa-bounded-replay registers an ``swa`` pool: the backend refuses it
    where it is registered, so the server does not start with a silent 0% hit rate."""
    kv = kvstore_backend(daemon.address, NS)
    assert stop_orphaned_storage_threads() == 0
    with pytest.raises(SwaPoolRefused, match="--enable-encoder-swa-bounded-replay"):
        kv.engine(replay=False)
    stop_orphaned_storage_threads()  # SGLang leaves its storage threads of the failed attach running
    with Client(address=daemon.address) as c:
        assert c.list_sessions(NS) == []


def test_evict_and_prefetch_work_on_the_chains_session(daemon: Daemon) -> None:
    kv = kvstore_backend(daemon.address, NS)
    toks = tokens(2, seed=20)
    stored = write(kv, toks)
    with Client(address=daemon.address) as c:
        (s,) = c.list_sessions(NS)
        sid = s.session_id
        c.evict(NS, sid, "ssd")
        assert set(c.get_session(NS, sid)[1]) == {"ssd"}
        c.prefetch(NS, sid)
        assert c.wait_prefetched(NS, sid, timeout_s=20) is not None
    with kv.engine() as engine:
        loaded = engine.prefetch(toks)
    assert loaded.hit_pages == 2 and loaded.pool_pages == stored.pool_pages


def test_clearing_the_storage_deletes_this_servers_sessions_only(daemon: Daemon) -> None:
    mine, other = kvstore_backend(daemon.address, NS), kvstore_backend(daemon.address, "other")
    toks = tokens(2, seed=21)
    write(mine, toks)
    write(other, toks)
    with mine.engine() as engine:
        assert engine.controller.clear_storage_backend()
        assert engine.prefetch(toks).hit_tokens == 0
    with Client(address=daemon.address) as c:
        assert c.list_sessions(NS) == [] and len(c.list_sessions("other")) == 1
    stored = write(mine, toks)  # and the server stores again after it
    with mine.engine() as engine:
        assert engine.prefetch(toks).pool_pages == stored.pool_pages


def test_every_pool_of_a_load_is_one_call_into_the_host_slots(daemon: Daemon) -> None:
    """``batch_get_v2`` loads the pages of all four pools (each in a host buffer of its own) in one
    ``load_page_regions`` call: one LoadChunks the daemon writes into every pool's slots, bit-exact."""
    kv = kvstore_backend(daemon.address, NS)
    toks = tokens(3, seed=24)
    stored = write(kv, toks)
    with kv.engine() as engine:
        b = backend_of(engine)
        calls: list[int] = []
        get = b.batch_get_v2

        def counted(transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
            calls.append(len({str(t.name) for t in transfers if t.keys}))
            return get(transfers, extra_info)

        b.batch_get_v2 = counted  # type: ignore[method-assign]
        before = transport_stats(daemon).caller_memory_calls
        loaded = engine.prefetch(toks)
        after = transport_stats(daemon).caller_memory_calls
    assert loaded.hit_pages == 3 and loaded.pool_pages == stored.pool_pages
    assert calls and all(n == len(V41_L3_POOLS) for n in calls if n)
    assert after - before == sum(1 for n in calls if n)  # one call each, for all four pools


# --- the geometry kvstore derives from the pools SGLang builds ------------------------------------------

def device_records(engine: Engine) -> dict[str, str]:
    """Per host pool, the record of the device pool it mirrors as SGLang built it (the ``KVLayout`` of each
    ratio's KV pool, FP4 or FP8 rows of its indexer pool): what the backend, which sees only the host pools'
    sizes, must find."""
    kv = engine.kvcache
    out = {f"deepseek_v4_c{r}": str(p.kv_layout.value) for r, p in kv.kv_pools.items()}
    out.update({f"deepseek_v4_c{r}_indexer": f"indexer-{'mxfp4' if p.use_fp4_indexer else 'fp8'}-{kv.indexer_head_dim}"
                for r, p in kv.index_pools.items()})
    return out


@pytest.mark.parametrize(("family", "kv_layout"), [("sm100", None), ("sm100", "v41_new"), ("hopper", None)])
def test_each_pool_is_stored_as_the_record_of_the_device_pool_it_mirrors(
        daemon: Daemon, monkeypatch: pytest.MonkeyPatch, family: str, kv_layout: str | None) -> None:
    """SM100's block-split V4.1 records, its interleaved ones (``SGLANG_DSV4_KV_LAYOUT=v41_new``) and Hopper's V4
    records: each pool's record found from its host pool's size alone is the one SGLang's device pool holds,
    named in the layout's fingerprint; no pool is stored opaque."""
    if kv_layout is not None:
        monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", kv_layout)
    with kvstore_backend(daemon.address, NS).engine(family) as engine:
        g = backend_of(engine).geometry
        want = device_records(engine)
        assert g is not None and not g.opaque and len(want) == len(V41_L3_POOLS)
        assert {n: p.record.name for n, p in g.pools.items() if p.record is not None} == want
        fingerprint = dict(g.layout.fingerprint)
        assert all(fingerprint[f"pool.{n}"].endswith(f"record={r}") for n, r in want.items())


def test_sglangs_interleaved_records_are_another_layout_of_the_same_sizes(daemon: Daemon,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The interleaved arrangement SGLang picks under ``SGLANG_DSV4_KV_LAYOUT=v41_new`` holds records of the size
    of the block-split ones, in other bytes: its pages are another layout, never served for the other's."""
    kv = kvstore_backend(daemon.address, NS)
    toks = tokens(2, seed=21)
    write(kv, toks)  # block-split (SGLang's default on SM100)
    with kv.engine() as engine:
        split = backend_of(engine).geometry
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v41_new")
    with kv.engine() as engine:
        inter = backend_of(engine).geometry
        assert engine.prefetch(toks).hit_tokens == 0
    assert split is not None and inter is not None
    assert {n: p.page_bytes for n, p in inter.pools.items()} == {n: p.page_bytes for n, p in split.pools.items()}
    assert inter.layout.layout_id != split.layout.layout_id
    for g, arrangement in ((split, SPLIT), (inter, INTERLEAVED)):
        c2 = g.layout.group(g.groups["deepseek_v4_c2"])
        assert c2 is not None and {p.arrangement for p in c2.pages} == {arrangement}
    stored = write(kv, toks)  # the interleaved pages saved too: each layout serves its own
    with kv.engine() as engine:
        loaded = engine.prefetch(toks)
    assert loaded.hit_pages == 2 and loaded.pool_pages == stored.pool_pages
