"""HiCache L3 scenarios for DeepSeek-V4.1 against SGLang 0.5.23's own machinery (harness.py), per L3 backend.

Every test takes the ``backend`` fixture: the backend's ``--hicache-storage-backend`` value and its extra config,
with whatever service it needs running. ``file`` is SGLang's own ``HiCacheFile`` (a temp directory);
``dynamic-file`` is the same HiCacheFile loaded the way kvstore's backend is (``--hicache-storage-backend dynamic``,
module_path/class_name in the extra config: recording_backend.py), recording the calls it gets; ``kvstore`` is
kvstore's backend (``kvstore.engines.sglang.backend.KVStoreHiCache``) on a real daemon (``kvstore serve`` on a
real port and data directory). Tests of one backend's own behaviour build it directly (kvstore's:
test_kvstore_backend.py).

Run in the SGLang environment (scripts/sglang_env.sh)::

    .venv-sglang/bin/python -m pytest -q tests/engines/sglang_tier
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import recording_backend
from harness import (
    PAGE_TOKENS,
    SERVED_MODEL,
    V41_L3_POOLS,
    Engine,
    Stored,
    expected_page_bytes,
    page_keys,
    stop_orphaned_storage_threads,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo: tests.helpers

from tests.helpers.daemon import free_port, start_daemon

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class Backend:
    name: str  # the test id: "file", later "kvstore"
    storage_backend: str  # --hicache-storage-backend
    extra_config: dict[str, Any]  # --hicache-storage-backend-extra-config
    path: Path | None = None  # HiCacheFile's directory

    def engine(self, family: str = "sm100", **kwargs: Any) -> Engine:
        return Engine(family, self.storage_backend, self.extra_config, **kwargs)


def file_backend(path: Path) -> Backend:
    return Backend("file", "file", {"file_storage_path": str(path)}, path)


def dynamic_file_backend(path: Path) -> Backend:
    recording_backend.CALLS.clear()
    recording_backend.CONFIGS.clear()
    return Backend("dynamic-file", "dynamic", {"backend_name": "recording-file", "module_path": "recording_backend",
                                               "class_name": "RecordingHiCacheFile", "file_storage_path": str(path),
                                               "namespace": "tests"}, path)


def kvstore_backend(address: str, namespace: str = "team-a", **extra: Any) -> Backend:
    """kvstore's backend as the README's command line loads it (``--hicache-storage-backend dynamic``)."""
    return Backend("kvstore", "dynamic", {"backend_name": "kvstore", "module_path": "kvstore.engines.sglang.backend",
                                          "class_name": "KVStoreHiCache", "address": address,
                                          "namespace": namespace, **extra})


@pytest.fixture(params=["file", "dynamic-file", "kvstore"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Each L3 backend, its service running. Tests of one backend's own behaviour build that backend directly."""
    if request.param == "file":
        yield file_backend(tmp_path / "hicache")
    elif request.param == "dynamic-file":
        yield dynamic_file_backend(tmp_path / "hicache")
    elif request.param == "kvstore":
        daemon = start_daemon(tmp_path / "kvstore", "--port", str(free_port()))
        try:
            yield kvstore_backend(daemon.address)
        finally:
            daemon.stop()
    else:  # pragma: no cover - the parameter list above names every backend
        raise AssertionError(request.param)


def tokens(n_pages: int, seed: int = 0, tail: int = 17) -> list[int]:
    """A prompt of ``n_pages`` whole pages plus a partial page (never stored)."""
    return [(seed * 1_000_003 + i * 7919) % 129_280 for i in range(n_pages * PAGE_TOKENS + tail)]


def write(backend: Backend, toks: list[int], family: str = "sm100", cache_salt: str | None = None) -> Stored:
    with backend.engine(family) as engine:
        stored = engine.write_through(toks, cache_salt)
    n = len(stored.keys)
    assert stored.completed_tokens == n * PAGE_TOKENS
    assert stored.pool_results == {pool: n for pool in V41_L3_POOLS}
    return stored


# --- geometry: what SGLang builds for V4.1 -------------------------------------------------------------

#: (layer_num, item_bytes per layer per page) of each pool SGLang writes to L3, per record family
GEOMETRY = {
    "sm100": {"deepseek_v4_c2": (3, 36_864), "deepseek_v4_c2_indexer": (3, 8_704),
              "deepseek_v4_c1": (1, 73_728), "deepseek_v4_c1_indexer": (1, 17_408)},
    "hopper": {"deepseek_v4_c2": (3, 74_880), "deepseek_v4_c2_indexer": (3, 8_704),
               "deepseek_v4_c1": (1, 149_760), "deepseek_v4_c1_indexer": (1, 17_408)},
}


@pytest.mark.parametrize("family", ["sm100", "hopper"])
def test_v41_pools_and_their_geometry(backend: Backend, family: str) -> None:
    with backend.engine(family) as engine:
        assert engine.strategy_name == "_DeepSeekV4Strategy"
        assert engine.pool_names() == ["kv", *sorted(V41_L3_POOLS)]  # no swa pool under bounded replay
        geometry = engine.geometry()
        assert {name: (g.layer_num, g.item_bytes) for name, g in geometry.items()} == GEOMETRY[family]
        assert all(g.page_tokens == PAGE_TOKENS and g.hit_policy == "all_pages" for g in geometry.values())
        per_token = sum(g.page_bytes for g in geometry.values()) / PAGE_TOKENS
        assert per_token == {"sm100": 890.0, "hopper": 1632.5}[family]
        config = engine.controller.storage_config
        assert (config.tp_rank, config.tp_size, config.pp_rank, config.pp_size) == (0, 1, 0, 1)
        assert config.is_mla_model and config.is_page_first_layout and config.is_storage_writer
        assert all(entry.host_pool.layout == "page_first" for entry in engine.host_pool_group.entries)


def test_page_keys_are_sglangs_salted_chain() -> None:
    toks = tokens(3)
    keys = page_keys(toks)
    assert len(keys) == 3 and all(len(k) == 64 for k in keys)
    assert page_keys(toks[: 2 * PAGE_TOKENS]) == keys[:2]  # a chain: a prefix's keys are the prefix of the keys
    salted = page_keys(toks, cache_salt="tenant-a")
    assert not set(salted) & set(keys) and not set(salted) & set(page_keys(toks, cache_salt="tenant-b"))


# --- scenarios ---------------------------------------------------------------------------------------

def page_files(path: Path, key: str, pool: str) -> list[Path]:
    """HiCacheFile's files of one pool's page: ``<key>.<pool><config suffix>.bin``."""
    return [f for f in path.glob(f"{key}.{pool}_*.bin") if not f.name.startswith(f"{key}.{pool}_indexer")]


@pytest.mark.parametrize("family", ["sm100", "hopper"])
def test_write_through_then_prefetch_loads_bit_exact(backend: Backend, family: str) -> None:
    toks = tokens(4, seed=1)
    with backend.engine(family) as engine:
        stored = engine.write_through(toks)
        assert stored.completed_tokens == 4 * PAGE_TOKENS
        loaded = engine.prefetch(toks)  # same engine: its host pages were freed, L3 serves the prefix
    assert (loaded.queried_tokens, loaded.hit_tokens) == (4 * PAGE_TOKENS, 4 * PAGE_TOKENS)
    assert loaded.pool_pages == stored.pool_pages
    for pool, pages in loaded.pool_pages.items():
        g = GEOMETRY[family][pool]
        assert pages == [expected_page_bytes(pool, key, *g) for key in stored.keys]


def test_a_restarted_engine_still_hits(backend: Backend) -> None:
    toks = tokens(3, seed=2)
    stored = write(backend, toks)
    with backend.engine() as restarted:  # fresh device and host pools, a new controller and backend instance
        loaded = restarted.prefetch(toks)
        longer = restarted.prefetch(toks + tokens(2, seed=99))  # the stored prefix of a longer prompt
    assert loaded.hit_pages == 3 and loaded.pool_pages == stored.pool_pages
    assert longer.hit_pages == 3 and longer.pool_pages == stored.pool_pages


def test_an_unknown_prompt_misses(backend: Backend) -> None:
    write(backend, tokens(2, seed=3))
    with backend.engine() as engine:
        loaded = engine.prefetch(tokens(2, seed=4))
    assert (loaded.queried_tokens, loaded.hit_tokens, loaded.pool_pages) == (0, 0, {})


def test_tenants_with_different_cache_salts_do_not_see_each_others_pages(backend: Backend) -> None:
    toks = tokens(2, seed=5)
    stored_a = write(backend, toks, cache_salt="tenant-a")
    with backend.engine() as engine:
        assert engine.prefetch(toks, cache_salt="tenant-b").hit_tokens == 0
        assert engine.prefetch(toks).hit_tokens == 0  # nor does an unsalted request
        own = engine.prefetch(toks, cache_salt="tenant-a")
    assert own.hit_pages == 2 and own.pool_pages == stored_a.pool_pages


def test_hicache_file_serves_a_damaged_page_and_stops_at_a_removed_one(tmp_path: Path) -> None:
    """HiCacheFile keeps raw page bytes without a checksum: a page whose bytes changed (same length) is served
    as is, and loads compare unequal; a removed page file ends the hit before that page (the KV prefix walk in
    batch_exists_v2 stops there); a truncated one aborts the whole read (its short-read IOError escapes
    HiCacheFile.get, and the controller logs it and loads nothing)."""
    backend = file_backend(tmp_path / "hicache")
    assert backend.path is not None
    toks = tokens(4, seed=6)
    stored = write(backend, toks)
    files = page_files(backend.path, stored.keys[1], "deepseek_v4_c2")
    assert len(files) == 1 and files[0].stat().st_size == 110_592
    damaged = bytearray(files[0].read_bytes())
    damaged[1000] ^= 0xFF
    files[0].write_bytes(bytes(damaged))
    with backend.engine() as engine:
        served = engine.prefetch(toks)
    assert served.hit_pages == 4
    assert served.pool_pages["deepseek_v4_c2"][1] == bytes(damaged) != stored.pool_pages["deepseek_v4_c2"][1]
    assert [served.pool_pages["deepseek_v4_c2"][i] for i in (0, 2, 3)] == [stored.pool_pages["deepseek_v4_c2"][i]
                                                                          for i in (0, 2, 3)]

    (c1_page_2,) = page_files(backend.path, stored.keys[2], "deepseek_v4_c1")
    c1_page_2.unlink()
    with backend.engine() as engine:
        cut = engine.prefetch(toks)
    assert cut.hit_pages == 2
    assert cut.pool_pages["deepseek_v4_c1"] == stored.pool_pages["deepseek_v4_c1"][:2]

    files[0].write_bytes(bytes(damaged[:1000]))  # truncated
    with backend.engine() as engine:
        truncated = engine.prefetch(toks)
    assert truncated.queried_tokens == 2 * PAGE_TOKENS and truncated.hit_tokens == 0


def test_the_failure_injector_raises_nothing_and_what_loads_is_bit_exact(backend: Backend,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's StorageBackendFactory wraps the backend in HiCacheStorageFailureInjector when
    SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE is set: each storage call fails (raises or answers "no")
    with that probability. The controller absorbs the failures; whatever it reports loaded is exact."""
    toks = tokens(3, seed=7)
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    stored_pages: dict[str, list[bytes]] | None = None
    writes, hits = [], []
    for _ in range(4):
        with backend.engine() as engine:
            assert type(engine.storage_backend).__name__ == "HiCacheStorageFailureInjector"
            stored = engine.write_through(toks)
            writes.append(stored.completed_tokens)
            stored_pages = stored.pool_pages
    assert stored_pages is not None
    for _ in range(6):
        with backend.engine() as engine:
            loaded = engine.prefetch(toks)
        hits.append(loaded.hit_pages)
        for pool, pages in loaded.pool_pages.items():
            assert len(pages) == loaded.hit_pages
            assert pages == stored_pages[pool][: loaded.hit_pages]
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "1")  # every call fails
    other = tokens(2, seed=70)
    with backend.engine() as engine:
        assert engine.write_through(other).completed_tokens == 0
        assert (engine.prefetch(toks).hit_tokens, engine.prefetch(other).hit_tokens) == (0, 0)
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE")
    with backend.engine() as engine:
        assert engine.prefetch(other).hit_tokens == 0  # nothing of it reached the store
    with backend.engine() as engine:
        assert type(engine.storage_backend).__name__ != "HiCacheStorageFailureInjector"
        clean = engine.prefetch(toks)
    assert all(w in (0, 3 * PAGE_TOKENS) for w in writes)
    # nothing stored (every write failed: p = 0.3 a call, two calls a write) is a miss: no pool's pages at all
    assert clean.pool_pages == ({pool: pages[: clean.hit_pages] for pool, pages in stored_pages.items()}
                                if clean.hit_pages else {})
    assert len(hits) == 6 and os.environ.get("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE") is None


@pytest.mark.parametrize(("family", "swa_item_bytes"), [("sm100", 135_168), ("hopper", 149_760)])
def test_hicache_file_takes_the_swa_pool_registered_without_the_replay_flag(tmp_path: Path, family: str,
                                                                           swa_item_bytes: int) -> None:
    """Without --enable-encoder-swa-bounded-replay SGLang builds a paged SWA pool (a tree component of its own,
    every layer: ~5.8 MB a page on SM100, ~6.4 MB on Hopper) and registers it with the L3 backend. HiCacheFile
    refuses no pool: it takes it, and the KV-derived pools still round-trip."""
    backend = file_backend(tmp_path / "hicache")
    toks = tokens(2, seed=8)
    with backend.engine(family, replay=False) as engine:
        assert engine.pool_names() == ["kv", "swa", *sorted(V41_L3_POOLS)]
        assert "swa" in [str(getattr(k, "value", k)) for k in engine.storage_backend.registered_pools]
        swa = engine.geometry()["swa"]
        assert (swa.layer_num, swa.item_bytes, swa.hit_policy) == (43, swa_item_bytes, "component")
        stored = engine.write_through(toks)
        loaded = engine.prefetch(toks)
    assert stored.completed_tokens == 2 * PAGE_TOKENS and loaded.pool_pages == stored.pool_pages


def test_a_backend_that_refuses_the_swa_pool_stops_the_engine_start(tmp_path: Path) -> None:
    """What SGLang does when a backend refuses the ``swa`` pool at registration (recording_backend's
    SwaRefusingHiCacheFile, loaded as kvstore's is): the error leaves the controller's construction, so the
    engine does not start, and the message reaches the operator. SGLang has started the storage threads by then
    and leaves them running. With the replay flag the same backend attaches."""
    extra = {"backend_name": "swa-refusing", "module_path": "recording_backend",
             "class_name": "SwaRefusingHiCacheFile", "file_storage_path": str(tmp_path / "hicache")}
    assert stop_orphaned_storage_threads() == 0
    with pytest.raises(ValueError, match="swa pool refused"):
        Engine("sm100", "dynamic", extra, replay=False)
    assert stop_orphaned_storage_threads() == 4  # prefetch, prefetch-IO, prefetch-sync, backup
    with Engine("sm100", "dynamic", extra) as engine:
        assert "swa" not in engine.pool_names() and engine.controller.enable_storage


def test_how_the_controller_calls_a_dynamic_backend(tmp_path: Path) -> None:
    """What a dynamic L3 backend gets from SGLang 0.5.23 for V4.1 (recorded by recording_backend.py)."""
    backend = dynamic_file_backend(tmp_path / "hicache")
    toks = tokens(3, seed=9)
    write(backend, toks)
    with backend.engine() as engine:
        assert engine.prefetch(toks).hit_pages == 3
    (config, _) = recording_backend.CONFIGS
    assert config.extra_config == backend.extra_config  # every key of the JSON, backend_name etc. included
    assert (config.tp_rank, config.tp_size, config.pp_rank, config.pp_size) == (0, 1, 0, 1)
    assert config.model_name == SERVED_MODEL  # --served-model-name, as SGLang's assembler passes it
    assert config.is_mla_model and config.is_page_first_layout
    calls = [(c.thread.split("(")[-1].rstrip(")"), c.method, c.keys, tuple(c.pools), c.prefix_keys)
             for c in recording_backend.CALLS]
    pools = tuple(sorted(V41_L3_POOLS))
    attach = [("MainThread", "__init__", 0, (), None), ("MainThread", "register_mem_pool_host", 0, (), None),
              ("MainThread", "register_mem_host_pool_v2", 0, ("kv",), None),
              *[("MainThread", "register_mem_host_pool_v2", 0, (pool,), None) for pool in pools],
              ("MainThread", "on_host_pools_registered", 0, (), None)]
    assert calls == [
        *attach,
        # write_storage: the backup thread stores the four pools in one v2 call, then the data-less kv anchor
        # through the v1 batch_set (one 0-byte page per key)
        ("backup_thread_func", "batch_set_v2", 3, pools, None), ("backup_thread_func", "batch_set", 3, (), None),
        ("MainThread", "close", 0, (), None),
        *attach,
        # prefetch: the query thread asks for every page at once; the IO thread reads the kv anchor (v1), the
        # kv-derived pools (v2, one call per 128-page batch), then the non-kv-derived sidecars: none, an empty call
        ("prefetch_thread_func", "batch_exists_v2", 3, pools, None),
        ("prefetch_io_aux_func", "batch_get", 3, (), None), ("prefetch_io_aux_func", "batch_get_v2", 3, pools, None),
        ("prefetch_io_aux_func", "batch_get_v2", 0, (), None),
        ("MainThread", "close", 0, (), None),
    ]
