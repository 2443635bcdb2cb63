"""A real Redis Cluster on loopback ports, for the scale-out tests and the benchmark.

``RedisClusterProcess`` starts ``masters`` (x ``1 + replicas``) ``redis-server --cluster-enabled
yes`` processes, joins them with ``redis-cli --cluster create``, and waits until every node sees
all slots served and every replica in sync. Nodes can be killed (SIGKILL), paused (SIGSTOP) and
resumed; ``wait_for_failover`` waits until a replica has taken over a dead master's slots.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

#: Why the cluster tests cannot run here, or None.
MISSING = next((f"{tool} is not on PATH (install the redis-server and redis-tools packages)"
                for tool in ("redis-server", "redis-cli") if shutil.which(tool) is None), None)


def require_cluster() -> None:
    """Skip the calling test module where no cluster can be started; fail it instead where
    KVSTORE_REQUIRE_REDIS_CLUSTER is set (CI, which installs what they need)."""
    if MISSING is None:
        return
    if os.environ.get("KVSTORE_REQUIRE_REDIS_CLUSTER"):
        raise RuntimeError(f"KVSTORE_REQUIRE_REDIS_CLUSTER is set but {MISSING}")
    pytest.skip(f"Redis Cluster tests need a real cluster: {MISSING}", allow_module_level=True)
NODE_TIMEOUT_MS = 1000  # failure detection; a failover takes about twice this


SPAWN_ATTEMPTS = 3


class _Died(Exception):
    """A node's process exited before it answered."""


def _free_pair() -> int:
    """A port p such that p and its cluster bus port p + 10000 are both free."""
    for _ in range(200):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            if port + 10000 > 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisClusterProcess:
    """A Redis Cluster of real processes in ``workdir``; ``url`` names its first node."""

    def __init__(self, workdir: Path, masters: int = 3, replicas: int = 0, appendonly: bool = False) -> None:
        self.workdir = workdir
        self.masters = masters
        self.replicas = replicas
        self.appendonly = appendonly
        self.ports: list[int] = []
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self, timeout_s: float = 30.0) -> RedisClusterProcess:
        for _ in range(self.masters * (1 + self.replicas)):
            port = _free_pair()
            self.ports.append(port)
            self._spawn(port)
        for i, port in enumerate(self.ports):
            for attempt in range(SPAWN_ATTEMPTS):
                try:
                    self._wait_ping(port, timeout_s)
                    break
                except _Died:
                    # its ports were taken between the check and the bind (another process on this
                    # machine): the node starts again on a fresh pair
                    if attempt == SPAWN_ATTEMPTS - 1:
                        raise RuntimeError(f"redis-server exited at start, {SPAWN_ATTEMPTS} times; last log:\n"
                                           + self._log_tail(port)) from None
                    port = self.ports[i] = _free_pair()
                    self._spawn(port)
        if self.masters == 1 and not self.replicas:  # --cluster create wants 3 masters: one takes all slots
            with self.node(self.ports[0]) as r:
                r.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        else:
            subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                            "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout_s)
        self.wait_healthy(timeout_s)
        return self

    def _spawn(self, port: int) -> None:
        d = self.workdir / str(port)
        d.mkdir(parents=True, exist_ok=True)
        args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-require-full-coverage", "no",
                "--save", "", "--appendonly", "yes" if self.appendonly else "no"]
        with open(d / "log", "ab") as log:
            self.procs[port] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def _wait_ping(self, port: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1) as r:
            while True:
                try:
                    r.ping()
                    return
                except redis.ConnectionError:
                    if self.procs[port].poll() is not None:
                        raise _Died(port) from None
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server on port {port} did not come up:\n"
                                           + self._log_tail(port)) from None
                    time.sleep(0.02)

    def _log_tail(self, port: int) -> str:
        path = self.workdir / str(port) / "log"
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-5:]) if path.exists() else ""

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)

    def alive(self) -> list[int]:
        return [p for p in self.ports if self.procs[p].poll() is None]

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until every live node reports cluster_state ok and every live replica is in sync."""
        deadline = time.monotonic() + timeout_s
        while True:
            if all(self._healthy(p) for p in self.alive()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not become healthy in time")
            time.sleep(0.05)

    def _healthy(self, port: int) -> bool:
        with self.node(port) as r:
            try:
                if r.cluster("info")["cluster_state"] != "ok":
                    return False
                info = r.info("replication")
            except redis.RedisError:
                return False
        return info["role"] == "master" or info.get("master_link_status") == "up"

    def master_of(self, key: bytes) -> int:
        """The port of the master serving ``key``'s slot now."""
        with self.node(self.alive()[0]) as r:
            slot = r.cluster("keyslot", key)
            for lo, hi, master, *_ in r.cluster("slots"):
                if lo <= slot <= hi:
                    return int(master[1])
        raise LookupError(f"slot {slot} is not served")

    def replica_of(self, master: int) -> int:
        with self.node(master) as r:
            return int(r.info("replication")["slave0"]["port"])

    def role(self, port: int) -> str:
        with self.node(port) as r:
            return str(r.info("replication")["role"])

    def wait_for_failover(self, replica: int, timeout_s: float = 20.0) -> None:
        """Until ``replica`` is a master, every live node's slot map says so (gossip reaches the nodes
        one by one), and the cluster serves every slot again."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.role(replica) == "master" and all(self._serves(p, replica) for p in self.alive()):
                    break
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {replica} was not promoted within {timeout_s:.0f}s")
            time.sleep(0.05)
        self.wait_healthy(timeout_s)

    def _serves(self, port: int, master: int) -> bool:
        """Whether node ``port``'s slot map has ``master`` serving some slots."""
        with self.node(port) as r:
            return any(int(m[1]) == master for _, _, m, *_ in r.cluster("slots"))

    def signal(self, port: int, sig: signal.Signals) -> None:
        if self.procs[port].poll() is None:
            os.kill(self.procs[port].pid, sig)
            if sig == signal.SIGKILL:
                self.procs[port].wait()

    def stop(self) -> None:
        for port, proc in self.procs.items():
            if proc.poll() is None:
                self.signal(port, signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def running_cluster(workdir: Path, **kwargs: object) -> Iterator[RedisClusterProcess]:
    """A started cluster (``RedisClusterProcess(workdir, **kwargs)``), stopped on exit."""
    c = RedisClusterProcess(workdir, **kwargs)  # type: ignore[arg-type]
    try:
        yield c.start()
    finally:
        c.stop()


def cluster_flags(url: str, *extra: str) -> tuple[str, ...]:
    """`kvstore serve` flags for a daemon sharing sessions through the cluster at ``url``."""
    return ("--redis-url", url, "--redis-cluster", "--redis-share-sessions", *extra)
