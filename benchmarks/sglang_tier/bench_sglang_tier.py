"""kvstore as SGLang's HiCache L3 vs SGLang's own ``HiCacheFile``, on the same DeepSeek-V4.1 pages.

    PYTHONPATH=. .venv-sglang/bin/python benchmarks/sglang_tier/bench_sglang_tier.py [--pages 512] [--reps 3] [--write]

Both backends are built by SGLang 0.5.23's own ``StorageBackendFactory`` inside
``tests/engines/sglang_tier/harness.py``'s ``Engine`` (SGLang's real V4.1 device pools, its DSV4 host
stack and ``HybridCacheController``; record family ``sm100``: ``v41_fp4`` main KV + MXFP4 indexer,
890 B/token, a 256-token page is 227,840 B over the four pools ``deepseek_v4_c2``, ``_c2_indexer``,
``_c1``, ``_c1_indexer``): ``file`` is ``HiCacheFile`` (``--hicache-storage-backend file``), ``kvstore``
is ``KVStoreHiCache`` (``dynamic``) on a real ``kvstore serve`` (the project's venv), both with
``hicache_storage_pass_prefix_keys``. The backends' own calls are timed, driven directly with
``PoolTransfer``s over SGLang's host pools as the controller's threads call them (one ``batch_set_v2``
per 128-page batch with all four pools, ``prefix_keys`` the chain before it, as the backup thread does;
one ``batch_get_v2`` per 128-page batch as the prefetch-IO thread does; ``batch_exists_v2`` over the
whole chain as the query thread does), so no controller queueing is in the numbers. The data-less
``kv`` anchor is written after each batch through the controller's own ``page_set_func`` (HiCacheFile
keeps a 0-byte file per page for it; ``batch_exists_v2`` needs it) and timed apart.

Pages are real V4.1 data in SGLang's block-split arrangement (per layer item: every record's data row,
then every record's scale row): Gaussian KV with a per-channel sigma ~ LogNormal(0, 0.5) quantized by
kvstore's own quantizers (``quantize_main``: 256 B E2M1 + 32 B E4M3 per record; ``quantize_indexer``:
64 B + 4 B UE8M0), ``POOL`` distinct pages per pool reused under different keys (content picked by
the key), so bytes at rest are what real pages give.

Sides, each on a fresh directory of the same file system (``/work``), in rotating order per repetition:
``file`` (HiCacheFile: temp file + ``os.replace``, never fsyncs), ``kvstore`` (the daemon's default
``--ssd-sync``: every commit fsynced before the call returns) and ``kvstore-nosync`` (``--no-ssd-sync``).

1. 128K-token session (``--pages`` 512): ``batch_set_v2`` GB/s over the pages' bytes; ``batch_exists_v2``
   p50/p99 over the whole chain; ``batch_get_v2`` GB/s warm (``file``: files in the page cache;
   kvstore: from the daemon's host tier); bytes at rest (``du``: allocated and apparent); then a
   restart: engine closed, daemon stopped, ``sync`` and the page cache of every file dropped
   (``/proc/sys/vm/drop_caches``, else ``posix_fadvise(DONTNEED)`` per file; ``fincore`` says what
   stayed resident), daemon started (its host tier empty: loads come from its LMDB file), engine built,
   restart -> first ``batch_exists_v2`` hit and -> first 128 pages loaded, and the cold ``batch_get_v2`` GB/s.
2. Agent workload: sessions sharing a system prompt, each growing turn by turn; a turn resumes the
   session (``batch_exists_v2`` + ``batch_get_v2`` of the whole chain) and stores only its new pages (a
   child node; the shared prompt is stored once). Per-turn store p50/p99 and resume GB/s.
3. SIGKILL mid-store: a child process (an SGLang server's backup path) stores ``--kill-pages`` pages batch
   by batch and prints each verdict; kvstore's daemon, or the HiCacheFile child itself, is SIGKILLed in
   the middle of a batch; then restart and check every acknowledged page (a ``True`` returned before
   the kill) loads bit-exact, and count what else is there (temp files, partial files, pages past the
   last acknowledgement, pools holding a page the others lack).

Every loaded page is compared bit-exact with what was stored (wrong bytes counted, must be 0).
Writes sglang_tier.{md,json} to benchmarks/results/ with --write, else to benchmarks/out/.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "engines" / "sglang_tier")]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from harness import PAGE_TOKENS, Engine, page_keys  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolTransfer  # noqa: E402

from benchmarks.common import results_dir  # noqa: E402
from kvstore.engines.sglang.backend import _records  # noqa: E402
from kvstore.engines.sglang.geometry import fit  # noqa: E402
from kvstore.format import quant  # noqa: E402
from tests.helpers.daemon import free_port, start_daemon  # noqa: E402

BATCH = 128  # SGLang's STORAGE_BATCH_SIZE
POOL = 8  # distinct real pages per pool
SIDES = ("file", "kvstore", "kvstore-nosync")
FAMILY = "sm100"
NS = "bench"
AT_REST_FLAGS = (("--ssd-zstd-level", "3"), ("--ssd-compact-records",))


# --- real V4.1 pages -------------------------------------------------------------------------------

class RealPages:
    """``POOL`` real pages per host pool (its record, in SGLang's block-split arrangement), deterministic."""

    def __init__(self, engine: Engine, seed: int = 0) -> None:
        mains, indexers = _records()
        g = torch.Generator().manual_seed(seed)
        self.pages: dict[str, list[np.ndarray]] = {}
        for name, geo in sorted(engine.geometry().items()):
            pool = fit(name, geo.layer_num, geo.item_bytes, geo.page_tokens, mains, indexers)
            rec = pool.record
            if rec is None or pool.ratio is None:
                raise RuntimeError(f"{name}: no record fits {geo}")
            states = geo.page_tokens // pool.ratio
            if (rec.data, rec.scale) == (256, 32):
                quantize, channels = quant.quantize_main, 512
            elif (rec.data, rec.scale) == (64, 4):
                quantize, channels = quant.quantize_indexer, 128
            else:
                raise RuntimeError(f"{name}: record {rec.name} has no quantizer here")
            pages = []
            for _ in range(POOL):
                items = []
                for _layer in range(geo.layer_num):
                    sigma = torch.exp(0.5 * torch.randn(channels, generator=g))
                    codes, scales = quantize(torch.randn(states, channels, generator=g) * sigma)
                    item = np.zeros(geo.item_bytes, np.uint8)
                    c, s = codes.numpy().reshape(-1), scales.numpy().reshape(-1)
                    item[:c.size] = c
                    item[c.size:c.size + s.size] = s
                    items.append(item)
                pages.append(np.concatenate(items))
            self.pages[name] = pages

    def page(self, pool: str, key: str) -> np.ndarray:
        return self.pages[pool][int(key[:8], 16) % POOL]

    @property
    def page_bytes(self) -> int:
        return sum(p[0].size for p in self.pages.values())


def host_rows(engine: Engine) -> dict[str, torch.Tensor]:
    """Each data pool's host buffer as [pages, page bytes] (a view of SGLang's host pool)."""
    out = {}
    for e in engine.host_pool_group.entries:
        buf = getattr(e.host_pool, "kv_buffer", None)
        if buf is not None:
            out[str(e.name.value)] = buf.view(torch.uint8).reshape(buf.shape[0], -1)
    return out


def fill(engine: Engine, pages: RealPages, keys: list[str], rows: list[int]) -> None:
    for name, buf in host_rows(engine).items():
        for k, r in zip(keys, rows, strict=True):
            buf[r] = torch.from_numpy(pages.page(name, k))


def wrong_bytes(engine: Engine, pages: RealPages, keys: list[str], rows: list[int],
                loaded: dict[str, list[bool]] | None = None) -> int:
    """Bytes of the pages in host ``rows`` that differ from what was stored under ``keys`` (only the pages a
    pool reported loaded, when ``loaded`` says which: a miss is a miss, SGLang recomputes it)."""
    wrong = 0
    for name, buf in host_rows(engine).items():
        for i, (k, r) in enumerate(zip(keys, rows, strict=True)):
            if loaded is None or loaded[name][i]:
                wrong += int(np.count_nonzero(buf[r].numpy() != pages.page(name, k)))
    return wrong


def verdicts(res: dict[Any, list[bool]]) -> dict[str, list[bool]]:
    return {str(getattr(k, "value", k)): [bool(x) for x in v] for k, v in res.items()}


def indices(rows: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(r * PAGE_TOKENS, (r + 1) * PAGE_TOKENS, dtype=torch.int64) for r in rows])


def transfers(engine: Engine, keys: list[str] | None, rows: list[int] | None) -> list[PoolTransfer]:
    idx = indices(rows) if rows else None
    return [PoolTransfer(name=s.pool_name, keys=keys, host_indices=idx, hit_policy=s.hit_policy,
                         indices_from_pool=s.indices_from_pool)
            for s in engine.sidecars if str(s.indices_from_pool.value) == "kv"]


def tokens(n_pages: int, seed: str) -> list[int]:
    h = int.from_bytes(hashlib.sha256(seed.encode()).digest()[:4], "little")
    return [(h + i * 7919) % 129_280 for i in range(n_pages * PAGE_TOKENS)]


@dataclass
class Store:
    """One backend's calls, timed."""

    engine: Engine
    pages: RealPages

    @property
    def backend(self) -> Any:
        return self.engine.storage_backend

    def store(self, chain: list[str], start: int, rows: list[int]) -> tuple[float, float, int]:
        """Store ``chain[start:]`` from host ``rows`` in 128-page batches: (batch_set_v2 s, anchor s, pages False)."""
        set_s = anchor_s = 0.0
        failed = 0
        fill(self.engine, self.pages, chain[start:], rows)
        for b in range(start, len(chain), BATCH):
            keys = chain[b:b + BATCH]
            r = rows[b - start:b - start + len(keys)]
            info = HiCacheStorageExtraInfo(prefix_keys=chain[:b])
            t = time.perf_counter()
            res = self.backend.batch_set_v2(transfers(self.engine, keys, r), extra_info=info)
            t1 = time.perf_counter()
            self.engine.controller.page_set_func(keys, indices(r), info)
            t2 = time.perf_counter()
            set_s, anchor_s = set_s + t1 - t, anchor_s + t2 - t1
            failed += sum(len(keys) - sum(v) for v in res.values())
        return set_s, anchor_s, failed

    def exists(self, chain: list[str]) -> tuple[float, int]:
        t = time.perf_counter()
        res = self.backend.batch_exists_v2(chain, transfers(self.engine, None, None), HiCacheStorageExtraInfo())
        return time.perf_counter() - t, int(res.kv_hit_pages)

    def load(self, chain: list[str], rows: list[int], first_batch_only: bool = False) -> tuple[float, int, int]:
        """Load ``chain`` into host ``rows`` (zeroed first) per 128-page batch: (batch_get_v2 s, pages False,
        wrong bytes)."""
        for buf in host_rows(self.engine).values():
            buf[rows] = 0
        get_s, failed = 0.0, 0
        loaded: dict[str, list[bool]] = {}
        for b in range(0, BATCH if first_batch_only else len(chain), BATCH):
            keys, r = chain[b:b + BATCH], rows[b:b + BATCH]
            t = time.perf_counter()
            res = self.backend.batch_get_v2(transfers(self.engine, keys, r),
                                            extra_info=HiCacheStorageExtraInfo(prefix_keys=chain[:b]))
            get_s += time.perf_counter() - t
            failed += sum(len(keys) - sum(v) for v in res.values())
            for name, v in verdicts(res).items():
                loaded.setdefault(name, []).extend(v)
        n = min(len(chain), BATCH) if first_batch_only else len(chain)
        return get_s, failed, wrong_bytes(self.engine, self.pages, chain[:n], rows[:n], loaded)


# --- sides -----------------------------------------------------------------------------------------

def engine_of(name: str, where: Path, address: str, host_pages: int) -> Engine:
    device_pages = 8
    ratio = -(-host_pages // device_pages)
    if name == "file":
        return Engine(FAMILY, "file", {"file_storage_path": str(where), "hicache_storage_pass_prefix_keys": True},
                      device_pages=device_pages, hicache_ratio=float(ratio))
    return Engine(FAMILY, "dynamic", {"backend_name": "kvstore", "module_path": "kvstore.engines.sglang.backend",
                                      "class_name": "KVStoreHiCache", "address": address, "namespace": NS,
                                      "hicache_storage_pass_prefix_keys": True},
                  device_pages=device_pages, hicache_ratio=float(ratio))


class Side:
    """One backend's storage: HiCacheFile's directory, or a daemon and its data directory."""

    def __init__(self, name: str, where: Path, extra: tuple[str, ...] = ()) -> None:
        self.name, self.where, self.extra = name, where, extra
        self.port = free_port()
        self.daemon: Any = None

    def flags(self) -> list[str]:
        return (["--port", str(self.port)] + (["--no-ssd-sync"] if self.name == "kvstore-nosync" else [])
                + list(self.extra))

    def start(self) -> str:
        if self.name == "file":
            return ""
        self.daemon = start_daemon(self.where, *self.flags())
        return str(self.daemon.address)

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None


@contextmanager
def side(name: str, where: Path) -> Iterator[Side]:
    s = Side(name, where)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


def drop_page_cache(path: Path) -> tuple[str, int]:
    """sync, then drop the page cache (all of it, else every file under ``path``): (how, bytes still resident)."""
    os.sync()
    how = "drop_caches"
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        how = "posix_fadvise(DONTNEED)"
    for p in files_under(path):  # both: a refused or partial drop_caches still leaves these cold
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return how, resident_bytes(path)


def resident_bytes(path: Path) -> int:
    files = [str(p) for p in files_under(path) if p.stat().st_size]
    total = 0
    for i in range(0, len(files), 500):
        out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", *files[i:i + 500]], capture_output=True,
                             text=True)
        total += sum(int(x) for x in out.stdout.split() if x.isdigit())
    return total


def du(path: Path) -> tuple[int, int]:
    """(allocated bytes: ``du -sB1``, apparent bytes: ``du -sb``)."""
    alloc = subprocess.run(["du", "-sB1", str(path)], capture_output=True, text=True, check=True).stdout
    apparent = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout
    return int(alloc.split()[0]), int(apparent.split()[0])


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


# --- 1. the 128K session ---------------------------------------------------------------------------

def run_session(name: str, pages: RealPages, n: int, work: Path, rep: int, args: argparse.Namespace) -> dict:
    where = work / f"{name}-{rep}"
    chain = page_keys(tokens(n, f"session-{rep}"))
    src, dst = list(range(n)), list(range(n, 2 * n))
    page_bytes = pages.page_bytes
    out: dict[str, Any] = {"side": name, "rep": rep, "pages": n, "page_bytes": page_bytes}
    s = Side(name, where)
    try:
        address = s.start()
        eng = engine_of(name, where, address, 2 * n + 8)
        try:
            st = Store(eng, pages)
            set_s, anchor_s, failed = st.store(chain, 0, src)
            out.update(set_s=set_s, anchor_s=anchor_s, set_false=failed, set_gbps=n * page_bytes / set_s / 1e9)
            ex = [st.exists(chain) for _ in range(args.exists_calls)]
            out.update(exists_ms=[t * 1e3 for t, _ in ex], exists_hits=min(h for _, h in ex))
            warm = [st.load(chain, dst) for _ in range(args.warm_loads)]
            out.update(warm_s=[w[0] for w in warm], get_false=sum(w[1] for w in warm),
                       wrong=sum(w[2] for w in warm),
                       warm_gbps=statistics.median(n * page_bytes / w[0] / 1e9 for w in warm))
        finally:
            eng.close()
        s.stop()
        out["du_alloc"], out["du_apparent"] = du(where)
        out["drop"], out["resident_after_drop"] = drop_page_cache(where)
        t0 = time.perf_counter()
        address = s.start()
        t_daemon = time.perf_counter()
        eng = engine_of(name, where, address, 2 * n + 8)
        try:
            t_engine = time.perf_counter()
            st = Store(eng, pages)
            hit = 0
            while hit == 0 and time.perf_counter() - t0 < 60:
                _, hit = st.exists(chain)
            t_hit = time.perf_counter()
            for buf in host_rows(eng).values():
                buf[dst] = 0
            cold_s, batch_s, f2 = 0.0, [], 0
            loaded: dict[str, list[bool]] = {}
            for b in range(0, n, BATCH):  # the whole chain, right after the restart
                keys, r = chain[b:b + BATCH], dst[b:b + BATCH]
                t = time.perf_counter()
                res = st.backend.batch_get_v2(transfers(eng, keys, r),
                                              extra_info=HiCacheStorageExtraInfo(prefix_keys=chain[:b]))
                batch_s.append(time.perf_counter() - t)
                f2 += sum(len(keys) - sum(v) for v in res.values())
                for pool, v in verdicts(res).items():
                    loaded.setdefault(pool, []).extend(v)
            cold_s = sum(batch_s)
            w2 = wrong_bytes(eng, pages, chain, dst, loaded)
            out.update(restart_daemon_s=t_daemon - t0, restart_engine_s=t_engine - t_daemon,
                       restart_hit_s=t_hit - t0, restart_first_load_s=t_hit - t0 + batch_s[0],
                       restart_hit_pages=hit, cold_s=cold_s, cold_gbps=n * page_bytes / cold_s / 1e9,
                       get_false=out["get_false"] + f2, wrong=out["wrong"] + w2)
        finally:
            eng.close()
    finally:
        s.stop()
        shutil.rmtree(where, ignore_errors=True)
    return out


def run_at_rest(flags: tuple[str, ...], pages: RealPages, n: int, work: Path) -> dict:
    """The session stored by a daemon with other ssd-record ``flags``: bytes at rest, store GB/s, a load checked."""
    where = work / "at-rest"
    chain = page_keys(tokens(n, "at-rest"))
    s = Side("kvstore", where, flags)
    try:
        eng = engine_of("kvstore", where, s.start(), 2 * n + 8)
        try:
            st = Store(eng, pages)
            set_s, _, failed = st.store(chain, 0, list(range(n)))
        finally:
            eng.close()
        s.stop()
        drop_page_cache(where)
        eng = engine_of("kvstore", where, s.start(), 2 * n + 8)
        try:
            get_s, f2, wrong = Store(eng, pages).load(chain, list(range(n, 2 * n)))
        finally:
            eng.close()
    finally:
        s.stop()
    alloc = du(where)[0]
    shutil.rmtree(where, ignore_errors=True)
    return {"flags": " ".join(flags), "alloc_per_token": alloc / (n * PAGE_TOKENS),
            "set_gbps": n * pages.page_bytes / set_s / 1e9, "cold_gbps": n * pages.page_bytes / get_s / 1e9,
            "set_false": failed, "get_false": f2, "wrong": wrong}


# --- 2. the agent workload -------------------------------------------------------------------------

@dataclass(frozen=True)
class AgentConfig:
    sessions: int = 6
    turns: int = 6
    system_pages: int = 24  # a shared system prompt with tool definitions: 6K tokens
    user_tokens: tuple[int, int] = (64, 512)
    output_median: int = 160
    tool_median: int = 1500
    seed: int = 0


def agent_trace(cfg: AgentConfig) -> list[tuple[int, int]]:
    """(session, its length in tokens after the turn) per turn, sessions interleaved round-robin."""
    rng = np.random.default_rng(cfg.seed)
    lengths = [cfg.system_pages * PAGE_TOKENS + int(rng.integers(*cfg.user_tokens)) for _ in range(cfg.sessions)]
    out = []
    for _turn in range(cfg.turns):
        for s in range(cfg.sessions):
            out.append((s, lengths[s]))
            for median in (cfg.output_median, cfg.tool_median):
                lengths[s] += int(np.clip(round(median * np.exp(0.8 * rng.standard_normal())), 16, 8 * median))
    return out


def agent_tokens(cfg: AgentConfig, session: int, length: int) -> list[int]:
    system = tokens(cfg.system_pages, "system")
    own = tokens(-(-length // PAGE_TOKENS), f"agent-{session}")
    return (system + own)[:length]


def run_agent(name: str, pages: RealPages, work: Path, cfg: AgentConfig) -> dict:
    where = work / f"agent-{name}"
    trace = agent_trace(cfg)
    longest = max(n for _, n in trace) // PAGE_TOKENS
    stored: set[str] = set()
    set_ms, resume_s, resume_pages, wrong, false = [], [], [], 0, 0
    with side(name, where) as s:
        eng = engine_of(name, where, s.daemon.address if s.daemon else "", 2 * longest + 8)
        try:
            st = Store(eng, pages)
            for session, length in trace:
                chain = page_keys(agent_tokens(cfg, session, length))
                held = next((i for i, k in enumerate(chain) if k not in stored), len(chain))
                if held:  # resume: what the session has in L3 (the shared prompt at least)
                    dst = list(range(longest + 1, longest + 1 + held))
                    q_s, hit = st.exists(chain[:held])
                    g_s, f, w = st.load(chain[:hit], dst[:hit])
                    resume_s.append(q_s + g_s)
                    resume_pages.append(hit)
                    wrong, false = wrong + w, false + f + (held - hit)
                if held < len(chain):  # the turn's new pages (a child node of the tree)
                    set_s, _, f = st.store(chain, held, list(range(len(chain) - held)))
                    set_ms.append(set_s * 1e3)
                    false += f
                    stored.update(chain[held:])
        finally:
            eng.close()
        at_rest = du(where)[0]
    shutil.rmtree(where, ignore_errors=True)
    gb = [p * pages.page_bytes / t / 1e9 for p, t in zip(resume_pages, resume_s, strict=True)]
    return {"side": name, "turns": len(trace), "stores": len(set_ms), "resumes": len(resume_s),
            "store_ms_p50": statistics.median(set_ms), "store_ms_p99": pct(set_ms, 0.99),
            "resume_gbps_p50": statistics.median(gb),
            "resume_gbps_total": sum(resume_pages) * pages.page_bytes / sum(resume_s) / 1e9,
            "pages_stored": len(stored), "pages_resumed": sum(resume_pages), "wrong": wrong, "false": false,
            "du_alloc": at_rest}


# --- 3. SIGKILL mid-store --------------------------------------------------------------------------

def child_store(args: argparse.Namespace) -> int:
    """The storing process: ``--kill-pages`` pages in 128-page batches, each verdict printed as it returns."""
    eng = engine_of(args.child, Path(args.where), args.address, args.kill_pages + 8)
    pages = RealPages(eng)
    st = Store(eng, pages)
    chain = page_keys(tokens(args.kill_pages, "kill"))
    fill(eng, pages, chain, list(range(len(chain))))
    for b in range(0, len(chain), BATCH):
        keys = chain[b:b + BATCH]
        print(json.dumps({"start": b}), flush=True)
        res = st.backend.batch_set_v2(transfers(eng, keys, list(range(b, b + len(keys)))),
                                      extra_info=HiCacheStorageExtraInfo(prefix_keys=chain[:b]))
        ok = [all(bool(v[i]) for v in res.values()) for i in range(len(keys))]
        print(json.dumps({"done": b, "ok": ok}), flush=True)
        eng.controller.page_set_func(keys, indices(list(range(b, b + len(keys)))), HiCacheStorageExtraInfo())
    print(json.dumps({"end": True}), flush=True)
    os._exit(0)  # no orderly detach: the parent judges what is on disk


def run_kill(name: str, pages: RealPages, work: Path, args: argparse.Namespace) -> dict:
    where = work / f"kill-{name}"
    n = args.kill_pages
    chain = page_keys(tokens(n, "kill"))
    s = Side(name, where)
    address = s.start()
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--where", str(where), "--address",
            address, "--kill-pages", str(n)]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    acked: set[int] = set()
    starts: dict[int, float] = {}
    durations: list[float] = []
    killed_at: int | None = None
    victim = "the kvstore daemon (kvstore serve)" if name != "file" else "the storing process (HiCacheFile's writer)"
    assert child.stdout is not None
    for line in child.stdout:
        m = json.loads(line)
        if "start" in m:
            starts[m["start"]] = time.perf_counter()
            if len(durations) >= args.kill_after and killed_at is None:
                time.sleep(0.5 * statistics.median(durations))  # the middle of this batch
                killed_at = m["start"]
                if name == "file":
                    child.send_signal(signal.SIGKILL)
                else:
                    s.daemon.kill()
        elif "done" in m:
            durations.append(time.perf_counter() - starts[m["done"]])
            acked.update(m["done"] + i for i, ok in enumerate(m["ok"]) if ok)
    if child.poll() is None:
        child.kill()
    child.wait()
    s.daemon = None
    leftovers: dict[str, int] = {}
    if name == "file":
        expected = {ps[0].size for ps in pages.pages.values()} | {0}
        tmp = [p for p in where.iterdir() if p.name.endswith(".tmp")]
        bins = [p for p in where.iterdir() if p.name.endswith(".bin")]
        leftovers = {"temp_files": len(tmp), "temp_bytes": sum(p.stat().st_size for p in tmp),
                     "orphan_files": len(bins) - 5 * len(acked),  # whole files of pages never acknowledged
                     "bin_files": len(bins), "bin_files_of_a_wrong_size": sum(p.stat().st_size not in expected
                                                                               for p in bins)}
    address = s.start()
    eng = engine_of(name, where, address, n + 8)
    try:
        st = Store(eng, pages)
        res = st.backend.batch_exists_v2(chain, transfers(eng, None, None), HiCacheStorageExtraInfo())
        hit = int(res.kv_hit_pages)
        pool_hits = {str(getattr(k, "value", k)): int(v) for k, v in res.extra_pool_hit_pages.items()}
        for buf in host_rows(eng).values():
            buf[:n] = 0
        loaded: list[bool] = [False] * n
        for b in range(0, n, BATCH):
            keys = chain[b:b + BATCH]
            r = st.backend.batch_get_v2(transfers(eng, keys, list(range(b, b + len(keys)))),
                                        extra_info=HiCacheStorageExtraInfo(prefix_keys=chain[:b]))
            for i in range(len(keys)):
                loaded[b + i] = all(bool(v[i]) for v in r.values())
        got = [i for i in range(n) if loaded[i]]
        if name != "file":  # pool pages the daemon committed for pages never acknowledged (all pools or not)
            present = st.backend._present(chain, sorted(pages.pages))
            leftovers = {"orphan_pool_pages": sum(present[p][i] for p in present for i in range(n) if i not in acked)}
        wrong = wrong_bytes(eng, pages, [chain[i] for i in got], got)
        lost = sorted(acked - set(got))
    finally:
        eng.close()
        s.stop()
    at_rest = du(where)[0]
    shutil.rmtree(where, ignore_errors=True)
    return {"side": name, "victim": victim, "pages": n, "killed_in_batch": killed_at, "acked": len(acked),
            "acked_lost": len(lost), "loaded": len(got), "loaded_unacked": len(set(got) - acked),
            "wrong": wrong, "exists_hit": hit, "pool_hits": pool_hits, "du_alloc": at_rest, **leftovers}


# --- report ----------------------------------------------------------------------------------------

def f(x: Any, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(rows: list[dict]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in SIDES:
        rs = [r for r in rows if r["side"] == name]
        if not rs:
            continue
        ex = [x for r in rs for x in r["exists_ms"]]
        med = {k: statistics.median(r[k] for r in rs) for k in
               ("set_gbps", "warm_gbps", "cold_gbps", "restart_hit_s", "restart_first_load_s", "restart_daemon_s",
                "restart_engine_s", "du_alloc", "du_apparent", "anchor_s", "resident_after_drop")}
        tokens_n = rs[0]["pages"] * PAGE_TOKENS
        out[name] = {**med, "exists_p50_ms": statistics.median(ex), "exists_p99_ms": pct(ex, 0.99),
                     "alloc_per_token": med["du_alloc"] / tokens_n, "apparent_per_token": med["du_apparent"] / tokens_n,
                     "wrong": sum(r["wrong"] for r in rs), "set_false": sum(r["set_false"] for r in rs),
                     "get_false": sum(r["get_false"] for r in rs), "drop": rs[0]["drop"], "runs": len(rs)}
    return out


def report(res: dict[str, Any], cmd: str) -> str:
    sm, agent, kill, info = res["summary"], res["agent"], res["kill"], res["info"]
    fl, kv, kn = sm.get("file", {}), sm.get("kvstore", {}), sm.get("kvstore-nosync", {})
    n = res["rows"][0]["pages"]
    lines = ["# kvstore vs SGLang's HiCacheFile as SGLang 0.5.23's HiCache L3, DeepSeek-V4.1 pages", "",
             "```", cmd, "```", "", *[f"- {k}: {v}" for k, v in info.items()], "",
             f"## A {n * PAGE_TOKENS // 1024}K-token session: {n} pages of {res['rows'][0]['page_bytes']:,} B "
             f"({res['rows'][0]['page_bytes'] / PAGE_TOKENS:.0f} B/token, four pools), "
             f"medians of {fl.get('runs')} runs",
             "", "| | file (HiCacheFile, no fsync) | kvstore (fsync) | kvstore (no fsync) | kvstore / file |",
             "|---|---|---|---|---|"]
    table = [("batch_set_v2 GB/s", "set_gbps", 2), ("kv anchor batch_set s (not in GB/s)", "anchor_s", 3),
             ("batch_get_v2 GB/s warm", "warm_gbps", 2), ("batch_get_v2 GB/s cold (restart, page cache dropped)",
                                                         "cold_gbps", 2),
             ("batch_exists_v2 p50 ms (512 keys x 4 pools)", "exists_p50_ms", 2),
             ("batch_exists_v2 p99 ms", "exists_p99_ms", 2),
             ("restart -> first exists hit s", "restart_hit_s", 3),
             ("  of which daemon start s", "restart_daemon_s", 3), ("  of which SGLang engine + backend s",
                                                                    "restart_engine_s", 3),
             ("restart -> first 128 pages loaded s", "restart_first_load_s", 3),
             ("bytes at rest / token (du, allocated)", "alloc_per_token", 1),
             ("bytes at rest / token (du -b, apparent)", "apparent_per_token", 1),
             ("resident after the page-cache drop, bytes (fincore)", "resident_after_drop", 0)]
    for label, k, nd in table:
        a, b, c = fl.get(k), kv.get(k), kn.get(k)
        r = ratio(b, a) if k != "restart_daemon_s" else None
        lines.append(f"| {label} | {f(a, nd)} | {f(b, nd)} | {f(c, nd)} | {f(r)} |")
    lines.append(f"| pages not stored / not loaded / wrong bytes | {fl.get('set_false')} / {fl.get('get_false')} / "
                 f"{fl.get('wrong')} | {kv.get('set_false')} / {kv.get('get_false')} / {kv.get('wrong')} | "
                 f"{kn.get('set_false')} / {kn.get('get_false')} / {kn.get('wrong')} | |")
    cfg = res["agent_config"]
    lines += ["", f"## Agent workload: {cfg['sessions']} sessions sharing a {cfg['system_pages']}-page system prompt, "
              f"{cfg['turns']} turns each (tool outputs ~{cfg['tool_median']} tokens)", "",
              "| | file | kvstore (fsync) | kvstore (no fsync) | kvstore / file |", "|---|---|---|---|---|"]
    a_rows = [("per-turn store (batch_set_v2 of the new pages) p50 ms", "store_ms_p50", 1),
              ("per-turn store p99 ms", "store_ms_p99", 1), ("resume (exists + get) GB/s p50", "resume_gbps_p50", 2),
              ("resume GB/s, all resumes", "resume_gbps_total", 2), ("pages stored", "pages_stored", 0),
              ("pages resumed", "pages_resumed", 0), ("wrong bytes / pages not stored or loaded", None, 0)]
    for label, k, nd in a_rows:
        vals = [agent.get(s, {}) for s in SIDES]
        if k is None:
            lines.append(f"| {label} | " + " | ".join(f"{v.get('wrong')} / {v.get('false')}" for v in vals) + " | |")
            continue
        x = [v.get(k) for v in vals]
        lines.append(f"| {label} | {f(x[0], nd)} | {f(x[1], nd)} | {f(x[2], nd)} | {f(ratio(x[1], x[0]))} |")
    lines += ["", f"## SIGKILL mid-store ({kill['file']['pages']} pages, 128-page batches, killed mid-batch)", "",
              "| | killed | in batch at page | acked pages | acked pages lost | pages loaded (bit-exact) | loaded "
              "past the acks | wrong bytes | per-pool prefix after restart | left on disk |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name in SIDES:
        k = kill.get(name)
        if not k:
            continue
        left = (f"{k['temp_files']} temp files ({k['temp_bytes']:,} B), {k['bin_files_of_a_wrong_size']} partial "
                f".bin, {k['orphan_files']} whole .bin files of unacknowledged pages" if name == "file" else
                f"committed batches only (LMDB); {k['orphan_pool_pages']} pool pages of unacknowledged pages")
        lines.append(f"| {name} | {k['victim']} | {k['killed_in_batch']} | {k['acked']} | {k['acked_lost']} | "
                     f"{k['loaded']} | {k['loaded_unacked']} | {k['wrong']} | {k['pool_hits']} | {left} |")
    lines += ["", "## kvstore's other ssd-record settings (one run each, fsync daemon): bytes at rest", "",
              "| daemon flags | bytes at rest / token (du) | vs file | batch_set_v2 GB/s | cold batch_get_v2 GB/s "
              "| wrong bytes | pool pages not stored or not loaded |", "|---|---|---|---|---|---|---|",
              f"| (default) | {f(kv.get('alloc_per_token'), 1)} | "
              f"{f(ratio(kv.get('alloc_per_token'), fl.get('alloc_per_token')))} "
              f"| {f(kv.get('set_gbps'))} | {f(kv.get('cold_gbps'))} | {kv.get('wrong')} | "
              f"{kv.get('set_false')} / {kv.get('get_false')} |"]
    for a in res["at_rest"]:
        lines.append(f"| `{a['flags']}` | {f(a['alloc_per_token'], 1)} | "
                     f"{f(ratio(a['alloc_per_token'], fl.get('alloc_per_token')))} | {f(a['set_gbps'])} | "
                     f"{f(a['cold_gbps'])} | {a['wrong']} | {a['set_false']} / {a['get_false']} |")
    lines += ["", "## Targets", "", "| target | measured | status |", "|---|---|---|"]
    wrong = (sum(sm[s]["wrong"] for s in sm) + sum(a["wrong"] for a in agent.values())
             + sum(a["wrong"] for a in res["at_rest"])
             + sum(k["wrong"] for k in kill.values()))
    lost = sum(k["acked_lost"] for k in kill.values())
    checks = [
        ("loads >= 1.5x HiCacheFile's warm (kvstore fsync daemon / file)", ratio(kv.get("warm_gbps"),
                                                                                 fl.get("warm_gbps")), 1.5),
        ("loads >= 1.0x HiCacheFile's cold", ratio(kv.get("cold_gbps"), fl.get("cold_gbps")), 1.0),
        ("durable stores >= 1.0x HiCacheFile's unsynced ones", ratio(kv.get("set_gbps"), fl.get("set_gbps")), 1.0),
        ("bytes at rest <= HiCacheFile's (du allocated, kvstore / file), the default raw records",
         ratio(kv.get("alloc_per_token"), fl.get("alloc_per_token")), None)]
    # the capacity-bound setting (ssd record flag 3: every scale run compressed), one run
    checks += [(f"bytes at rest <= HiCacheFile's, `{a['flags']}`", ratio(a["alloc_per_token"],
                                                                       fl.get("alloc_per_token")), None)
               for a in res["at_rest"] if a["flags"] == "--ssd-compact-records"]
    for label, x, lo in checks:
        ok = None if x is None else (x >= lo if lo is not None else x <= 1.0)
        lines.append(f"| {label} | {f(x)}x | {'-' if ok is None else 'met' if ok else '**not met**'} |")
    lines.append(f"| 0 wrong bytes (every page a backend reported loaded, every side) | {wrong} | "
                 f"{'met' if wrong == 0 else '**not met**'} |")
    lines.append(f"| 0 acknowledged pages lost (SIGKILL mid-store) | {lost} | "
                 f"{'met' if lost == 0 else '**not met**'} |")
    lines += ["", res["notes"]]
    return "\n".join(lines) + "\n"


NOTES = ("Read with: the timed calls are the backends' own (`batch_set_v2` / `batch_get_v2` / `batch_exists_v2` "
         "with `PoolTransfer`s over SGLang's host pools), not the controller's queues; SGLang's backup thread "
         "hands a whole node's pages to one `batch_set_v2` (the bench splits them into 128-page batches, as the "
         "prefetch side does). HiCacheFile never fsyncs (temp file + `os.replace`): its stores are in the page "
         "cache when they return, and a SIGKILL of its process cannot lose them, a power cut can; kvstore's "
         "`--ssd-sync` daemon fsyncs every commit before acknowledging. Warm kvstore loads come from the daemon's "
         "host tier; cold ones from its LMDB file after a restart with the page cache dropped. A 2-core machine "
         "shared with other work moves single runs by 2x: compare the ratios within one run.")


def main() -> int:
    out_dir = results_dir(sys.argv, os.environ)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=512, help="session pages (512 = 128K tokens)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--exists-calls", type=int, default=40)
    p.add_argument("--warm-loads", type=int, default=3)
    p.add_argument("--kill-pages", type=int, default=1024)
    p.add_argument("--kill-after", type=int, default=3, help="batches acknowledged before the kill")
    p.add_argument("--agent-sessions", type=int, default=AgentConfig.sessions)
    p.add_argument("--agent-turns", type=int, default=AgentConfig.turns)
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--where", help=argparse.SUPPRESS)
    p.add_argument("--address", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_store(args)
    cmd = "PYTHONPATH=. .venv-sglang/bin/python benchmarks/sglang_tier/bench_sglang_tier.py " + " ".join(sys.argv[1:])
    if out_dir.name == "results":
        cmd += " --write"
    import sglang

    import kvstore

    print(f"kvstore from {kvstore.__file__}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench_sglang_tier.", dir="/work" if Path("/work").is_dir() else None))
    t0 = time.time()
    rows: list[dict] = []
    cfg = AgentConfig(sessions=args.agent_sessions, turns=args.agent_turns)
    agent: dict[str, dict] = {}
    kill: dict[str, dict] = {}
    at_rest: list[dict] = []
    try:
        probe = engine_of("file", work / "probe", "", 16)
        pages = RealPages(probe)
        probe.close()
        for rep in range(args.reps):
            order = SIDES[rep % 3:] + SIDES[:rep % 3]
            for name in order:
                rows.append(run_session(name, pages, args.pages, work, rep, args))
                print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("exists_ms", "warm_s")}), flush=True)
        for name in SIDES:
            agent[name] = run_agent(name, pages, work, cfg)
            print(json.dumps(agent[name]), flush=True)
        for name in ("file", "kvstore"):
            kill[name] = run_kill(name, pages, work, args)
            print(json.dumps(kill[name]), flush=True)
        for flags in AT_REST_FLAGS:
            at_rest.append(run_at_rest(flags, pages, args.pages, work))
            print(json.dumps(at_rest[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info = {"machine": f"{os.cpu_count()} cores, {platform.platform()}, load {os.getloadavg()[0]:.2f} at the end",
            "versions": f"SGLang {sglang.__version__}, torch {torch.__version__}, Python {platform.python_version()}",
            "disk": f"{work.parent} (one file system for every side)",
            "record family": f"{FAMILY} (v41_fp4 main KV + MXFP4 indexer, SGLang's block-split page items)",
            "page cache drop": rows[0]["drop"] if rows else "-",
            "run": f"{args.reps} repetitions, sides in rotating order, {time.time() - t0:.0f} s; medians"}
    res = {"info": info, "command": cmd, "summary": summarize(rows), "agent": agent, "kill": kill,
           "agent_config": cfg.__dict__, "at_rest": at_rest, "rows": rows, "notes": NOTES}
    (out_dir / "sglang_tier.json").write_text(json.dumps(res, indent=1, default=str))
    text = report(res, cmd)
    (out_dir / "sglang_tier.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
