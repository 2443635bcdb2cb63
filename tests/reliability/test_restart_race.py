"""Same-host clients against a daemon that is SIGKILLed and restarted in a loop: every failure is a
status (a KvstoreError), never an OSError.

A reader with its own Client once failed with ``OSError: [Errno 9] Bad file descriptor`` while the
daemon was up. The cause: a call whose pooled local socket broke as it was written (the daemon
died between the pool's liveness check and the write) tried a fresh socket, which failed too (no
daemon), and the channel then put the *closed* first socket back in its pool; the next call took it
and its liveness check raised EBADF, outside any handler. The first test recreates that state
with a real Unix socket whose far end is shut for reading (as a dying daemon's is) and no daemon to
reconnect to (the one local channel: AsyncClient calls through its Client's); the last one runs
the clients of the report (a reader, a writer, an evictor, and an async reader, each with its own
client, in one process) across 20 real kills.
"""

from __future__ import annotations

import asyncio
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from kvstore.client import Client
from kvstore.client.aio import AsyncClient
from kvstore.errors import KvstoreError
from kvstore.server.process import DaemonProcess
from kvstore.transport import local_channel
from kvstore.v1 import kvstore_pb2 as pb
from tests.helpers.daemon import make_session, save_session

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.reliability.launcher import daemon, make_spawner

INFO = "/kvstore.v1.KVStore/GetServerInfo"
KILLS = 20


class Peer:
    """The daemon's end of the local socket, as a real listening Unix socket at ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(8)

    def dying(self) -> socket.socket:
        """Accept the client's pooled connection and leave it as a dying daemon does: shut for
        reading (the client's next write fails with EPIPE, yet it sees no end of stream), with no
        listener left to reconnect to."""
        conn, _ = self.listener.accept()
        conn.shutdown(socket.SHUT_RD)
        self.listener.close()
        self.path.unlink()
        return conn

    @staticmethod
    def serving(path: Path) -> threading.Thread:
        """A daemon back at ``path``: answers one GetServerInfo call on one connection."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(8)

        def serve() -> None:
            with listener, listener.accept()[0] as conn:
                conn.recv(1 << 16)  # the call, whole (one small write)
                conn.sendall(local_channel.frame(local_channel.MSG, pb.ServerInfo(version="back").SerializeToString())
                             + local_channel.frame(local_channel.STATUS, b"\x00"))

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        return t


@pytest.fixture
def sock_path(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "d.sock"
    yield path
    path.unlink(missing_ok=True)


def test_a_failed_reconnect_leaves_no_closed_socket_in_the_pool(sock_path: Path) -> None:
    peer = Peer(sock_path)
    channel = local_channel.LocalChannel(str(sock_path))
    channel.probe()  # one connected socket, pooled
    dead = peer.dying()
    call = channel.unary_unary(INFO, pb.GetServerInfoRequest.SerializeToString, pb.ServerInfo.FromString)
    with pytest.raises(grpc.RpcError) as e:
        call(pb.GetServerInfoRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    served = Peer.serving(sock_path)
    assert call(pb.GetServerInfoRequest(), timeout=10).version == "back"  # before the fix: OSError EBADF
    served.join(10)
    dead.close()
    channel.close()


# -- the clients of the report, across real SIGKILLs ----------------------------------------------------
SESSIONS = [make_session(namespace="race", session_id=f"s{i}", tokens=600, seed=i) for i in range(3)]


class Worker:
    """One thread with its own client, repeating one operation until told to stop; every exception
    it meets is kept, with whether it is a status (KvstoreError)."""

    def __init__(self, name: str, op: Callable[[], object]) -> None:
        self.name = name
        self.op = op
        self.ok = 0
        self.statuses = 0
        self.other: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.op()
                self.ok += 1
            except KvstoreError:
                self.statuses += 1
            except Exception as e:  # the bug: anything that is not a status
                self.other.append(f"{self.name}: {type(e).__name__}: {e}")
                time.sleep(0.001)


def _loaded(c: Client, i: int) -> None:
    s = SESSIONS[i % len(SESSIONS)]
    _, chunks = c.load_session(s.namespace, s.session_id)
    assert {k: bytes(b) for k, b in chunks} == dict(enumerate(s.blobs))


def _async_reader(address: str, stop: threading.Event, w: Worker) -> Callable[[], object]:
    def run() -> None:
        async def go() -> None:
            async with AsyncClient(address=address, retries=0, timeout_s=10, arena_bytes=1 << 20) as c:
                while not stop.is_set():
                    try:
                        s = SESSIONS[w.ok % len(SESSIONS)]
                        _, chunks = await c.load_session(s.namespace, s.session_id)
                        assert {k: bytes(b) async for k, b in chunks} == dict(enumerate(s.blobs))
                        w.ok += 1
                    except KvstoreError:
                        w.statuses += 1
                        await asyncio.sleep(0.001)
                    except Exception as e:
                        w.other.append(f"async reader: {type(e).__name__}: {e}")
        asyncio.run(go())
    return run


def test_same_host_clients_across_sigkills_fail_only_with_statuses(tmp_path: Path) -> None:
    zygote = make_spawner("fork")
    port = _free_port()
    flags = ["--port", str(port), "--log-format", "text"]
    rng = random.Random(19)

    def up() -> DaemonProcess:
        d = daemon(zygote, tmp_path / "data", flags, tmp_path / "log").spawn()
        assert d.wait_ready(60), d.log()[-3000:]
        return d

    d = up()
    address = f"127.0.0.1:{port}"
    with Client(address=address, arena_bytes=1 << 20) as c:
        for s in SESSIONS:
            save_session(c, s)
    clients = [Client(address=address, retries=0, timeout_s=10, arena_bytes=1 << 20) for _ in range(3)]
    reader, writer, evictor = clients
    n = iter(range(1 << 30))
    workers = [Worker("reader", lambda: _loaded(reader, next(n))),
               Worker("writer", lambda: save_session(writer, SESSIONS[next(n) % len(SESSIONS)])),
               Worker("evictor", lambda: evictor.evict("race", SESSIONS[next(n) % len(SESSIONS)].session_id, "ssd"))]
    async_worker = Worker("async reader", lambda: None)
    async_worker.thread = threading.Thread(target=_async_reader(address, async_worker.stop, async_worker), daemon=True)
    workers.append(async_worker)
    try:
        for w in workers:
            w.thread.start()
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.05, 0.2))
            d.kill()
            d = up()
        time.sleep(0.5)
    finally:
        for w in workers:
            w.stop.set()
        for w in workers:
            w.thread.join(30)
        for c in clients:
            c.close()
        d.kill()
        zygote.close()
    other = [e for w in workers for e in w.other]
    assert not other, other[:10]
    assert all(w.ok > 0 for w in workers), [(w.name, w.ok, w.statuses) for w in workers]
    assert sum(w.statuses for w in workers) > 0  # the kills were felt: the clients did meet dead daemons


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
