"""The daemon's local socket (kvstore/server/local.py, kvstore/transport/local_channel.py): a same-host client that
attached an arena makes every call over it, with the same answers and status codes as over gRPC;
the socket admits only the daemon's own user; bad framing costs only the connection that sent it."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvstore.client import Client
from kvstore.client.aio import AsyncClient
from kvstore.errors import InvalidArgument, NotFound, PermissionDenied
from kvstore.transport import local_channel, shm
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers.daemon import Daemon, SyntheticSession, make_session, running_daemon, start_daemon, transport_stats

pytestmark = pytest.mark.skipif(shm.default_shm_dir() is None, reason="no writable /dev/shm on this host")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("local") / "data") as d:
        yield d


@pytest.fixture
def ns() -> str:
    return f"l-{uuid.uuid4().hex[:12]}"


def local_calls(d: Daemon) -> int:
    return transport_stats(d).local_calls


def test_an_arena_client_makes_its_calls_over_the_local_socket(daemon: Daemon, ns: str) -> None:
    s = make_session(namespace=ns, tokens=700)
    before = local_calls(daemon)
    with Client(address=daemon.address, arena_bytes=4 << 20) as c:
        path = c.info().local_socket
        assert path and stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        c.save_session(s.manifest, s.blobs)
        _, chunks = c.load_session(ns, "s1")
        assert {i: bytes(b) for i, b in chunks} == dict(enumerate(s.blobs))
        assert [k for _, k in zip(s.blobs, c.load_chunks(ns, s.manifest.chunk_keys))]
        assert c.get_session(ns, "s1")[0].chunk_keys == s.manifest.chunk_keys
    # the attach (its memfd passed over the socket), save, load, load_chunks, get_session and the
    # detach at close: six calls, none of them on gRPC
    assert local_calls(daemon) == before + 6
    with Client(address=daemon.address, shared_memory=False) as c:
        c.load_session(ns, "s1")
    assert local_calls(daemon) == before + 6  # the stream client stays on gRPC


def test_errors_keep_their_status_codes(daemon: Daemon, ns: str) -> None:
    with Client(address=daemon.address) as c:
        c.connect()
        with pytest.raises(NotFound):
            c.get_session(ns, "missing")
        with pytest.raises(InvalidArgument, match="namespace"):
            c.list_sessions("bad namespace with spaces\n")
        # a client-streaming call refused at its header, then the same socket serves the next call
        with pytest.raises(grpc.RpcError) as e:
            header = pb.SaveHeader(namespace=ns, layout_id=bytes(16), parent_key=b"x")
            c._stub.SaveChunks(iter([pb.SaveChunksRequest(header=header), pb.SaveChunksRequest(data=b"y" * 1000)]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "parent_key" in e.value.details()
        assert c.list_sessions(ns) == []


def test_tokens_are_checked_as_over_grpc(tmp_path: pytest.TempPathFactory) -> None:
    tokens = tmp_path / "tokens.toml"  # type: ignore[operator]
    tokens.write_text('[tokens]\n"tok-a" = ["a"]\n"tok-admin" = ["*"]\n')
    with running_daemon(tmp_path / "data", "--tokens-file", str(tokens)) as d:  # type: ignore[operator]
        with Client(address=d.address, token="tok-a") as c:
            s = make_session(namespace="a", tokens=300)
            c.save_session(s.manifest, s.blobs)
            assert c._local is not None
            with pytest.raises(PermissionDenied):
                c.list_sessions("b")
        with Client(address=d.address, token="tok-admin", shared_memory=False) as admin:
            assert admin.stats().transport.local_calls >= 2


def test_bad_framing_costs_only_its_connection(daemon: Daemon) -> None:
    with Client(address=daemon.address) as c:
        path = c.info().local_socket
    # too long a frame; an unknown kind; a request before any call
    for junk in (b"\xff" * 64, struct.pack("<IB", 10, 9) + b"x" * 9, local_channel.frame(local_channel.MSG, b"x")):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            s.settimeout(5)
            s.sendall(junk)
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        assert data == b""  # the daemon closed the connection without an answer
    with Client(address=daemon.address) as c:  # the daemon serves on
        assert c.list_sessions("x") == []


def test_an_unknown_method_is_unimplemented(daemon: Daemon) -> None:
    with Client(address=daemon.address) as c:
        ch = local_channel.LocalChannel(c.info().local_socket)
    try:
        call = ch.unary_unary("/kvstore.v1.KVStore/NoSuchMethod", lambda m: m.SerializeToString(), bytes)
        with pytest.raises(grpc.RpcError) as e:
            call(pb.StatsRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        stub = pb_grpc.KVStoreStub(ch)  # a fresh socket from the pool after the one that was closed
        assert stub.ListSessions(pb.ListSessionsRequest(), timeout=5).sessions is not None
    finally:
        ch.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
def test_another_user_cannot_call(daemon: Daemon) -> None:
    with Client(address=daemon.address) as c:
        path = c.info().local_socket
    pid = os.fork()
    if pid == 0:  # the child: nobody, trying to connect
        code = 1
        try:
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
        except PermissionError:
            code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3


def test_the_async_client_takes_the_local_socket_too(daemon: Daemon, ns: str) -> None:
    s = make_session(namespace=ns, tokens=700)
    before = local_calls(daemon)

    async def run() -> dict[int, bytes]:
        async with AsyncClient(address=daemon.address, arena_bytes=4 << 20) as c:
            await c.save_session(s.manifest, s.blobs)
            assert c.client._local is not None and c.uses_shared_memory
            _, chunks = await c.load_session(ns, "s1")
            with pytest.raises(NotFound):
                await c.get_session(ns, "missing")
            return {i: bytes(b) async for i, b in chunks}

    assert asyncio.run(run()) == dict(enumerate(s.blobs))
    assert local_calls(daemon) == before + 5  # the attach, save, load, the failed get, the detach


def test_a_starting_daemon_removes_the_sockets_of_dead_daemons(tmp_path: pytest.TempPathFactory) -> None:
    shm_dir = shm.default_shm_dir()
    assert shm_dir is not None
    stale = shm_dir / f"kvstore-test-{uuid.uuid4().hex[:8]}.sock"  # what a SIGKILLed daemon leaves
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))
    assert stale.exists()
    try:
        with running_daemon(tmp_path / "data") as d, Client(address=d.address) as c:  # type: ignore[operator]
            assert not stale.exists()
            live = c.info().local_socket
            # a live daemon's socket is left alone by another daemon starting
            with running_daemon(tmp_path / "data2"):  # type: ignore[operator]
                assert os.path.exists(live)
                assert c.list_sessions("x") == [] and c._local is not None
    finally:
        stale.unlink(missing_ok=True)


def test_concurrent_clients_are_served_in_parallel_each_its_own_answer(daemon: Daemon, ns: str) -> None:
    """Each connection has its own daemon thread: while one client's call is parked inside the
    daemon (a save waiting on its fsync), the others are served, and nobody gets another's answer."""
    sessions = [make_session(namespace=ns, session_id=f"c{i}", tokens=300 + 17 * i, seed=i) for i in range(6)]
    errors: list[BaseException] = []
    start = threading.Barrier(len(sessions))

    def one(s: SyntheticSession) -> None:
        try:
            with Client(address=daemon.address, arena_bytes=2 << 20) as c:
                start.wait(30)
                for _ in range(3):
                    c.save_session(s.manifest, s.blobs)
                    m, chunks = c.load_session(ns, s.manifest.session_id)
                    assert m.chunk_keys == s.manifest.chunk_keys
                    assert [bytes(b) for _, b in chunks] == [bytes(b) for b in s.blobs]
        except BaseException as e:  # re-raised in the test's thread below
            errors.append(e)

    before = local_calls(daemon)
    threads = [threading.Thread(target=one, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert local_calls(daemon) >= before + 6 * 6  # every save and load took the socket


def test_a_daemon_with_idle_local_connections_stops_at_once_and_cleanly(tmp_path: Path) -> None:
    """Connection threads wait in a read between calls: SIGTERM wakes them (the daemon shuts their
    sockets), the daemon exits 0 well within its grace period and removes its socket file."""
    d = start_daemon(tmp_path / "data")
    clients = [Client(address=d.address, arena_bytes=1 << 20) for _ in range(3)]
    try:
        path = clients[0].info().local_socket
        for c in clients:
            c.list_sessions("idle")  # each holds a pooled, idle connection now
        began = time.monotonic()
        assert d.stop() == 0
        assert time.monotonic() - began < 10
        assert not os.path.exists(path)
    finally:
        for c in clients:
            c.close()
