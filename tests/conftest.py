"""Shared fixtures: throwaway redis-servers, and ``tier``, which yields each storage tier in turn."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvstore.tiers import (
    HbmTierConfig,
    HostTierConfig,
    RedisTierConfig,
    SsdTierConfig,
    Tier,
    TierConfig,
    make_tier,
)

if TYPE_CHECKING:
    from kvstore.store import SessionStore

TIER_KINDS = ("host", "ssd", "redis", "hbm")
TIER_CAPACITY = 64 << 20


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A redis-server without persistence on one localhost port; tests may kill and restart it."""

    def __init__(self, workdir: Path) -> None:
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._workdir = workdir
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server (again, on the same port) and wait until it answers PING."""
        import redis

        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self._proc = subprocess.Popen(
            ["redis-server", *args, "--dir", str(self._workdir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not come up") from None
                time.sleep(0.02)
            finally:
                client.close()

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-flight, as in a crash."""
        self._signal(signal.SIGKILL)
        if self._proc is not None:
            self._proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing, as in a hang."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def stop(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self.resume()
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, sig)


def _require_redis_server() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (install the redis-server package to run redis tier tests)")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a redis-server shared by the session; tests isolate themselves by namespace."""
    _require_redis_server()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server.url
    server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server, for tests that kill, pause or restart it."""
    _require_redis_server()
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def tier_capacity() -> int:
    """The ``capacity_bytes`` every ``tier`` is configured with."""
    return TIER_CAPACITY


@pytest.fixture(params=TIER_KINDS)
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    """Each tier in turn, empty, with ``capacity_bytes=TIER_CAPACITY``; hbm is skipped without CUDA."""
    kind = request.param
    if kind == "host":
        config: TierConfig = HostTierConfig(capacity_bytes=TIER_CAPACITY)
    elif kind == "ssd":
        config = SsdTierConfig(path=str(tmp_path / "ssd"), capacity_bytes=TIER_CAPACITY)
    elif kind == "redis":
        url = request.getfixturevalue("redis_url")
        config = RedisTierConfig(url=url, namespace=f"t-{uuid.uuid4().hex}", capacity_bytes=TIER_CAPACITY)
    else:
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("hbm tier needs CUDA")
        config = HbmTierConfig(capacity_bytes=TIER_CAPACITY)
    tier = make_tier(config)
    yield tier
    tier.close()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run a module's model code on one torch thread: tiny per-token ops only add OpenMP contention
    on a shared 2-core machine."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def sessions(tmp_path: Path) -> Iterator[SessionStore]:
    """A session store on the default tiers (host + LMDB) in ``tmp_path``, closed afterwards."""
    from kvstore.store import open_store
    from tests.helpers.store import store_config

    ss = open_store(store_config(tmp_path))
    yield ss
    ss.store.close()
