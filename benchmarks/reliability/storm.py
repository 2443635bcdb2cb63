"""The SIGKILL storm: writers save, commit, delete and evict sessions through a real daemon while
the harness SIGKILLs it at random moments, restarts it and checks every session.

One kill point is one SIGKILL: while the writers run (a random moment, or 0-4 ms after a writer
sends a save, commit, delete or evict) or while the daemon starts (a random moment between spawning
it and it answering: opening LMDB, loading manifests, collecting garbage). After each kill the
daemon is restarted on the same port and data directory, and before any writer resumes, every
session is read back: an acknowledged state must be there bit-exact (or gone, after an
acknowledged delete), an unacknowledged one may be there only whole (see ``oracle``). A daemon that
exits on its own, fails to start, or answers an error while alive is a failure too.

    from benchmarks.reliability.storm import StormConfig, run_storm
    result = run_storm(StormConfig(kills=50, write_mode="back"), workdir)
"""

from __future__ import annotations

import random
import signal
import socket
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from benchmarks.reliability.launcher import daemon, describe_exit, make_spawner
from benchmarks.reliability.oracle import ABSENT, CheckReport, Oracle
from benchmarks.reliability.workload import CHUNK_TOKENS
from benchmarks.reliability.writers import Gate, Writer
from kvstore.client import Client, ClientConfig
from kvstore.errors import KvstoreError, Unavailable
from kvstore.server.process import DaemonProcess

KINDS = ("running", "save", "commit", "delete", "evict", "startup")
KIND_WEIGHTS = (0.25, 0.15, 0.25, 0.10, 0.10, 0.15)
NAMESPACES = ("storm-a", "storm-b")
#: Session ids of several lengths; 6 characters in a 7-character namespace make the manifest key
#: ``m:storm-a/xxxxxx`` exactly 16 bytes, the length of a chunk key.
SESSION_IDS = ("w{w}-s00", "w{w}-agent-{n}", "w{w}s{n}", "w{w}-long-session-{n}")
START_TIMEOUT_S = 60.0
TRIGGER_TIMEOUT_S = 2.0
PROGRESS_EVERY = 100


@dataclass(frozen=True)
class StormConfig:
    kills: int = 50
    write_mode: str = "through"  # through | back
    writers: int = 4
    seed: int = 20261130
    launcher: str = "fork"  # fork (a zygote forks each daemon) | exec (`kvstore serve` each time)
    #: Keep each writer's Client across restarts, on the same port (what an agent does). False: a
    #: fresh Client per start, on a fresh port (the workaround while clients could not re-attach).
    reuse_clients: bool = True
    max_run_s: float = 0.4  # longest stretch the writers run before a "running" kill
    #: Add a shared Redis tier behind the ssd tier (Redis itself is not killed); writers then also
    #: evict sessions down to it.
    redis_url: str = ""


@dataclass
class StormResult:
    config: StormConfig
    kill_points: int = 0
    kills_by_kind: dict[str, int] = field(default_factory=dict)
    startup_kills_before_ready: int = 0
    restarts: int = 0
    checks: int = 0
    sessions_checked: int = 0  # session reads over all checks
    acked_sessions_checked: int = 0  # of which the state was acknowledged (exactly known)
    present_checked: int = 0
    chunks_compared: int = 0
    acked_ops: dict[str, int] = field(default_factory=dict)
    errors_after_kill: int = 0  # operations the kills broke (expected)
    violations: list[str] = field(default_factory=list)  # lost / corrupt / half-visible / crash / live error
    error_kinds: dict[str, int] = field(default_factory=dict)
    start_s_p50: float = 0.0
    start_s_max: float = 0.0
    duration_s: float = 0.0
    #: At the last check: distinct chunks the live sessions use, and records the ssd tier holds
    #: (more records than chunks = what crashed saves left behind and no restart collected).
    final_live_chunks: int = 0
    final_ssd_items: int = 0

    @property
    def lost_or_corrupt(self) -> int:
        return len(self.violations)

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "lost_or_corrupt": self.lost_or_corrupt}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sessions(config: StormConfig) -> list[list[tuple[str, str]]]:
    per_writer = []
    for w in range(config.writers):
        ns = NAMESPACES[w % len(NAMESPACES)]
        per_writer.append([(ns, pattern.format(w=w, n=w * 7 % 10)) for pattern in SESSION_IDS])
    return per_writer


class Storm:
    def __init__(self, config: StormConfig, workdir: Path,
                 progress: Callable[[StormResult], None] | None = None) -> None:
        self.config = config
        self.progress = progress
        self.workdir = workdir
        self.rng = random.Random(config.seed)
        # A fresh client per start gets a fresh port per start: gRPC shares subchannels between
        # channels to one address, and one that failed against the dead daemon stays in reconnect
        # backoff (~1 s) for every new channel. Clients kept across restarts need the same port.
        self.port = _free_port() if config.reuse_clients else 0
        self.flags = ["--port", str(self.port), "--write-mode", config.write_mode, "--chunk-tokens", str(CHUNK_TOKENS),
                      "--log-format", "text"]
        if config.redis_url:
            self.flags += ["--redis-url", config.redis_url]
        self.result = StormResult(config)
        self.spawner = make_spawner(config.launcher)
        refs = _sessions(config)
        self.oracle = Oracle(config.seed, [r for rs in refs for r in rs])
        self.gate = Gate()
        evict_to = ("ssd", "redis") if config.redis_url else ("ssd",)
        self.writers = [Writer(i, rs, self.oracle, self.gate, config.seed * 1000 + i, self.violation, evict_to)
                        for i, rs in enumerate(refs)]
        self.start_times: list[float] = []
        self.kill_times: dict[int, float] = {}  # generation -> when its daemon was killed
        self.live: dict[int, DaemonProcess] = {}  # spawned, not reaped yet

    def violation(self, what: str, where: str = "") -> None:
        where = where or f"kill point {self.result.kill_points}"
        self.result.violations.append(f"[seed {self.config.seed}, {where}] {what}")

    # -- the daemon -------------------------------------------------------------------------------
    def _spawn(self) -> DaemonProcess:
        d = daemon(self.spawner, self.workdir / "data", self.flags, self.workdir / "daemon.log").spawn()
        self.live[d.pid] = d
        return d

    def _reap(self, d: DaemonProcess) -> int:
        code = d.wait()
        del self.live[d.pid]
        return code

    def _start(self) -> DaemonProcess:
        for _ in range(3):  # a refused start is a violation; then try again to keep going
            d = self._spawn()
            if d.wait_ready(START_TIMEOUT_S):
                self.start_times.append(time.monotonic() - d.started)
                self.result.restarts += 1
                return d
            d.kill()
            status = describe_exit(self._reap(d))
            self.violation(f"the daemon did not start ({status}); log tail: {self._log_tail()}")
        raise RuntimeError(f"the daemon failed to start three times:\n{self._log_tail()}")

    def _kill(self, d: DaemonProcess) -> None:
        crashed = d.exited()
        d.kill()
        code = self._reap(d)
        if crashed or code != -signal.SIGKILL:
            self.violation(f"the daemon exited on its own ({describe_exit(code)}); log: {self._log_tail()}")

    def _log_tail(self) -> str:
        path = self.workdir / "daemon.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def _client(self, address: str) -> Client:
        return Client(ClientConfig(address=address, retries=0, timeout_s=30.0, arena_bytes=1 << 20))

    # -- one kill point -----------------------------------------------------------------------------
    def _startup_kill(self) -> None:
        estimate = max(self.start_times[-5:], default=0.1)
        d = self._spawn()
        time.sleep(self.rng.uniform(0.0, estimate))
        self.result.startup_kills_before_ready += not d.poll_ready()
        self._kill(d)

    def _check(self, d: DaemonProcess) -> None:
        try:
            with self._client(d.address) as client:
                _wait_until_answering(client)
                report: CheckReport = self.oracle.check(client)
                stats = client.stats()
        except (KvstoreError, grpc.RpcError) as e:
            gone = d.exited()
            raise RuntimeError(f"the check failed ({type(e).__name__}: {e}); daemon {d.pid} "
                               f"{'exited' if gone else 'is up'}; log tail:\n{self._log_tail()}") from e
        r = self.result
        r.checks += 1
        r.sessions_checked += report.sessions
        r.acked_sessions_checked += report.acked_checked
        r.present_checked += report.present
        r.chunks_compared += report.chunks
        for v in report.violations:
            self.violation(v)
        live = {k for ref, st in self.oracle.states.items() for n in st.allowed if n != ABSENT
                for k in self.oracle.version(ref, n).keys}
        r.final_live_chunks = len(live)
        r.final_ssd_items = next((int(t.items) for t in stats.tiers if t.name == "ssd"), -1)
        for t in stats.tiers:
            if t.verify_failures or t.errors:
                self.violation(f"tier {t.name}: {t.verify_failures} verify failures, {t.errors} errors "
                               f"after a restart ({t.last_error})")

    def _run_until_kill(self, kind: str, d: DaemonProcess) -> None:
        event = threading.Event()
        if kind != "running":
            self.gate.listeners = {kind: event}
        if kind == "running":
            time.sleep(self.rng.uniform(0.01, self.config.max_run_s))
        else:
            event.wait(TRIGGER_TIMEOUT_S)
            time.sleep(self.rng.uniform(0.0, 0.004))
        self.gate.listeners = {}
        self.kill_times[self.gate.generation] = time.monotonic()
        self._kill(d)
        self.gate.close_and_drain()

    def run(self) -> StormResult:
        t0 = time.monotonic()
        for w in self.writers:
            w.start()
        clients: list[Client | None] = [None] * len(self.writers)
        try:
            plan = self.rng.choices(KINDS, KIND_WEIGHTS, k=self.config.kills)
            for kind in plan:
                if self.progress is not None and self.result.kill_points % PROGRESS_EVERY == 0:
                    self.result.acked_ops = self._acked()
                    self.progress(self.result)
                self.result.kill_points += 1
                self.result.kills_by_kind[kind] = self.result.kills_by_kind.get(kind, 0) + 1
                if kind == "startup":
                    self._startup_kill()
                    continue
                d = self._start()
                self._check(d)
                if not self.config.reuse_clients or clients[0] is None:
                    for c in clients:
                        if c is not None:
                            c.close()
                    clients = [self._client(d.address) for _ in self.writers]
                self.gate.reopen(clients)
                self._run_until_kill(kind, d)
            d = self._start()  # the last kill's wreckage, then a graceful stop and start
            self._check(d)
            _terminate(d)
            self._reap(d)
            d = self._start()
            self._check(d)
            _terminate(d)
            self._reap(d)
        finally:
            self.gate.stop()
            for c in clients:
                if c is not None:
                    c.close()
            for d in list(self.live.values()):
                d.kill()
                self._reap(d)
            self.spawner.close()
        self._account(time.monotonic() - t0)
        return self.result

    def _acked(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for w in self.writers:
            out.update(w.acked)
        return dict(out)

    def _account(self, duration: float) -> None:
        r = self.result
        r.duration_s = duration
        r.start_s_p50 = statistics.median(self.start_times) if self.start_times else 0.0
        r.start_s_max = max(self.start_times, default=0.0)
        kinds: Counter[str] = Counter()
        r.acked_ops = self._acked()
        for w in self.writers:
            for e in w.errors:
                killed = self.kill_times.get(e.generation)
                if killed is not None and e.at >= killed:
                    r.errors_after_kill += 1
                    kinds[f"{e.op}: {e.error.split(':')[0]}"] += 1
                else:
                    self.violation(f"writer {w.index}: {e.op} failed while the daemon was up: {e.error}",
                                   f"daemon start {e.generation}")
            for v in w.read_report.violations:
                self.violation(v)
        r.error_kinds = dict(kinds)


def _wait_until_answering(client: Client, timeout_s: float = 15.0) -> None:
    """A daemon that printed its address answers; on a reused port the channel may first sit out
    gRPC's reconnect backoff from the dead daemon."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.health()
            return
        except Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _terminate(d: DaemonProcess) -> None:
    assert d.proc is not None
    d.proc.terminate()
    deadline = time.monotonic() + 30
    while not d.exited() and time.monotonic() < deadline:
        time.sleep(0.01)


def run_storm(config: StormConfig, workdir: Path, progress: Callable[[StormResult], None] | None = None
              ) -> StormResult:
    """Run one storm in ``workdir`` (a fresh data directory is made under it); ``progress`` is
    called with the running result every ``PROGRESS_EVERY`` kill points."""
    workdir.mkdir(parents=True, exist_ok=True)
    return Storm(config, workdir, progress).run()
