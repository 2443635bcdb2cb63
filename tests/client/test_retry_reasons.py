"""Typed retry reasons (issue 28, point 6): a refusal the client can cure carries a ``RetryReason``
beside its status on both front ends (gRPC trailing metadata, the local socket's status frame), and
the client decides its retries on that alone. A daemon (the real servicer, in process, on a real
store, served by both real front ends) that answers a load with the old message but no reason is
not retried: the client raises what it was told."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvstore.client import Client
from kvstore.client import calls as rq
from kvstore.errors import FailedPrecondition, InvalidArgument, KvstoreError, ResourceExhausted, Retry
from kvstore.server.auth import Auth
from kvstore.server.grpc_adapter import add_service
from kvstore.server.handlers import Call, methods
from kvstore.server.local import LocalServer, socket_path
from kvstore.server.service import KVStoreService
from kvstore.store import open_store
from kvstore.transport import local_channel, retry
from kvstore.transport.carrier import ARENA_TOO_SMALL, UNKNOWN_ARENA
from kvstore.transport.sender import CALLER_MEMORY_REFUSED
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers.daemon import make_session, save_session
from tests.helpers.store import store_config

GUARD_S = 20.0
NS = "retry"


def test_the_reasons_are_the_protos() -> None:
    assert {r.name: r.value for r in Retry} == dict(pb.RetryReason.items())


class Refusing(KVStoreService):
    """The real servicer, whose next loads are refused as a test says (then served as usual)."""

    def __init__(self, sessions: Any, shm_dir: Path) -> None:
        super().__init__(sessions, Auth({}), shm_dir)
        self.refusals: list[KvstoreError] = []
        self.loads = 0

    def _refuse(self) -> None:
        self.loads += 1
        if self.refusals:
            raise self.refusals.pop(0)

    def LoadSession(self, request: pb.LoadSessionRequest, call: Call) -> Iterator[Any]:
        self._refuse()
        return super().LoadSession(request, call)

    def LoadChunks(self, request: pb.LoadChunksRequest, call: Call) -> Iterator[Any]:
        self._refuse()
        return super().LoadChunks(request, call)


class Daemon:
    """``Refusing`` behind both front ends in this process: gRPC on an event loop of its own thread, and
    the local socket a same-host client takes (its arena, its memory)."""

    def __init__(self, root: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvs-retry-", dir="/tmp"))  # a socket path must be short
        self.sessions = open_store(store_config(root, chunk_tokens=256))
        self.service = Refusing(self.sessions, self.dir)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="event-loop", daemon=True)
        self.thread.start()
        self.server, self.local = self.run(self._start())

    async def _start(self) -> tuple[grpc.aio.Server, LocalServer]:
        server = grpc.aio.server()
        add_service(self.service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        await server.start()
        local = LocalServer(methods(self.service), socket_path(self.dir, port))
        self.service.local_socket = str(local.path)
        await local.start()
        return server, local

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(GUARD_S)

    def close(self) -> None:
        self.run(self.server.stop(1))
        self.run(self.local.stop(1))
        self.run(self.loop.shutdown_default_executor())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(GUARD_S)
        self.sessions.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path)
    yield d
    d.close()


def _session(c: Client) -> Any:
    s = make_session(namespace=NS, tokens=1300)
    save_session(c, s)
    return s


REASONS = [
    InvalidArgument(f"{UNKNOWN_ARENA}: attach it (again) with AttachArena", reason=Retry.UNKNOWN_ARENA),
    ResourceExhausted(f"{ARENA_TOO_SMALL}: it needs 12345 bytes; the arena holds 100", reason=Retry.ARENA_TOO_SMALL,
                      needed_bytes=12345),
    FailedPrecondition(f"{CALLER_MEMORY_REFUSED}: no; load through the arena or the stream instead",
                       reason=Retry.CALLER_MEMORY_REFUSED),
    ResourceExhausted("the destination holds 10 bytes; this load needs 20 (chunk 0 does not fit)",
                      reason=Retry.CALLER_MEMORY_TOO_SMALL, needed_bytes=20),
]


@pytest.mark.parametrize("refusal", REASONS, ids=[r.reason.name for r in REASONS])
def test_both_front_ends_carry_the_reason_beside_the_status(daemon: Daemon, refusal: KvstoreError) -> None:
    """The same refusal reaches a client the same way over gRPC and over the local socket: its code, its
    message word for word, and its typed reason with the bytes it needs; the same words without a
    reason arrive without one."""
    plain = type(refusal)(str(refusal))
    stubs = {"grpc": pb_grpc.KVStoreStub(grpc.insecure_channel(daemon.address)),
             "local": pb_grpc.KVStoreStub(local_channel.LocalChannel(str(daemon.local.path)))}
    for front, stub in stubs.items():
        for sent in (refusal, plain):
            daemon.service.refusals = [sent]
            with pytest.raises(grpc.RpcError) as e:
                list(stub.LoadChunks(pb.LoadChunksRequest(namespace=NS, keys=[bytes(16)]), timeout=GUARD_S))
            err = rq.domain_error(e.value)
            assert type(err) is type(sent) and str(err) == str(sent), front
            assert (err.reason, err.needed_bytes) == (sent.reason, sent.needed_bytes), front


def test_an_unknown_reason_is_no_reason() -> None:
    """A reason this client does not know (a newer daemon's) is not retried; nor is a broken trailer."""
    newer = pb.RetryInfo(needed_bytes=5).SerializeToString() + b"\x08\x63"  # reason 99
    assert retry.decode([(retry.RETRY_KEY, newer)]) == (Retry.RETRY_REASON_UNSPECIFIED, 0)
    assert retry.decode([(retry.RETRY_KEY, b"\xff\xff")]) == (Retry.RETRY_REASON_UNSPECIFIED, 0)
    assert retry.decode([("other-bin", pb.RetryInfo(reason=1).SerializeToString())])[0] == 0


def test_caller_memory_refused_by_reason_goes_through_the_arena(daemon: Daemon) -> None:
    with Client(address=daemon.address) as c:
        s = _session(c)
        assert c.uses_shared_memory
        daemon.service.refusals = [FailedPrecondition(f"{CALLER_MEMORY_REFUSED}: the kernel says no; load through "
                                                      f"the arena or the stream instead",
                                                      reason=Retry.CALLER_MEMORY_REFUSED)]
        out = np.zeros(sum(map(len, s.blobs)), np.uint8)
        _, placed = c.load_session_into(NS, s.session_id, out)
        assert [bytes(v) for _, v in placed] == list(s.blobs) and out.tobytes() == b"".join(s.blobs)
        assert c._into_refused.startswith(CALLER_MEMORY_REFUSED)  # remembered: the arena from now on


def test_the_old_words_without_the_reason_are_not_retried(daemon: Daemon) -> None:
    """A plain FAILED_PRECONDITION whose message begins "cannot write into the caller's memory" is an
    answer, not a reason to go through the arena; the same for the arena's old words."""
    with Client(address=daemon.address) as c:
        s = _session(c)
        out = np.zeros(sum(map(len, s.blobs)), np.uint8)
        daemon.service.refusals = [FailedPrecondition(f"{CALLER_MEMORY_REFUSED}: the kernel says no")]
        loads = daemon.service.loads
        with pytest.raises(FailedPrecondition, match=CALLER_MEMORY_REFUSED):
            c.load_session_into(NS, s.session_id, out)
        assert daemon.service.loads == loads + 1 and not c._into_refused and not out.any()
        daemon.service.refusals = [InvalidArgument(f"{UNKNOWN_ARENA}: attach it (again) with AttachArena")]
        arena = c.carrier
        with pytest.raises(InvalidArgument, match=UNKNOWN_ARENA):
            list(c.load_chunks(NS, s.keys))
        assert c.carrier is arena  # not re-attached
        daemon.service.refusals = [ResourceExhausted(f"{ARENA_TOO_SMALL}: it needs {1 << 30} bytes; the arena "
                                                     f"holds 100")]
        with pytest.raises(ResourceExhausted, match=ARENA_TOO_SMALL):
            list(c.load_chunks(NS, s.keys))
        assert c.carrier is arena  # not grown
        assert [bytes(b) for _, b in c.load_chunks(NS, s.keys)] == list(s.blobs)  # the next call is served


def test_the_arena_reasons_are_retried(daemon: Daemon) -> None:
    """UNKNOWN_ARENA: a fresh arena attached and the load asked again; ARENA_TOO_SMALL: the arena grown
    to the bytes the reason names, and asked again."""
    with Client(address=daemon.address, arena_bytes=1 << 20) as c:
        s = _session(c)
        first = c.carrier
        daemon.service.refusals = [InvalidArgument(f"{UNKNOWN_ARENA}: attach it (again) with AttachArena",
                                                   reason=Retry.UNKNOWN_ARENA)]
        assert [bytes(b) for _, b in c.load_chunks(NS, s.keys)] == list(s.blobs)
        assert c.carrier is not first and c.carrier.arena_id != first.arena_id
        daemon.service.refusals = [ResourceExhausted(f"{ARENA_TOO_SMALL}: it needs {3 << 20} bytes; the arena "
                                                     f"holds {1 << 20}", reason=Retry.ARENA_TOO_SMALL,
                                                     needed_bytes=3 << 20)]
        assert [bytes(b) for _, b in c.load_chunks(NS, s.keys)] == list(s.blobs)
        assert c.carrier.arena.size >= 3 << 20  # type: ignore[attr-defined]
