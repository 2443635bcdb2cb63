"""kvstore as vLLM's secondary tier vs vLLM's own file-system tier: the same V4.1 pages, one harness,
one disk, one run.

    .venv-vllm/bin/python benchmarks/vllm_tier/bench_vllm_tier.py [--quick] [--reps 3] [--step-blocks 32] [--step-ms 10]

Both sides are secondary tiers of vLLM 0.33's TieringOffloadingManager (``tests/vllm_tier/harness.py``:
vLLM's own offloading stack with a real CPU primary tier in shared memory, V4.1's KV cache specs):
``FileSystemTierManager`` (``fs_tier(root)``) and ``KVStoreTier`` (``kvstore_tier(address)``, a real
``kvstore serve`` daemon from the project's venv), each on a fresh directory of the same file
system (a temporary directory under /work, checked not to be tmpfs). The page bytes are realistic
(benchmarks/vllm_tier/vllm_tier_workload.py); the workloads are one 128K-token session and the agent
workload's shape; every repetition runs every side once, in a rotating order, so drift hits all.

Measured per side: store GB/s (``complete_store`` of every job -> every job finished), load GB/s
(``drop_primary``, then the scheduler's lookups -> promotions -> every key HIT), lookup latencies,
bytes at rest per token (``du``), restart -> first hit, a cold load after the restart, what survives
a SIGKILL mid-store (of the engine; of the daemon), and what a full disk does. Writes
vllm_tier.{md,json,png} to benchmarks/results/ with --write, else to benchmarks/out/ (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import drop_page_cache, results_dir
from benchmarks.vllm_tier import vllm_tier_workload as W

REPO = W.REPO
RESULTS = results_dir(sys.argv, os.environ)  # benchmarks/results/ with --write, else benchmarks/out/
log = logging.getLogger("bench_vllm_tier")
STEP_S = 0.010  # the rest of a scheduler step (--step-ms)


# -- small helpers --------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def med(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


class Captured(logging.Handler):
    """WARNING+ records of vLLM's and kvstore's loggers while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}"[:300])

    def __enter__(self) -> Captured:
        for name in ("vllm", "kvstore"):
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in ("vllm", "kvstore"):
            logging.getLogger(name).removeHandler(self)

    def count(self, needle: str) -> int:
        return sum(needle in r for r in self.records)


def sh(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def machine_info(work: Path) -> dict[str, Any]:
    """Cores, CPU, the disk under ``work`` (file system and a quick dd), versions."""
    import numpy
    import torch
    import vllm
    from vllm.v1.kv_offload.tiering.fs import io as fsio

    from benchmarks.common import git_state

    try:
        import vllm.fs_io_C

        fsio_c = "importable"
    except ImportError as e:
        fsio_c = f"in the wheel but not importable here ({e}): the pure-Python path ran"
    if not (Path(vllm.__file__).parent / "fs_io_C.abi3.so").exists() and fsio_c != "importable":
        fsio_c = f"not in the wheel ({fsio_c})"
    with open("/proc/cpuinfo") as fh:
        cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "?")
    fs = sh("findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", "-T", str(work))
    dd = {}
    f = work / "dd.probe"
    out = (
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={f}", "bs=1M", "count=256", "oflag=direct", "conv=fsync"],
            capture_output=True,
            text=True,
        )
        .stderr.strip()
        .splitlines()
    )
    dd["write 256 MiB, 1 MiB O_DIRECT + fsync"] = out[-1].split(", ")[-1] if out else "?"
    out = (
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=1M", "iflag=direct"], capture_output=True, text=True)
        .stderr.strip()
        .splitlines()
    )
    dd["read 256 MiB, 1 MiB O_DIRECT"] = out[-1].split(", ")[-1] if out else "?"
    out = (
        subprocess.run(
            ["dd", f"if={f}", "of=/dev/null", "bs=136K", "count=1000", "iflag=direct"], capture_output=True, text=True
        )
        .stderr.strip()
        .splitlines()
    )
    dd["read 136 KiB O_DIRECT (one fs-tier block)"] = out[-1].split(", ")[-1] if out else "?"
    t = time.perf_counter()
    out = (
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={f}", "bs=4k", "count=500", "oflag=dsync"], capture_output=True, text=True
        )
        .stderr.strip()
        .splitlines()
    )
    dd["4 KiB O_DSYNC writes (an fsync each)"] = f"{(time.perf_counter() - t) / 500 * 1e3:.2f} ms each" if out else "?"
    f.unlink(missing_ok=True)
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "work_dir_fs": fs,
        "dd": dd,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "kvstore": git_state(("kvstore", "tests/vllm_tier")),
        "fs_io_C": fsio_c,
        "fs_io_C_used": bool(fsio._HAS_FSIO_C),
        "daemon": " ".join(W.daemon_command()),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


# -- one measurement ------------------------------------------------------------------------------
def lookup_stats(lr: W.LookupRun, per_call: list[float]) -> dict[str, Any]:
    from vllm.v1.kv_offload.base import LookupResult

    fin = lr.per_key("final")
    ver = lr.per_key("verdict")
    miss = lr.per_key("final", LookupResult.MISS)
    return {
        "hit_final_p50_ms": pct(fin, 50) and pct(fin, 50) * 1e3,
        "hit_final_p99_ms": pct(fin, 99) and pct(fin, 99) * 1e3,
        "verdict_p50_ms": pct(ver, 50) and pct(ver, 50) * 1e3,
        "verdict_p99_ms": pct(ver, 99) and pct(ver, 99) * 1e3,
        "miss_final_p50_ms": pct(miss, 50) and pct(miss, 50) * 1e3,
        "miss_final_p99_ms": pct(miss, 99) and pct(miss, 99) * 1e3,
        "tier_call_p50_us": pct(per_call, 50) and pct(per_call, 50) * 1e6,
        "tier_call_p99_us": pct(per_call, 99) and pct(per_call, 99) * 1e6,
        "tier_calls": len(per_call),
        "passes": lr.passes,
        "keys_hit": len(fin),
        "keys_miss": len(miss),
    }


def kvstore_bpt(address: str) -> dict[str, Any]:
    from kvstore.client import Client

    try:
        with Client(address=address, shared_memory=False) as c:
            b = c.stats().bytes_per_token
        return {
            "raw": b.raw,
            "stored": b.stored,
            "lmdb_overhead": b.lmdb_overhead,
            "manifests": b.manifests,
            "tokens": b.tokens,
            "measured_bpt": b.measured,
        }
    except Exception as e:  # a report detail, never the benchmark's failure
        return {"error": str(e)}


def finish(eng: Any, ctxs: list[Any]) -> None:
    for c in ctxs:
        eng.finish(c)


def measure(
    side: W.Side, wl: W.Workload, pool: W.PagePool, work: Path, rep: int, stride: int, step_blocks: int, step_s: float
) -> dict[str, Any]:
    root = work / f"{side.name}-{wl.name}-r{rep}"
    cpu = W.cpu_bytes_for(len(wl.unique), stride)
    out: dict[str, Any] = {"side": side.name, "workload": wl.name, "rep": rep}
    run = W.start(side, root, cpu)
    try:
        eng = run.engine
        assert eng is not None and run.log is not None
        if side.kind == "fs":
            out["o_direct"] = bool(eng.tiers[0]._use_o_direct)
        # a long-running engine's tier is warm: one throwaway block first (connections, the layout's
        # registration, arenas, directories), counted in the bytes at rest
        warm = W.single_session(1, tag=f"warmup-{side.name}-{wl.name}-{rep}")
        W.complete_all(eng, W.prepare_turns(eng, pool, warm.turns, step_blocks))
        jobs = W.prepare_turns(eng, pool, wl.turns, step_blocks)
        out["store_jobs"] = len(jobs)
        out["store_s"] = W.complete_all(eng, jobs)
        out["store_failed_jobs"] = run.log.failures()
        stored_bytes = len(wl.unique) * pool.block_bytes
        out["store_gbps"] = stored_bytes / out["store_s"] / 1e9
        out["du_b"], out["du_alloc"] = W.du(root)
        out["bpt_du_b"] = out["du_b"] / (wl.tokens + warm.tokens)
        out["bpt_du_alloc"] = out["du_alloc"] / (wl.tokens + warm.tokens)
        if side.kind == "kvstore":
            assert run.daemon is not None
            out["kvstore_stats"] = kvstore_bpt(run.daemon.address)
        # warm load: the primary dropped, the tier as the store left it (its load path warmed by the throwaway block)
        eng.drop_primary()
        _, wctx = W.schedule_lookups(eng, warm.probes, pause_s=step_s)
        finish(eng, wctx)
        n_before = len(run.log.lookup_s)
        probes = [p + m for p, m in zip(wl.probes, wl.misses)]
        lr, ctxs = W.schedule_lookups(eng, probes, pause_s=step_s)
        out["load_s"] = lr.seconds
        out["load_bytes"] = sum(pool.extent[g] for _, g in lr.hits.values())
        out["load_gbps"] = out["load_bytes"] / lr.seconds / 1e9
        out["lookup"] = lookup_stats(lr, run.log.lookup_s[n_before:])
        out["load_ok"], out["load_wrong"] = W.verify(eng, pool, ctxs, lr)
        out["load_expected"] = 2 * len(wl.unique)
        out["load_failed_jobs"] = run.log.failures() - out["store_failed_jobs"]
        finish(eng, ctxs)
        if wl.name == "single":  # the same warm load with 1 ms steps: the scheduler's scans then hold the GIL
            eng.drop_primary()
            lr1, ctxs1 = W.schedule_lookups(eng, probes, pause_s=0.001)
            out["load_gbps_1ms"] = sum(pool.extent[g] for _, g in lr1.hits.values()) / lr1.seconds / 1e9
            ok1, wrong1 = W.verify(eng, pool, ctxs1, lr1)
            out["load_ok"] += ok1
            out["load_wrong"] += wrong1
            finish(eng, ctxs1)
        # restart: kvstore's daemon on the same data dir + a fresh engine; fs: a fresh engine on the same root
        run.stop_engine()
        gc.collect()
        if run.daemon is not None:
            run.daemon.stop()
            run.daemon = None
        drop_page_cache(root)
        out["cached_after_drop"] = W.cached_fraction(root)
        t0 = time.perf_counter()
        if side.kind == "kvstore":
            out["daemon_start_s"] = run.start_daemon()
        eng = run.start_engine(cpu)
        first, fctx = W.schedule_lookups(eng, [wl.probes[0][:1]], pause_s=step_s)
        out["restart_first_hit_s"] = time.perf_counter() - t0
        out["restart_first_hit_ok"] = len(first.hits) == eng.groups
        # cold load: everything else, from the disk
        n_before = len(run.log.lookup_s)
        lr, ctxs = W.schedule_lookups(eng, probes, pause_s=step_s)
        first_keys = set(first.hits)
        out["cold_load_s"] = lr.seconds
        out["cold_load_bytes"] = sum(pool.extent[g] for k, (_, g) in lr.hits.items() if k not in first_keys)
        out["cold_load_gbps"] = out["cold_load_bytes"] / lr.seconds / 1e9
        out["cold_lookup"] = lookup_stats(lr, run.log.lookup_s[n_before:])
        out["cold_ok"], out["cold_wrong"] = W.verify(eng, pool, ctxs, lr)
        finish(eng, ctxs + fctx)
    finally:
        run.stop()
        gc.collect()
        shutil.rmtree(root, ignore_errors=True)
    return out


# -- SIGKILL mid-store ------------------------------------------------------------------------------
class Child:
    """``bench_vllm_tier.py --child-store``: an engine storing a session, its SUBMIT/ACK lines read here."""

    def __init__(self, args: dict[str, Any], stderr: Path) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.err = open(stderr, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child-store", json.dumps(args)],
            stdout=subprocess.PIPE,
            stderr=self.err,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=REPO,
            env=W.DH.clean_env(),
        )
        self.submitted: dict[int, list[str]] = {}
        self.acked: dict[int, bool] = {}
        self.done = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("EOF")

    def pump(self, timeout: float) -> str | None:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        parts = line.split()
        if parts and parts[0] == "SUBMIT":
            self.submitted[int(parts[1])] = parts[2:]
        elif parts and parts[0] == "ACK":
            self.acked[int(parts[1])] = parts[2] == "1"
        elif parts and parts[0] in ("DONE", "EOF"):
            self.done = True
        return line

    def drain(self, timeout: float = 60.0) -> None:
        t0 = time.monotonic()
        while not self.done and time.monotonic() - t0 < timeout:
            self.pump(0.5)

    def acked_keys(self) -> set[bytes]:
        return {bytes.fromhex(k) for j, ok in self.acked.items() if ok for k in self.submitted.get(j, [])}

    def submitted_keys(self) -> set[bytes]:
        return {bytes.fromhex(k) for ks in self.submitted.values() for k in ks}

    def close(self) -> None:
        W.kill(self.proc)
        self.err.close()


def audit(
    run: W.Running, wl: W.Workload, pool: W.PagePool, cpu: int, acked: set[bytes], submitted: set[bytes]
) -> dict[str, Any]:
    """A fresh engine asks for every key of ``wl`` (no stop at a miss); each HIT is read back."""
    from vllm.v1.kv_offload.base import LookupResult

    eng = run.start_engine(cpu)
    try:
        with Captured() as cap:
            lr, ctxs = W.schedule_lookups(eng, [wl.unique], pause_s=STEP_S, stop_at_miss=False)
            res: dict[str, int] = {
                "keys": 2 * len(wl.unique),
                "acked": len(acked),
                "submitted": len(submitted),
                "hit": 0,
                "hit_exact": 0,
                "hit_wrong": 0,
                "acked_exact": 0,
                "acked_lost": 0,
                "unacked_exact": 0,
                "refused": 0,
            }
            hits = {k for k, kt in lr.keys[0].items() if kt.result is LookupResult.HIT}
            keys = list(hits)
            got = eng.read(ctxs[0], keys) if keys else []
            for k, g in zip(keys, got):
                b, grp = lr.hits[k]
                exact = pool.matches(b.content, grp, g)
                res["hit"] += 1
                res["hit_exact" if exact else "hit_wrong"] += 1
                if k in acked and exact:
                    res["acked_exact"] += 1
                elif exact:
                    res["unacked_exact"] += 1
            res["acked_lost"] = len(acked - {k for k in hits})
            res["refused"] = cap.count("refused")
    finally:
        run.stop_engine()
        gc.collect()
    return res


def crash_case(
    name: str,
    side: W.Side,
    target: str,
    wl: W.Workload,
    pool: W.PagePool,
    pool_files: dict[int, str],
    work: Path,
    stride: int,
    step_blocks: int,
) -> dict[str, Any]:
    """Store ``wl`` from a child engine; SIGKILL ``target`` ("engine" or "daemon") once a third of the
    jobs are acknowledged; then audit in a fresh engine (after restarting a killed daemon)."""
    root = work / f"crash-{name}"
    root.mkdir(parents=True)
    cpu = W.cpu_bytes_for(len(wl.unique), stride)
    run = W.Running(side, root)
    engine_id = f"bench-crash-{uuid.uuid4().hex[:8]}"
    out: dict[str, Any] = {"case": name, "side": side.name, "killed": target}
    try:
        if side.kind == "kvstore":
            run.start_daemon()
        tier = run.tier_cfg()
        args = {
            "tier": tier,
            "pool": {str(g): p for g, p in pool_files.items()},
            "cpu_bytes": cpu,
            "engine_id": engine_id,
            "step_blocks": step_blocks,
            "blocks": [(b.hash.hex(), b.content) for b in wl.unique],
        }
        child = Child(args, work / f"crash-{name}.child.log")
        n_jobs = -(-len(wl.unique) // step_blocks)
        t0 = time.monotonic()
        while not child.done and sum(child.acked.values()) < max(1, n_jobs // 3) and time.monotonic() - t0 < 120:
            child.pump(0.2)
        out["acked_at_kill"] = sum(child.acked.values())
        out["jobs"] = n_jobs
        out["finished_before_kill"] = child.done
        if target == "engine":
            W.kill(child.proc)
        else:
            assert run.daemon is not None
            W.kill(run.daemon.proc)
            run.daemon.stop()
            run.daemon = None
        child.drain()
        child.close()
        with open(work / f"crash-{name}.child.log", "rb") as f:
            out["child_log_tail"] = f.read()[-600:].decode(errors="replace")
        Path(f"/dev/shm/vllm_offload_{engine_id}.mmap").unlink(missing_ok=True)  # the killed child's primary
        out["acked_jobs"] = sum(child.acked.values())
        out["failed_jobs"] = sum(1 for ok in child.acked.values() if not ok)
        tmp = [p for p in root.rglob("*.tmp")]
        out["leftover_tmp_files"] = len(tmp)
        out["leftover_tmp_bytes"] = sum(p.stat().st_size for p in tmp)
        if side.kind == "kvstore":
            if run.daemon is not None:
                run.daemon.stop()
                run.daemon = None
            try:
                out["daemon_restart_s"] = run.start_daemon()
            except RuntimeError as e:
                out["daemon_restart_error"] = str(e)[-500:]
                return out
        out["audit"] = audit(run, wl, pool, cpu, child.acked_keys(), child.submitted_keys())
    finally:
        run.stop()
        shutil.rmtree(root, ignore_errors=True)
    return out


# -- full disk ------------------------------------------------------------------------------------
def full_disk_case(
    name: str,
    side: W.Side,
    wl: W.Workload,
    pool: W.PagePool,
    work: Path,
    stride: int,
    step_blocks: int,
    size_bytes: int,
    loop: bool,
) -> dict[str, Any]:
    out: dict[str, Any] = {"case": name, "side": side.name, "flags": list(side.flags)}
    cpu = W.cpu_bytes_for(len(wl.unique), stride)
    image, mnt = work / f"full-{name}.img", work / f"full-{name}.mnt"
    with W.loop_fs(image, mnt, size_bytes) if loop else _nullfs(work / f"full-{name}") as where:
        if where is None:
            out["error"] = "could not make a loop-mounted file system"
            return out
        out["limit"] = (
            f"ext4 of {size_bytes >> 20} MiB on a loop device ({W.du(where)[1] >> 10} KiB used when empty)"
            if loop
            else "--ssd-max-map-bytes on the normal disk"
        )
        root = where  # a kvstore daemon's log goes beside its data dir: on the normal disk
        run = W.Running(side, root)
        try:
            if side.kind == "kvstore":
                run.start_daemon()
            eng = run.start_engine(cpu)
            assert run.log is not None
            with Captured() as cap:
                jobs = W.prepare_turns(eng, pool, wl.turns, step_blocks)
                out["store_s"] = W.complete_all(eng, jobs)
                out["jobs"] = len(jobs)
                out["failed_jobs"] = run.log.failures()
                out["acked_keys"] = sum(len(run.log.submitted[r.job_id]) for r in run.log.results if r.success)
                out["errors_logged"] = len(cap.records)
                out["error_samples"] = sorted(set(r[:200] for r in cap.records))[:4]
            out["daemon_alive"] = (run.daemon.proc.poll() is None) if run.daemon is not None else None
            if run.daemon is not None:
                warn = [
                    ln
                    for ln in run.daemon.log().splitlines()
                    if '"WARNING"' in ln or '"ERROR"' in ln or "RESOURCE_EXHAUSTED" in ln
                ]
                out["daemon_errors"] = len(warn)
                out["daemon_error_samples"] = [ln[-300:] for ln in warn[-2:]]
            if run.daemon is not None and run.daemon.proc.poll() is not None:
                out["daemon_exit"] = run.daemon.proc.returncode
                out["daemon_log_tail"] = run.daemon.log()[-800:]
            acked = {k for r in run.log.results if r.success for k in run.log.submitted[r.job_id]}
            submitted = {k for ks in run.log.submitted.values() for k in ks}
            out["df_after"] = sh("df", "-B1", "--output=used,avail", str(where)).splitlines()[-1:]
            tmp = list(root.rglob("*.tmp"))
            out["leftover_tmp_files"] = len(tmp)
            out["leftover_tmp_bytes"] = sum(p.stat().st_size for p in tmp)
            # the same engine, right after (the kvstore tier counts a failed save as a down daemon for down_s)
            eng.drop_primary()
            lr, ctxs = W.schedule_lookups(eng, [wl.unique], pause_s=STEP_S, stop_at_miss=False)
            ok, wrong = W.verify(eng, pool, ctxs, lr)
            out["same_engine_after"] = {"hit": len(lr.hits), "exact": ok, "wrong": wrong}
            run.stop_engine()
            gc.collect()
            out["fresh_engine"] = audit(run, wl, pool, cpu, acked, submitted)
            if run.daemon is not None:
                run.daemon.stop()
                run.daemon = None
                try:
                    out["daemon_restart_on_full_disk_s"] = run.start_daemon()
                    out["after_daemon_restart"] = audit(run, wl, pool, cpu, acked, set())
                except RuntimeError as e:
                    out["daemon_restart_error"] = str(e)[-600:]
        finally:
            run.stop()
            gc.collect()
            shutil.rmtree(root, ignore_errors=True)
    return out


class _nullfs:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        return self.path

    def __exit__(self, *exc: Any) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


# -- the report -----------------------------------------------------------------------------------
SIDES = {
    "fs": W.Side("fs", "fs"),
    "kvstore": W.Side("kvstore", "kvstore", fsync=True),  # the tier's defaults
    "kvstore --no-sync": W.Side("kvstore --no-sync", "kvstore", ("--no-sync",)),
}
METRICS = [
    "store_gbps",
    "load_gbps",
    "load_gbps_1ms",
    "cold_load_gbps",
    "bpt_du_b",
    "bpt_du_alloc",
    "restart_first_hit_s",
    "daemon_start_s",
]
LOOKUPS = [
    "hit_final_p50_ms",
    "hit_final_p99_ms",
    "verdict_p50_ms",
    "verdict_p99_ms",
    "miss_final_p50_ms",
    "miss_final_p99_ms",
    "tier_call_p50_us",
    "tier_call_p99_us",
]


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for wl in dict.fromkeys(r["workload"] for r in rows):
        out[wl] = {}
        for side in SIDES:
            rs = [r for r in rows if r["workload"] == wl and r["side"] == side]
            if not rs:
                continue
            s: dict[str, Any] = {m: med([r.get(m) for r in rs]) for m in METRICS}
            s.update({f"lookup.{m}": med([r["lookup"].get(m) for r in rs]) for m in LOOKUPS})
            s.update({f"cold_lookup.{m}": med([r["cold_lookup"].get(m) for r in rs]) for m in LOOKUPS})
            s["reps"] = len(rs)
            for m in ("store_gbps", "load_gbps", "cold_load_gbps", "load_gbps_1ms"):
                xs = [r[m] for r in rs if r.get(m) is not None]
                s[f"{m}_all"] = [round(x, 4) for x in xs]
                if len(xs) > 1:
                    s[f"{m}_range"] = [min(xs), max(xs)]
            s["wrong"] = sum(r["load_wrong"] + r["cold_wrong"] for r in rs)
            s["exact"] = sum(r["load_ok"] + r["cold_ok"] for r in rs)
            s["failed_jobs"] = sum(r["store_failed_jobs"] + r["load_failed_jobs"] for r in rs)
            out[wl][side] = s
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, per workload, for kvstore with its default fsync (and --no-sync beside it)."""
    out = []
    for wl, s in summary.items():
        fs = s.get("fs")
        if fs is None:
            continue
        for side in ("kvstore", "kvstore --no-sync"):
            k = s.get(side)
            if k is None:
                continue
            rows = [
                (
                    "load >= 1.0x fs (the issue's: drop_primary, lookups -> promotions -> all HIT)",
                    ratio(k["load_gbps"], fs["load_gbps"]),
                    1.0,
                    ">=",
                ),
                (
                    "extra: load >= 1.0x fs cold (after a restart, page cache dropped)",
                    ratio(k["cold_load_gbps"], fs["cold_load_gbps"]),
                    1.0,
                    ">=",
                ),
                (
                    "durable store >= 0.8x fs" if side == "kvstore" else "store >= 0.8x fs (not durable: --no-sync)",
                    ratio(k["store_gbps"], fs["store_gbps"]),
                    0.8,
                    ">=",
                ),
                ("bytes at rest <= 0.9x fs (du -sb)", ratio(k["bpt_du_b"], fs["bpt_du_b"]), 0.9, "<="),
                ("bytes at rest <= 0.9x fs (du allocated)", ratio(k["bpt_du_alloc"], fs["bpt_du_alloc"]), 0.9, "<="),
                (
                    "lookup p99 <= fs (the issue's: first call -> final HIT)",
                    ratio(k["lookup.hit_final_p99_ms"], fs["lookup.hit_final_p99_ms"]),
                    1.0,
                    "<=",
                ),
                (
                    "extra: lookup p99 <= fs (first call -> the tier's verdict)",
                    ratio(k["lookup.verdict_p99_ms"], fs["lookup.verdict_p99_ms"]),
                    1.0,
                    "<=",
                ),
            ]
            for what, r, t, op in rows:
                met = None if r is None else (r >= t if op == ">=" else r <= t)
                out.append({"workload": wl, "side": side, "target": what, "ratio": r, "threshold": t, "met": met})
    return out


def f(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def plot(summary: dict[str, Any], path: Path, titles: dict[str, str]) -> None:
    """GB/s per workload (store, warm load, cold load; whiskers: min-max over the repetitions), bytes
    at rest per token, lookup p99; the targets for kvstore as red dashes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = list(summary)
    sides = [s for s in SIDES if any(s in summary[w] for w in wls)]
    colors = {"fs": "#7f7f7f", "kvstore": "#1f77b4", "kvstore --no-sync": "#9ecae1"}
    width = 0.8 / len(sides)
    k0 = sides.index("kvstore") if "kvstore" in sides else 1

    def target(ax: Any, g: int, y: float, label: str) -> None:
        lo = g + (k0 - (len(sides) - 1) / 2) * width - width / 2
        ax.hlines(y, lo, g + 0.4, colors="red", linestyles="dashed", linewidth=1.4)
        ax.text(g + 0.4, y, f" {label}", color="red", fontsize=7, va="center")

    def bars(ax: Any, groups: list[tuple[str, str]], s: dict[str, Any], nd: int) -> None:
        for i, side in enumerate(sides):
            vals = [s[side].get(m) or 0 for _, m in groups]
            err = [[0] * len(groups), [0] * len(groups)]
            for j, (_, m) in enumerate(groups):
                rng = s[side].get(f"{m}_range")
                if rng:
                    err[0][j], err[1][j] = vals[j] - rng[0], rng[1] - vals[j]
            xs = [g + (i - (len(sides) - 1) / 2) * width for g in range(len(groups))]
            bs = ax.bar(
                xs,
                vals,
                width,
                yerr=err if any(err[0]) or any(err[1]) else None,
                capsize=2,
                error_kw={"elinewidth": 0.7},
                label=side,
                color=colors[side],
            )
            for bb, v in zip(bs, vals):
                ax.text(bb.get_x() + bb.get_width() / 2, v, f"{v:.{nd}f}", ha="center", va="bottom", fontsize=7)

    cols = 2
    rows = -(-(len(wls) + 2) // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(6.6 * cols, 4.6 * rows))
    axes = list(grid.flatten())
    for ax, wl in zip(axes, wls):
        s = summary[wl]
        groups = [
            ("store", "store_gbps"),
            ("load (warm)", "load_gbps"),
            ("load (cold,\nafter restart)", "cold_load_gbps"),
        ]
        bars(ax, groups, s, 2)
        for g, (_, m), t in zip(range(3), groups, (0.8, 1.0, 1.0)):
            target(ax, g, s["fs"][m] * t, f"{t:g}x fs")
        ax.set_xticks(range(3), [g for g, _ in groups])
        ax.set_xlim(-0.5, len(groups) - 0.5 + 0.3)
        ax.set_ylabel("GB/s of V4.1 page bytes (median; whiskers min-max)")
        ax.set_title(titles.get(wl, wl), fontsize=9)
        top = max((s[side].get(f"{m}_range") or [0, s[side].get(m) or 0])[1] for side in sides for _, m in groups)
        ax.set_ylim(0, top * 1.3)
        ax.legend(fontsize=7, loc="upper left", ncol=3)
    ax = axes[len(wls)]
    bars(ax, [(w, w) for w in wls], _by_workload(summary, wls, sides, "bpt_du_b"), 0)
    for g, w in enumerate(wls):
        target(ax, g, summary[w]["fs"]["bpt_du_b"] * 0.9, "0.9x fs")
    ax.axhline(890, color="black", linewidth=0.6, linestyle=":")
    ax.text(len(wls) - 0.5 + 0.28, 890, "page bytes\n890 B/token", fontsize=7, va="center", ha="right")
    ax.set_xticks(range(len(wls)), wls)
    ax.set_xlim(-0.5, len(wls) - 0.5 + 0.3)
    ax.set_ylabel("bytes at rest per token (du -sb, median)")
    ax.set_title("bytes at rest (lower is better)", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax = axes[len(wls) + 1]
    bars(ax, [(w, w) for w in wls], _by_workload(summary, wls, sides, "lookup.hit_final_p99_ms"), 0)
    for g, w in enumerate(wls):
        target(ax, g, summary[w]["fs"]["lookup.hit_final_p99_ms"], "1x fs")
    ax.set_xticks(range(len(wls)), wls)
    ax.set_xlim(-0.5, len(wls) - 0.5 + 0.3)
    ax.set_ylabel("ms, first lookup call -> final HIT, p99 (median)")
    ax.set_title("lookup p99 (lower is better)", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(
        "vLLM 0.33 secondary tiers, DeepSeek-V4.1 pages: FileSystemTierManager (fs, no fsync) vs KVStoreTier "
        "(fsync per save; --no-sync), same disk. Red dashes: the targets for kvstore",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _by_workload(summary: dict[str, Any], wls: list[str], sides: list[str], key: str) -> dict[str, dict[str, Any]]:
    """{side: {workload: value}}: one metric across workloads, in the shape ``bars`` takes."""
    return {side: {w: summary[w][side].get(key) for w in wls} for side in sides}


def report(
    cmd: str,
    info: dict[str, Any],
    cfg: dict[str, Any],
    rows: list[dict[str, Any]],
    summary: dict[str, Any],
    tg: list[dict[str, Any]],
    crash: list[dict[str, Any]],
    full: list[dict[str, Any]],
    pool: W.PagePool,
    wall_s: float,
    titles: dict[str, str],
) -> str:
    L: list[str] = []
    L.append("# kvstore as vLLM's secondary tier vs vLLM's file-system tier (DeepSeek-V4.1 pages)\n")
    L.append(f"```\n{cmd}\n```\n")
    L.append(
        f"- machine: {info['cores']} cores ({info['cpu']}), shared with other work (load average "
        f"{info['loadavg_start'][0]} at the start, {cfg['loadavg_end'][0]} at the end); kernel {info['kernel']}"
    )
    L.append(
        f"- disk: both tiers in one temporary directory under /work: `{info['work_dir_fs']}`; "
        + "; ".join(f"dd {k}: {v}" for k, v in info["dd"].items())
    )
    L.append(
        f"- versions: vLLM {info['vllm']}, torch {info['torch']}, numpy {info['numpy']}, Python "
        f"{info['python']}, kvstore {info['kvstore']}; daemon `{info['daemon']} serve`"
    )
    L.append(f"- vLLM's C helper `vllm.fs_io_C`: {info['fs_io_C']}")
    L.append(
        f"- run: {cfg['reps']} repetitions, each running every side once in a rotating order; "
        f"{wall_s:.0f} s in all; stores in jobs of {cfg['step_blocks']} blocks "
        f"({cfg['step_blocks'] * W.BLOCK_TOKENS} tokens: one step of chunked prefill); medians over the repetitions\n"
    )
    hdr = ["", *[s for s in SIDES]]
    for wl, s in summary.items():
        fs = s["fs"]
        L.append(f"### {titles[wl]}\n")
        rows_t = []

        def row(label: str, key: str, nd: int = 2, rel: bool = True, s=s, fs=fs, rows_t=rows_t) -> None:
            if all(s.get(side, {}).get(key) is None for side in SIDES):
                return
            cells = [label]
            for side in SIDES:
                v = s.get(side, {}).get(key)
                r = ratio(v, fs.get(key)) if rel and side != "fs" else None
                spread = s.get(side, {}).get(f"{key}_range")
                cells.append(
                    f(v, nd)
                    + (f" ({r:.2f}x)" if r is not None else "")
                    + (f" [{spread[0]:.{nd}f}-{spread[1]:.{nd}f}]" if spread else "")
                )
            rows_t.append(cells)

        row("store GB/s", "store_gbps")
        row("load GB/s (warm)", "load_gbps")
        row("load GB/s (cold, after restart)", "cold_load_gbps")
        row("load GB/s (warm, 1 ms steps)", "load_gbps_1ms")
        row("lookup -> final HIT p50 ms", "lookup.hit_final_p50_ms", 1)
        row("lookup -> final HIT p99 ms", "lookup.hit_final_p99_ms", 1)
        row("lookup -> verdict p50 ms", "lookup.verdict_p50_ms", 1)
        row("lookup -> verdict p99 ms", "lookup.verdict_p99_ms", 1)
        row("lookup -> final MISS p99 ms", "lookup.miss_final_p99_ms", 1)
        row("tier.lookup per call p50 us", "lookup.tier_call_p50_us", 1)
        row("tier.lookup per call p99 us", "lookup.tier_call_p99_us", 1)
        row("bytes at rest / token (du -sb)", "bpt_du_b", 1)
        row("bytes at rest / token (du allocated)", "bpt_du_alloc", 1)
        row("restart -> first hit s", "restart_first_hit_s", 2)
        row("  of which the daemon's start s", "daemon_start_s", 2, rel=False)
        cells = ["blocks read back bit-exact / wrong (all reps)"]
        for side in SIDES:
            x = s.get(side)
            cells.append(f"{x['exact']} / {x['wrong']}" if x else "-")
        rows_t.append(cells)
        cells = ["failed jobs (all reps)"]
        for side in SIDES:
            x = s.get(side)
            cells.append(str(x["failed_jobs"]) if x else "-")
        rows_t.append(cells)
        L.append(md_table(hdr, rows_t))
        L.append("")
    L.append("## Targets (kvstore with its default fsync; --no-sync beside it)\n")
    L.append(
        md_table(
            ["workload", "side", "target", "kvstore / fs", "status"],
            [
                [
                    t["workload"],
                    t["side"],
                    t["target"],
                    f(t["ratio"], 3),
                    "-" if t["met"] is None else ("**met**" if t["met"] else "**not met**"),
                ]
                for t in tg
            ],
        )
    )
    L.append("")
    L.append("## What the numbers mean\n")
    L.append(f"- **Page bytes**: {describe_pool(pool)}")
    L.append(
        "- **Workloads**: "
        + "; ".join(f"`{k}`: {v}" for k, v in titles.items())
        + ". The agent's turns are stored interleaved across sessions (turn 1 of every session, then turn 2, ...), "
        "each turn its own request storing only its new blocks and naming its agent session (`kvstore_session`: "
        "one growing kvstore page session per agent session); the shared prefix is stored once (both tiers "
        "key blocks by vLLM's chained hash). After the store the primary is dropped and every session's whole "
        "context is looked up as one waiting request each (all at once, as the scheduler holds them), plus one "
        "never-stored block of a next turn (a miss)."
    )
    od = [r.get("o_direct") for r in rows if r["side"] == "fs"]
    odirect = "it did in every run here" if od and all(od) else f"O_DIRECT in {sum(map(bool, od))} of {len(od)} runs"
    L.append(
        "- **store GB/s**: the 256-token blocks' page bytes (890 B/token: both groups' pages, what must round-trip) "
        "divided by the time from the first `complete_store` (all jobs' slots already written in the primary, as the "
        "GPU copy would have) until every store job finished (`has_pending_work()` false). All jobs are completed "
        "back to back, after one throwaway block warmed the tier (connections, layout registration, arenas; its "
        "load path too, before the warm load). fs: 16 writer threads, one task per job, each block a temp file "
        "written with O_DIRECT when the "
        f"probe allows it ({odirect}) and `os.replace`d; **it never fsyncs** (an acknowledged block is in the "
        "device's write path but neither its data nor the rename is forced to stable storage). kvstore: every job is "
        "one turn save (`save_session`: the page blobs + the request's page session in one LMDB transaction, "
        "**fsynced** by default; `--no-sync` skips the fsync); a request's saves are serialized."
    )
    L.append(
        "- **load GB/s**: page bytes of every distinct key promoted / the time from the first `lookup` call until "
        "every request's last key answered HIT, with the scheduler's loop: each step every waiting request's keys "
        "of each group in order (`_maximal_prefix_lookup`), `on_schedule_end`, then {step_ms:g} ms for the rest of a "
        "step (other requests' forward pass, the scheduler thread idle). "
        "*warm*: right after the store (kvstore's daemon still holds the blobs in its 1 GiB host-memory tier and "
        "the page cache; fs reads with O_DIRECT, so from the device either way). *cold*: after a restart "
        "(kvstore: daemon stopped, its data dir's pages evicted with POSIX_FADV_DONTNEED, daemon started again; "
        "fs: the same eviction) and a fresh engine. *warm, 1 ms steps*: the warm load again with 1 ms between "
        "passes: the scheduler's Python scans then hold the GIL most of the time and both tiers' I/O threads wait "
        "for it (what an idle engine spinning on a waiting request would see).".format(step_ms=cfg["step_ms"])
    )
    L.append(
        "- **lookup**: per key, from the first `manager.lookup` call to its *final* answer as the scheduler sees it "
        "(HIT once the promotion landed in the primary, or MISS) -- so for a hit it includes the load of the "
        "request's promotion job; *verdict*: to the first answer that is not RETRY (the tier said HIT, the manager "
        "answers HIT_PENDING and starts the promotion; or MISS); *tier.lookup per call*: the cost of one "
        "`tier.lookup` call on the scheduler thread (both tiers answer from vLLM's AsyncLookupManager, a batch per "
        "step on a background thread: fs `os.path.exists` per key, kvstore one `LookupKeys` RPC per request)."
    )
    L.append(
        "- **bytes at rest / token**: `du -sb` (apparent) and `du -s --block-size=1` (allocated) of the fs root vs "
        "the daemon's data dir after the store, divided by the distinct tokens stored. The fs tier writes the "
        "whole primary slot (the block stride, 139,264 B) for each group's key; kvstore keeps each group's pages "
        "only (136,704 + 91,136 B) and zstd-compresses the scale rows."
    )
    L.append(
        "- **restart -> first hit**: kvstore: from starting the daemon on the same data dir (a fresh process) "
        "through a fresh engine to the first block's two keys answering HIT; fs: from a fresh engine on the same "
        "root to the same."
    )
    L.append(
        "- kvstore runs with the tier's defaults (`n_load_threads=2`, `n_store_threads=2`, `down_s=5`) and the "
        "daemon's (`--host-capacity-bytes` 1 GiB, zstd level 1 on the ssd tier); fs with vLLM's (16 read, 16 write "
        "threads). Every block each load promoted is read back from the primary and compared with what was stored."
    )
    L.append("")
    L.append("## SIGKILL mid-store\n")
    L.append(
        f"A child process (an engine of its own) stores {titles['single']}; once a third of its store jobs are "
        "acknowledged (`get_finished_jobs` said success), the engine or the daemon is SIGKILLed. A fresh engine "
        "then asks for every key (not stopping at a miss) and reads every hit back. SIGKILL keeps the kernel's page "
        "cache, so this tests atomicity (torn or partial blocks), not power-loss durability: for that, fs relies on "
        "nothing (no fsync) and kvstore on its fsync per save (`--no-sync`: on nothing either).\n"
    )
    crows = []
    for c in crash:
        if "error" in c:
            crows.append([c["case"], f"could not run: {c['error'][:200]}", *["-"] * 8])
            continue
        a = c.get("audit", {})
        crows.append(
            [
                c["case"],
                f"{c.get('acked_jobs', '-')}/{c.get('jobs', '-')}"
                + (" (finished before the kill)" if c.get("finished_before_kill") else ""),
                f"{a.get('acked', '-')}",
                f"{a.get('acked_exact', '-')}",
                f"{a.get('acked_lost', '-')}",
                f"{a.get('unacked_exact', '-')}",
                f"{a.get('hit_wrong', '-')}",
                f"{a.get('refused', '-')}",
                f"{c.get('leftover_tmp_files', 0)} ({c.get('leftover_tmp_bytes', 0) / 1e6:.1f} MB)",
                c.get("daemon_restart_error", f(c.get("daemon_restart_s"))) if "kvstore" in c["side"] else "-",
            ]
        )
    L.append(
        md_table(
            [
                "case",
                "jobs acked / all",
                "acked keys",
                "acked & bit-exact",
                "acked & lost",
                "unacked but bit-exact",
                "wrong bytes",
                "refused",
                "leftover temp files",
                "daemon restart s",
            ],
            crows,
        )
    )
    L.append("")
    L.append("## Full disk\n")
    frows = []
    for c in full:
        if "error" in c:
            frows.append([c["case"], c["error"], *["-"] * 7])
            continue
        fe = c.get("fresh_engine", {})
        ar = c.get("after_daemon_restart", {})
        sa = c.get("same_engine_after", {})
        frows.append(
            [
                c["case"],
                c.get("limit", ""),
                f"{c.get('jobs', '-') - c.get('failed_jobs', 0)}/{c.get('jobs', '-')}",
                f"{c.get('acked_keys', '-')}",
                f"{c.get('leftover_tmp_files', 0)}",
                f"{sa.get('hit', '-')} hit, {sa.get('wrong', '-')} wrong",
                f"{fe.get('hit', '-')} hit, {fe.get('hit_wrong', '-')} wrong, {fe.get('acked_lost', '-')} acked lost",
                ("alive" if c.get("daemon_alive") else f"exited {c.get('daemon_exit')}")
                if c.get("daemon_alive") is not None
                else "-",
                (
                    f"ok, {ar.get('hit', '-')} hit, {ar.get('hit_wrong', '-')} wrong"
                    if ar
                    else c.get("daemon_restart_error", "-")[:120]
                )
                if "kvstore" in c["side"]
                else "-",
            ]
        )
    L.append(
        md_table(
            [
                "case",
                "limit",
                "jobs ok / all",
                "acked keys",
                "temp files left",
                "same engine after",
                "fresh engine",
                "daemon",
                "daemon restarted on the full disk",
            ],
            frows,
        )
    )
    L.append("")
    for c in full:
        for e in c.get("error_samples", [])[:3]:
            L.append(f"- {c['case']}: `{e}`")
    L.append("")
    L.append("## Noticed\n")
    L.extend(noticed(summary, crash, full))
    L.append("")
    return "\n".join(L)


def noticed(summary: dict[str, Any], crash: list[dict[str, Any]], full: list[dict[str, Any]]) -> list[str]:
    """What the run itself shows beyond the table (each line from this run's numbers)."""
    out = []
    wrong = sum(s[side]["wrong"] for s in summary.values() for side in s)
    exact = sum(s[side]["exact"] for s in summary.values() for side in s)
    out.append(
        f"- Every block every load promoted was compared with what was stored: {exact} bit-exact, {wrong} wrong. "
        "(Before commit 19be596 the tier's two load threads shared one client's arena and concurrent requests' "
        "loads read each other's bytes: this agent workload then loaded wrong bytes as HITs.)"
    )
    for c in full:
        sa = c.get("same_engine_after", {})
        fe = c.get("fresh_engine", {})
        if "kvstore" in c["side"] and c.get("failed_jobs") and sa.get("hit") == 0 and fe.get("hit"):
            out.append(
                f"- {c['case']}: after the first save refused for space (RESOURCE_EXHAUSTED), the tier treats the "
                f"daemon as down for `down_s`: the same engine's lookups of the {c.get('acked_keys')} blocks it had "
                f"stored were all misses, though the daemon was up and a fresh engine loaded all {fe.get('hit')} "
                "(`KVStoreTier._run` -> `_failed` for every KvstoreError)."
            )
        if c["side"] == "fs" and c.get("jobs") and not c.get("error"):
            ok = c["jobs"] - c.get("failed_jobs", 0)
            out.append(
                f"- {c['case']}: {ok} of {c['jobs']} store jobs reported success, yet a fresh engine loaded "
                f"{fe.get('hit')} keys bit-exact: each job stops at its first ENOSPC and reports failure, keeping "
                f"the blocks it had renamed; no temp file was left ({c.get('leftover_tmp_files')})."
            )
    for c in crash:
        if c["side"] == "fs" and c.get("leftover_tmp_files"):
            out.append(
                f"- {c['case']}: {c['leftover_tmp_files']} temp files ({c['leftover_tmp_bytes'] / 1e6:.1f} MB) "
                "of the writes in flight stay in the fs root for good (nothing in the fs tier removes `*.tmp`); "
                "no torn block is ever visible under a block's name."
            )
    for wl, s in summary.items():
        fs, k, ns = s.get("fs"), s.get("kvstore"), s.get("kvstore --no-sync")
        if not (fs and k and ns):
            continue
        out.append(
            f"- {wl}: store GB/s of kvstore with its fsync per save {f(k['store_gbps'])}, with `--no-sync` "
            f"{f(ns['store_gbps'])}; fs (never fsyncs) {f(fs['store_gbps'])}."
        )
        if (k.get("lookup.verdict_p50_ms") or 0) > 1.2 * (fs.get("lookup.verdict_p50_ms") or 0):
            out.append(
                f"- {wl}: kvstore's lookup verdicts come later than fs's (p50 {f(k['lookup.verdict_p50_ms'], 1)} vs "
                f"{f(fs['lookup.verdict_p50_ms'], 1)} ms): vLLM's AsyncLookupManager calls `batch_lookup` once per "
                "waiting request, one after another on its one worker thread, and posts a step's verdicts only when "
                "all are done; kvstore's is one `LookupKeys` RPC a request, fs's an `os.path.exists` per key."
            )
        if fs.get("load_gbps_1ms") and k.get("load_gbps_1ms"):
            out.append(
                f"- {wl}: with 1 ms steps instead of {STEP_S * 1e3:g} ms the warm load is "
                f"{f(fs['load_gbps_1ms'])} GB/s for fs ({f(fs['load_gbps'])} at {STEP_S * 1e3:g} ms) and "
                f"{f(k['load_gbps_1ms'])} for kvstore ({f(k['load_gbps'])})"
                + (
                    ": the scheduler's Python scan of every waiting key each pass holds the GIL and the tiers' I/O "
                    "threads wait for it, so both tiers' load numbers depend on how busy the scheduler thread is."
                    if fs["load_gbps_1ms"] < 0.7 * fs["load_gbps"]
                    else "."
                )
            )
    spreads = []
    for wl, s in summary.items():
        for side in s:
            rng = s[side].get("store_gbps_range")
            if rng and rng[0]:
                spreads.append(f"{wl} {side} {rng[1] / rng[0]:.1f}x")
    if spreads:
        out.append(
            "- The machine is shared (see the load average above): the store's fastest repetition over its slowest was "
            + ", ".join(spreads)
            + ". Only the repetitions' medians are compared; the whiskers of the plot show the spread."
        )
    out.append(
        "- fs ran its pure-Python I/O path (`vllm.fs_io_C` is in the wheel but built against CUDA libraries this CPU "
        "host lacks); where it loads, fs's batched store, load and lookup run in C with the GIL released."
    )
    k = [s["kvstore"] for s in summary.values() if "kvstore" in s]
    if k:
        d = med([x["daemon_start_s"] for x in k])
        r = med([x["restart_first_hit_s"] for x in k])
        out.append(
            f"- kvstore's restart -> first hit (median {r:.2f} s) is mostly the daemon's own start "
            f"({d:.2f} s: a Python process importing the server and opening LMDB); the lookup and load of the "
            "first block after it take tens of ms, like fs's."
        )
    return out


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def describe_pool(pool: W.PagePool) -> str:
    k = pool.kinds
    total = sum(k.values())
    parts = ", ".join(f"{n} {v:,} B ({v / total:.1%})" for n, v in k.items() if v)
    st = pool.scale_stats
    m, i = st.get("main", {}), st.get("index", {})
    return (
        f"each 256-token block is {total:,} B of pages ({parts}) in the two groups' blocks "
        f"({', '.join(f'group {g}: {e:,} B' for g, e in pool.extent.items())}), at the offsets geometry.py derives. "
        f"Main pages: `nvfp4_ds_mla` records (256 B of FP4 E2M1 codes + 32 E4M3 scales, one per 16 of 512 channels, "
        f"interleaved per state) of N(0,1) rows times a per-channel log-normal gain (sigma 0.5) and a per-state gain "
        f"(sigma 0.2), quantized with `kvstore.format.quant.quantize_main`: "
        f"the E4M3 scales take {m.get('distinct_bytes')} "
        f"distinct values in [{m.get('e4m3_range', ['?', '?'])[0]}, {m.get('e4m3_range', ['?', '?'])[1]}]. Indexer "
        f"pages: MXFP4 records (64 B of codes, then 4 UE8M0 exponents per state, split) from "
        f"`quantize_indexer`: exponents {i.get('exponents')}. Padding past a group's pages in a slot: zeros."
    )


# -- main -----------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a ~30 s smoke run (small workloads, 1 repetition)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3; --quick: 1)")
    ap.add_argument("--step-blocks", type=int, default=32, help="blocks per store job (one scheduler step)")
    ap.add_argument(
        "--step-ms",
        type=float,
        default=10.0,
        help="the rest of a scheduler step between lookup passes (other requests' forward pass)",
    )
    ap.add_argument("--work-dir", default=None, help="where the tiers live (default: a temp dir under /work)")
    ap.add_argument(
        "--out",
        default=None,
        help="results prefix (default benchmarks/out/vllm_tier, with --write benchmarks/results/vllm_tier; "
        "--quick: /tmp/vllm_tier.quick)",
    )
    ap.add_argument("--no-crash", action="store_true")
    ap.add_argument("--no-full-disk", action="store_true")
    ap.add_argument("--child-store", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child_store:
        W.child_store(json.loads(a.child_store))
        return 0
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("kvstore").setLevel(logging.WARNING)  # the tier's warnings are counted (Captured)
    global STEP_S
    STEP_S = a.step_ms / 1e3
    t_start = time.perf_counter()
    reps = a.reps or (1 if a.quick else 3)
    base = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="bench_vllm_tier.", dir="/work"))
    base.mkdir(parents=True, exist_ok=True)
    fstype = sh("findmnt", "-n", "-o", "FSTYPE", "-T", str(base))
    if fstype in ("tmpfs", "ramfs"):
        print(f"{base} is on {fstype}: pick a --work-dir on a disk", file=sys.stderr)
        return 2
    out_prefix = Path(a.out) if a.out else (Path("/tmp/vllm_tier.quick") if a.quick else RESULTS / "vllm_tier")
    cmd = ".venv-vllm/bin/python benchmarks/vllm_tier/bench_vllm_tier.py" + "".join(f" {x}" for x in sys.argv[1:])
    if os.environ.get("KVSTORE_BENCH_WRITE") == "1":
        cmd += " --write"
    try:
        info = machine_info(base)
        print(f"machine: {info['cores']} cores, {info['work_dir_fs']}, dd {info['dd']}", flush=True)
        probe = W.H.Engine.start([W.H.kvstore_tier("127.0.0.1:1")], cpu_bytes=16 << 20)
        layout, stride = probe.tiers[0].layout, probe.stride
        probe.shutdown()
        del probe
        gc.collect()
        if a.quick:
            wls = [W.single_session(64), W.agent(sessions=4, prefix_blocks=8, final_blocks=(16, 32), turns=3)]
        else:
            wls = [W.single_session(512), W.agent()]
        titles = {w.name: w.title for w in wls}
        n_pool = max(b.content for w in wls for b in w.unique) + 1
        t = time.perf_counter()
        pool = W.PagePool(layout, n_pool)
        print(f"page pool: {n_pool} blocks in {time.perf_counter() - t:.1f} s", flush=True)
        rows: list[dict[str, Any]] = []
        order = list(SIDES)
        for rep in range(reps):
            for wl in wls:
                rot = order[rep % len(order) :] + order[: rep % len(order)]
                for name in rot:
                    r = measure(SIDES[name], wl, pool, base, rep, stride, a.step_blocks, STEP_S)
                    rows.append(r)
                    print(
                        f"rep {rep} {wl.name:6s} {name:18s} store {r['store_gbps']:.3f} GB/s  "
                        f"load {r['load_gbps']:.3f} cold {r['cold_load_gbps']:.3f}  B/tok {r['bpt_du_b']:.0f}  "
                        f"p99 {r['lookup']['hit_final_p99_ms']:.0f} ms  "
                        f"first hit {r['restart_first_hit_s']:.2f} s  exact {r['load_ok']}+{r['cold_ok']} wrong "
                        f"{r['load_wrong'] + r['cold_wrong']}  [{time.perf_counter() - t_start:.0f} s]",
                        flush=True,
                    )
        summary = summarize(rows)
        tg = targets(summary)
        crash: list[dict[str, Any]] = []
        if not a.no_crash:
            single = wls[0]
            files = {}
            for g, arr in pool.data.items():
                p = base / f"pool.g{g}.npy"
                W.np.save(p, arr[: max(b.content for b in single.unique) + 1])
                files[g] = str(p)
            cases = [
                ("fs: engine killed", "fs", "engine"),
                ("kvstore: engine killed", "kvstore", "engine"),
                ("kvstore: daemon killed", "kvstore", "daemon"),
                ("kvstore --no-sync: daemon killed", "kvstore --no-sync", "daemon"),
            ]
            if a.quick:
                cases = cases[2:3]
            for name, side, target in cases:
                try:
                    c = crash_case(name, SIDES[side], target, single, pool, files, base, stride, a.step_blocks)
                except Exception as e:  # one case's failure (e.g. a daemon that cannot start) is reported, not fatal
                    c = {"case": name, "side": side, "killed": target, "error": f"{type(e).__name__}: {e}"[-600:]}
                crash.append(c)
                print(f"crash {name}: {json.dumps({k: v for k, v in c.items() if k != 'child_log_tail'})}", flush=True)
        full: list[dict[str, Any]] = []
        if not a.no_full_disk:
            single = wls[0]
            size = (16 if a.quick else 48) << 20
            fcases = [
                ("fs, small ext4", SIDES["fs"], True),
                ("kvstore, small ext4", SIDES["kvstore"], True),
                (
                    "kvstore, --ssd-max-map-bytes",
                    W.Side("kvstore", "kvstore", ("--ssd-max-map-bytes", str(size)), True),
                    False,
                ),
            ]
            for name, side, loop in fcases[:2] if a.quick else fcases:
                try:
                    c = full_disk_case(name, side, single, pool, base, stride, a.step_blocks, size, loop)
                except Exception as e:
                    c = {"case": name, "side": side.name, "error": f"{type(e).__name__}: {e}"[-600:]}
                full.append(c)
                print(f"full disk {name}: {json.dumps(c)[:1500]}", flush=True)
        wall = time.perf_counter() - t_start
        cfg = {
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "reps": reps,
            "step_blocks": a.step_blocks,
            "step_ms": a.step_ms,
            "quick": a.quick,
        }
        md = report(cmd, info, cfg, rows, summary, tg, crash, full, pool, wall, titles)
        out_prefix.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{out_prefix}.md").write_text(md + "\n")
        Path(f"{out_prefix}.json").write_text(
            json.dumps(
                {
                    "command": cmd,
                    "machine": info,
                    "config": cfg,
                    "wall_s": wall,
                    "summary": summary,
                    "targets": tg,
                    "rows": rows,
                    "crash": crash,
                    "full_disk": full,
                    "page_bytes": {"kinds": pool.kinds, "scales": pool.scale_stats, "extent": pool.extent},
                },
                indent=1,
                default=str,
            )
            + "\n"
        )
        plot(summary, Path(f"{out_prefix}.png"), titles)
        print(f"wrote {out_prefix}.md/.json/.png in {wall:.0f} s")
        for t in tg:
            print(
                f"  {t['workload']:6s} {t['side']:18s} {t['target']:55s} {f(t['ratio'])}  "
                f"{'met' if t['met'] else 'NOT met'}"
            )
    finally:
        shutil.rmtree(base, ignore_errors=True) if not a.work_dir else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
