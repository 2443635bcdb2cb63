"""Load and soak: many concurrent clients mixing save, load, lookup and stats against one daemon.

``processes`` worker processes (spawned, so each has its own GIL) run ``threads`` clients each;
every client owns two sessions in one of four namespaces (chunk 0 shared by the namespace) and
loops: save a new version (SaveChunks + CommitSession), load one of its sessions (LoadSession, then
compare every byte with what it committed), look up one (Lookup), or read the daemon's Stats; now
and then it replaces its ``Client`` by a new one, as agents come and go. Any exception or mismatch
is an error. Latencies are kept after ``warmup_s``; the parent samples the daemon's VmRSS and open
file descriptors every second, and the RSS growth reported is from the end of the warm-up to the
last sample while every client still runs (RSS and fds once they have all closed are reported
too). The daemon is a real ``kvstore serve`` process, stopped with SIGTERM at the end: it must
exit cleanly.

    from benchmarks.reliability.soak import SoakConfig, run_soak
    result = run_soak(SoakConfig(duration_s=30), workdir)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.reliability.launcher import daemon, describe_exit, make_spawner
from benchmarks.reliability.workload import CHUNK_TOKENS, Version, version
from kvstore.client import Client, ClientConfig
from kvstore.format.keys import ROOT

RPCS = ("SaveChunks", "CommitSession", "LoadSession", "Lookup", "Stats")
MIX = (("save", 0.3), ("load", 0.35), ("lookup", 0.25), ("stats", 0.1))
NAMESPACES = ("soak-a", "soak-b", "soak-c", "soak-d")
SAMPLE_S = 1.0


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 30.0  # including the warm-up
    warmup_s: float = 8.0
    processes: int = 4
    threads: int = 16  # clients per process: processes * threads clients in all
    seed: int = 20261130
    write_mode: str = "through"
    churn: float = 0.01  # chance, before each operation, that a client is replaced by a new one

    @property
    def clients(self) -> int:
        return self.processes * self.threads


@dataclass(frozen=True)
class RpcLatency:
    calls: int
    p50_ms: float
    p99_ms: float
    max_ms: float


@dataclass
class SoakResult:
    config: SoakConfig
    measured_s: float = 0.0
    ops: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    error_kinds: dict[str, int] = field(default_factory=dict)  # "op: Exception: message head" -> count
    bytes_verified: int = 0
    rpcs: dict[str, RpcLatency] = field(default_factory=dict)
    series: list[tuple[float, float, int]] = field(default_factory=list)  # (s since start, RSS MiB, fds)
    rss_warm_mib: float = 0.0  # at the end of the warm-up
    rss_end_mib: float = 0.0
    rss_max_mib: float = 0.0
    rss_slope_mib_per_min: float = 0.0  # least-squares slope after the warm-up
    fds_warm: int = 0
    fds_end: int = 0
    daemon_cpu_pct: float = 0.0  # after the warm-up; 100 = one core
    rss_after_mib: float = 0.0  # once every client has closed
    fds_after: int = 0
    daemon_exit: str = ""

    @property
    def rss_growth_mib(self) -> float:
        return self.rss_end_mib - self.rss_warm_mib

    @property
    def rss_growth_pct(self) -> float:
        return 100.0 * self.rss_growth_mib / self.rss_warm_mib if self.rss_warm_mib else 0.0

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "rss_growth_mib": round(self.rss_growth_mib, 2),
                "rss_growth_pct": round(self.rss_growth_pct, 2), "ops_per_s": round(self.ops / self.measured_s, 1)
                if self.measured_s else 0.0}


# -- one client (a thread in a worker process) ----------------------------------------------------
class _SoakClient:
    def __init__(self, index: int, address: str, config: SoakConfig) -> None:
        self.rng = random.Random(config.seed * 7919 + index)
        ns = NAMESPACES[index % len(NAMESPACES)]
        self.refs = [(ns, f"c{index}-s{j}") for j in range(2)]
        self.acked: dict[tuple[str, str], int] = {}
        self.next = dict.fromkeys(self.refs, 0)
        self.seed, self.churn = config.seed, config.churn
        self.t_warm = self.deadline = 0.0  # set when the clock starts
        self.client_config = ClientConfig(address=address, retries=0, timeout_s=60.0, arena_bytes=1 << 20)
        self.client = Client(self.client_config)
        self.lat: dict[str, list[float]] = {r: [] for r in RPCS}
        self.errors: list[str] = []
        self.ops = 0
        self.bytes_verified = 0

    def _timed(self, rpc: str, fn: Any, *args: Any) -> Any:
        t = time.monotonic()
        out = fn(*args)
        if t >= self.t_warm:
            self.lat[rpc].append(time.monotonic() - t)
        return out

    def run(self) -> None:
        for ref in self.refs:  # every session exists before the mix starts
            self._guard(self.save, ref)
        ops = [op for op, _ in MIX]
        weights = [w for _, w in MIX]
        while time.monotonic() < self.deadline:
            if self.rng.random() < self.churn:  # an agent leaves and another connects
                self.client.close()
                self.client = Client(self.client_config)
            op = self.rng.choices(ops, weights)[0]
            ref = self.rng.choice(self.refs)
            self._guard(getattr(self, op if ref in self.acked else "save"), ref)
        for ref in self.refs:  # and each is intact at the end
            if ref in self.acked:
                self._guard(self.load, ref)
        self.client.close()

    def _guard(self, fn: Any, ref: tuple[str, str]) -> None:
        try:
            fn(ref)
            self.ops += 1
        except Exception as e:  # every failure is an error of the soak, whatever its kind
            self.errors.append(f"{fn.__name__} {ref}: {type(e).__name__}: {e}"[:500])

    def _version(self, ref: tuple[str, str], number: int) -> Version:
        return version(self.seed, ref[0], ref[1], number)

    def save(self, ref: tuple[str, str]) -> None:
        number = self.next[ref]
        self.next[ref] += 1
        v = self._version(ref, number)
        self._timed("SaveChunks", self.client.save_chunks, ref[0], v.manifest.layout_id, ROOT, 0, list(v.blobs))
        self._timed("CommitSession", self.client.commit, v.manifest)
        self.acked[ref] = number

    def load(self, ref: tuple[str, str]) -> None:
        want = self._version(ref, self.acked[ref])

        def load_all() -> tuple[Any, dict[int, bytes]]:
            manifest, chunks = self.client.load_session(*ref)
            return manifest, {i: bytes(b) for i, b in chunks}

        manifest, got = self._timed("LoadSession", load_all)
        if manifest.metadata.get("v") != str(want.number) or got != dict(enumerate(want.blobs)):
            raise AssertionError(f"served version {manifest.metadata.get('v')} with chunks {sorted(got)}, "
                                 f"not version {want.number} bit-exact")
        self.bytes_verified += sum(len(b) for b in got.values())

    def lookup(self, ref: tuple[str, str]) -> None:
        want = self._version(ref, self.acked[ref])
        hit = self._timed("Lookup", self.client.lookup, ref[0], want.manifest.layout_id, want.token_ids)
        if hit.chunks < len(want.keys):
            raise AssertionError(f"Lookup found {hit.chunks} of {len(want.keys)} chunks")

    def stats(self, ref: tuple[str, str]) -> None:
        self._timed("Stats", self.client.stats)


def _worker(index: int, address: str, config: SoakConfig, barrier: Any, out: Any) -> None:
    """One worker process: ``threads`` clients; sends back latencies, counts and errors. The clock
    starts when every process has its clients (CLOCK_MONOTONIC is one clock for the whole host)."""
    clients = [_SoakClient(index * config.threads + i, address, config) for i in range(config.threads)]
    barrier.wait()
    t0 = time.monotonic()
    for c in clients:
        c.t_warm, c.deadline = t0 + config.warmup_s, t0 + config.duration_s
    threads = [threading.Thread(target=c.run, daemon=True) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put({"lat": {r: np.concatenate([np.asarray(c.lat[r], dtype=np.float64) for c in clients]) for r in RPCS},
             "errors": [e for c in clients for e in c.errors], "ops": sum(c.ops for c in clients),
             "bytes": sum(c.bytes_verified for c in clients)})


# -- the parent ------------------------------------------------------------------------------------
def _error_kind(error: str) -> str:
    """``"save ('ns', 'c1-s0'): InvalidArgument: unknown arena: ..."`` -> ``"save: InvalidArgument: unknown arena"``."""
    op, _, rest = error.partition(" ")
    kind = rest.split("): ", 1)[-1]
    return f"{op}: {':'.join(kind.split(':')[:2])}"


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_status(pid: int) -> tuple[float, int]:
    """(VmRSS in MiB, open file descriptors) of ``pid``."""
    rss_kb = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kb = int(line.split()[1])
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def run_soak(config: SoakConfig, workdir: Path) -> SoakResult:
    workdir.mkdir(parents=True, exist_ok=True)
    flags = ["--chunk-tokens", str(CHUNK_TOKENS), "--write-mode", config.write_mode]
    d = daemon(make_spawner("exec"), workdir / "data", flags, workdir / "daemon.log").spawn()
    result = SoakResult(config)
    try:
        if not d.wait_ready(120):
            raise RuntimeError(f"the daemon did not start:\n{d.log()[-3000:]}")
        result = _drive(config, d.address, d.pid, result)
        os.kill(d.pid, signal.SIGTERM)
    finally:
        try:
            result.daemon_exit = describe_exit(d.wait(30))
        except subprocess.TimeoutExpired:
            d.kill()
            result.daemon_exit = "hung; killed"
    return result


def _drive(config: SoakConfig, address: str, pid: int, result: SoakResult) -> SoakResult:
    ctx = mp.get_context("spawn")
    out, barrier = ctx.Queue(), ctx.Barrier(config.processes + 1)
    procs = [ctx.Process(target=_worker, args=(i, address, config, barrier, out), daemon=True)
             for i in range(config.processes)]
    for p in procs:
        p.start()
    samples: list[tuple[float, float, int]] = [(time.monotonic(), *_proc_status(pid))]
    barrier.wait(timeout=300)
    t0 = time.monotonic()
    t_warm, deadline = t0 + config.warmup_s, t0 + config.duration_s
    cpu_warm = 0.0
    while time.monotonic() < deadline - SAMPLE_S / 2:  # every sample while all clients still run
        samples.append((time.monotonic(), *_proc_status(pid)))
        if not cpu_warm and samples[-1][0] >= t_warm:
            cpu_warm = _cpu_s(pid)
        time.sleep(min(SAMPLE_S, max(0.0, deadline - SAMPLE_S / 2 - time.monotonic())))
    samples.append((time.monotonic(), *_proc_status(pid)))
    if cpu_warm:
        result.daemon_cpu_pct = round(100 * (_cpu_s(pid) - cpu_warm) / (samples[-1][0] - t_warm), 1)
    parts = [out.get(timeout=config.duration_s + 300) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    result.rss_after_mib, result.fds_after = _proc_status(pid)  # every client closed
    warm = [s for s in samples if s[0] >= t_warm] or samples[-1:]
    result.series = [(round(s[0] - t0, 1), round(s[1], 1), s[2]) for s in samples]
    if len(warm) >= 3:
        fit = statistics.linear_regression([s[0] for s in warm], [s[1] for s in warm])
        result.rss_slope_mib_per_min = round(fit.slope * 60, 3)
    result.rss_warm_mib, result.fds_warm = warm[0][1], warm[0][2]
    result.rss_end_mib, result.fds_end = samples[-1][1], samples[-1][2]
    result.rss_max_mib = max(s[1] for s in warm)
    result.measured_s = deadline - t_warm
    result.ops = sum(p["ops"] for p in parts)
    result.bytes_verified = sum(p["bytes"] for p in parts)
    errors = [e for p in parts for e in p["errors"]]
    result.errors, result.error_samples = len(errors), errors[:20]
    result.error_kinds = dict(Counter(_error_kind(e) for e in errors))
    for rpc in RPCS:
        lat = np.concatenate([p["lat"][rpc] for p in parts]) * 1000
        if len(lat):
            result.rpcs[rpc] = RpcLatency(len(lat), round(float(np.percentile(lat, 50)), 2),
                                          round(float(np.percentile(lat, 99)), 2), round(float(lat.max()), 2))
    return result
