"""The two front ends of the one handler layer (kvstore/server/handlers.py): the gRPC adapter
(grpc_adapter.py) and the local socket (local.py) serving the same synchronous servicer bodies, in
process, on a real store: the same status for the same refusal on both, where each runs a body,
a gRPC stream cancelled mid-way, a client stream refused at its first message, and concurrent
same-host saves sharing one fsync (group commit)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore.client import calls as messages
from kvstore.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from kvstore.server import service
from kvstore.server.auth import Auth
from kvstore.server.grpc_adapter import MESSAGES_PER_HOP, add_service
from kvstore.server.handlers import Call, methods, quick_when
from kvstore.server.local import LocalServer, socket_path
from kvstore.server.service import KVStoreService
from kvstore.server.status import MAX_DETAILS_BYTES
from kvstore.store import SessionStore
from kvstore.tiers.base import WriteBatch
from kvstore.transport import convert
from kvstore.transport.carrier import StreamCarrier
from kvstore.transport.local_channel import LocalChannel
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers.store import TINY8, build_session, token_stream

GUARD_S = 20.0
SSD = 1  # the default tiers: host memory, then LMDB


class Bodies(KVStoreService):
    """The real servicer, with a few bodies a test steers: what GetSession raises, and a LoadChunks
    that streams ``answers`` numbered messages slowly, watching who advances it."""

    def __init__(self, sessions: SessionStore) -> None:
        super().__init__(sessions, Auth({}), None)
        self.raises: Exception | None = None
        self.threads: list[threading.Thread] = []
        self.answers, self.fail_after = 0, -1
        self.advanced = 0
        self.overlaps = 0  # times two threads advanced the stream at once
        self.closed = threading.Event()
        self.streams: list[Iterator[pb.ChunkData]] = []
        self.gate_at, self.gate = -1, threading.Event()  # making answer gate_at waits for the gate
        self._advancing = threading.Lock()

    def GetSession(self, request: pb.GetSessionRequest, call: Call) -> pb.GetSessionResponse:
        self.threads.append(threading.current_thread())
        if self.raises is not None:
            raise self.raises
        return super().GetSession(request, call)

    @quick_when(lambda self, request, call: request.namespace == "quick")
    def LookupKeys(self, request: pb.LookupKeysRequest, call: Call) -> pb.LookupKeysResponse:
        self.threads.append(threading.current_thread())
        return pb.LookupKeysResponse()

    def LoadChunks(self, request: pb.LoadChunksRequest, call: Call) -> Iterator[pb.ChunkData]:
        answers = self._answers()
        self.streams.append(answers)  # kept: only a close can end it early, never the garbage collector
        return answers

    def _answers(self) -> Iterator[pb.ChunkData]:
        try:
            for i in range(self.answers):
                if not self._advancing.acquire(blocking=False):
                    self.overlaps += 1
                    self._advancing.acquire()
                try:
                    if i == self.gate_at:
                        assert self.gate.wait(GUARD_S)
                    time.sleep(0.005)  # a read
                    self.advanced += 1
                    if i == self.fail_after:
                        raise ResourceExhausted("the disk is full")
                finally:
                    self._advancing.release()
                yield pb.ChunkData(indices=[i])
        finally:
            self.closed.set()


class Fronts:
    """Both front ends of one servicer, in this process: a grpc.aio server on an event loop of its own
    thread, and the local socket."""

    def __init__(self, service: KVStoreService) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvs-fronts-", dir="/tmp"))  # a socket path must be short
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="event-loop", daemon=True)
        self.loop_thread.start()
        self.server, self.local = self.run(self._start(service))
        self.channel = grpc.insecure_channel(self.address)
        self.grpc = pb_grpc.KVStoreStub(self.channel)
        self.local_channel = LocalChannel(str(self.local.path))
        self.same_host = pb_grpc.KVStoreStub(self.local_channel)

    async def _start(self, service: KVStoreService) -> tuple[grpc.aio.Server, LocalServer]:
        server = grpc.aio.server()
        add_service(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        await server.start()
        local = LocalServer(methods(service), socket_path(self.dir, port))
        await local.start()
        return server, local

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(GUARD_S)

    def stubs(self) -> dict[str, pb_grpc.KVStoreStub]:
        return {"grpc": self.grpc, "local": self.same_host}

    def close(self) -> None:
        self.channel.close()
        self.local_channel.close()
        self.run(self.server.stop(1))
        self.run(self.local.stop(1))
        self.run(self.loop.shutdown_default_executor())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(GUARD_S)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def bodies(sessions: SessionStore) -> Bodies:
    return Bodies(sessions)


@pytest.fixture
def fronts(bodies: Bodies) -> Iterator[Fronts]:
    f = Fronts(bodies)
    yield f
    f.close()


def outcome(fn: Any) -> tuple[grpc.StatusCode, str]:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("error, code, details", [
    (NotFound("no session 's' in namespace 'ns'"), grpc.StatusCode.NOT_FOUND, "no session 's' in namespace 'ns'"),
    (PermissionDenied("token does not cover namespace 'ns'"), grpc.StatusCode.PERMISSION_DENIED, "token does not"),
    (InvalidArgument("x" * 100_000), grpc.StatusCode.INVALID_ARGUMENT, "bytes, cut]"),
    (RuntimeError("a daemon bug"), grpc.StatusCode.INTERNAL, "internal error: RuntimeError: a daemon bug"),
])
def test_a_body_that_raises_ends_with_the_same_status_on_both_front_ends(
        fronts: Fronts, bodies: Bodies, error: Exception, code: grpc.StatusCode, details: str) -> None:
    bodies.raises = error
    got = {name: outcome(lambda s=stub: s.GetSession(pb.GetSessionRequest(namespace="ns", session_id="s")))
           for name, stub in fronts.stubs().items()}
    assert got["grpc"] == got["local"]
    assert got["grpc"][0] == code and details in got["grpc"][1]
    assert len(got["grpc"][1].encode()) <= MAX_DETAILS_BYTES


def test_a_stream_that_fails_mid_way_sends_what_it_made_then_the_same_status(fronts: Fronts, bodies: Bodies) -> None:
    bodies.answers, bodies.fail_after = 3 * MESSAGES_PER_HOP, MESSAGES_PER_HOP + 1
    got: dict[str, list[int]] = {}
    for name, stub in fronts.stubs().items():
        into = got[name] = []

        def load(s: pb_grpc.KVStoreStub = stub, into: list[int] = into) -> None:
            for m in s.LoadChunks(pb.LoadChunksRequest(namespace="ns")):
                into.extend(m.indices)
        assert outcome(load) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "the disk is full")
    # every message made before the failure, the one made in the failing hop too (the local channel's
    # client reads an answer whole and raises its status before handing out any of it)
    assert got == {"grpc": list(range(MESSAGES_PER_HOP + 1)), "local": []}
    assert bodies.overlaps == 0


def test_bodies_run_off_the_event_loop_on_grpc_and_on_the_connection_thread_locally(
        fronts: Fronts, bodies: Bodies) -> None:
    for stub in fronts.stubs().values():
        outcome(lambda s=stub: s.GetSession(pb.GetSessionRequest(namespace="ns", session_id="s")))
    on_grpc, on_local = bodies.threads
    assert on_grpc is not fronts.loop_thread and on_grpc is not threading.current_thread()
    assert on_local.name == "kvstore-local"
    # a body that declares a call quick runs on the loop (gRPC) or where it always runs (local)
    bodies.threads.clear()
    for ns in ("quick", "slow"):
        fronts.grpc.LookupKeys(pb.LookupKeysRequest(namespace=ns))
    fronts.same_host.LookupKeys(pb.LookupKeysRequest(namespace="quick"))
    quick, slow, local = bodies.threads
    assert quick is fronts.loop_thread and slow is not fronts.loop_thread and local.name == "kvstore-local"


def test_a_grpc_stream_cancelled_mid_way_is_closed_after_its_hop_and_the_daemon_serves_on(
        fronts: Fronts, bodies: Bodies) -> None:
    """Cancelled while its next hop runs (held at the gate), a stream is closed once that hop is
    done: never by a second thread while the first still advances it (that close would fail, and
    the stream would stay open, pinning what it read)."""
    bodies.answers, bodies.gate_at = 100 * MESSAGES_PER_HOP, MESSAGES_PER_HOP  # the second hop waits
    answers = fronts.grpc.LoadChunks(pb.LoadChunksRequest(namespace="ns"))
    assert [list(next(answers).indices) for _ in range(MESSAGES_PER_HOP)] == [[i] for i in range(MESSAGES_PER_HOP)]
    time.sleep(0.1)  # the first hop's answers sent: the daemon awaits the second hop
    answers.cancel()
    time.sleep(0.2)  # the daemon sees the cancellation while the hop waits
    assert not bodies.closed.is_set()
    bodies.gate.set()
    assert bodies.closed.wait(GUARD_S)  # its finally ran (a load's unpins what it read)
    assert bodies.advanced == 2 * MESSAGES_PER_HOP  # the hop it was in, nothing after
    assert bodies.overlaps == 0
    bodies.answers, bodies.gate_at = 2, -1
    assert [list(m.indices) for m in fronts.grpc.LoadChunks(pb.LoadChunksRequest(namespace="ns"))] == [[0], [1]]


def saved_session(sessions: SessionStore, session_id: str, chunks: int) -> Any:
    s = build_session("ns", session_id, token_stream(len(session_id) + chunks, chunks * 16 + 1))
    sessions.save_session("ns", TINY8.layout_id, s.parent(0), 0, s.blobs, s.manifest())
    return s


@pytest.mark.parametrize("quick", [True, False], ids=["on the loop", "in hops"])
def test_a_cancelled_load_of_a_real_session_unpins_its_chunks(
        monkeypatch: pytest.MonkeyPatch, sessions: SessionStore, quick: bool) -> None:
    """A real LoadSession cancelled after its first message, whether the memory tier made it quick
    (run on the loop) or not (worker-thread hops): its chunks are unpinned, the daemon serves on."""
    if not quick:
        monkeypatch.setattr(service, "QUICK_LOAD_BYTES", 0)
    saved_session(sessions, "big", 64)
    bodies = Bodies(sessions)
    bodies.carriers.message_bytes = 1  # a chunk a message: many of them, many hops
    fronts = Fronts(bodies)
    try:
        cancelled_load(fronts, sessions)
    finally:
        fronts.close()


def cancelled_load(fronts: Fronts, sessions: SessionStore) -> None:
    answers = fronts.grpc.LoadSession(pb.LoadSessionRequest(namespace="ns", session_id="big"))
    first = next(answers)
    assert first.session.session_id == "big"
    answers.cancel()
    guard = time.monotonic() + GUARD_S
    while sessions.store._pins and time.monotonic() < guard:
        time.sleep(0.01)
    assert not sessions.store._pins
    assert fronts.grpc.GetSession(pb.GetSessionRequest(namespace="ns", session_id="big")).session.session_id == "big"


def test_a_save_refused_at_its_first_message_is_not_collected_whole_on_grpc(fronts: Fronts) -> None:
    sent = 0

    def endless() -> Iterator[pb.SaveChunksRequest]:
        nonlocal sent
        yield pb.SaveChunksRequest(header=pb.SaveHeader(namespace="ns", layout_id=bytes(16), parent_key=b"short"))
        while True:
            sent += 1
            yield pb.SaveChunksRequest(data=b"x" * 1000)
            time.sleep(0.001)

    code, details = outcome(lambda: fronts.grpc.SaveChunks(endless(), timeout=GUARD_S))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "parent_key" in details  # not DEADLINE_EXCEEDED
    # the local socket reads a call whole before it answers, and answers the same
    local = outcome(lambda: fronts.same_host.SaveChunks(iter([
        pb.SaveChunksRequest(header=pb.SaveHeader(namespace="ns", layout_id=bytes(16), parent_key=b"short")),
        pb.SaveChunksRequest(data=b"x" * 1000)])))
    assert local == (code, details)


def test_concurrent_same_host_saves_share_one_fsync(fronts: Fronts, sessions: SessionStore) -> None:
    """While one save over the local socket waits in its commit, three more from other connections
    queue behind it and go in one transaction together: connection threads never serialize store calls."""
    ssd = sessions.store.tiers[SSD]
    inside, release = threading.Event(), threading.Event()
    real_write = ssd.write

    def first_write_parks(batch: WriteBatch) -> int:
        if not inside.is_set():
            inside.set()
            release.wait(GUARD_S)
        return real_write(batch)

    ssd.write = first_write_parks  # type: ignore[method-assign]
    made = [build_session("ns", f"s{n}", token_stream(70 + n, 2 * 16 + 1)) for n in range(4)]
    answers: dict[str, Any] = {}

    def save(s: Any) -> None:
        channel = LocalChannel(str(fronts.local.path))
        header = pb.SaveHeader(namespace="ns", layout_id=TINY8.layout_id, parent_key=s.parent(0), first_index=0,
                               commit=convert.session_to_pb(s.manifest()))
        requests = messages.save_requests(header, StreamCarrier(64 << 10).send(enumerate(s.blobs)))
        try:
            answers[s.session_id] = pb_grpc.KVStoreStub(channel).SaveChunks(requests, timeout=GUARD_S)
        except grpc.RpcError as e:
            answers[s.session_id] = e
        finally:
            channel.close()

    txns = lambda: ssd.stats(pages=True).pages.last_txnid  # type: ignore[union-attr]  # noqa: E731  (each write transaction: one fsync)
    threads = [threading.Thread(target=save, args=(made[0],))]
    threads[0].start()
    assert inside.wait(GUARD_S)
    before = txns()
    threads += [threading.Thread(target=save, args=(s,)) for s in made[1:]]
    for th in threads[1:]:
        th.start()
    guard = time.monotonic() + GUARD_S
    while len(sessions._turns._queue) < 3:  # all three queued behind the parked commit
        assert time.monotonic() < guard, answers
        time.sleep(0.01)
    release.set()
    for th in threads:
        th.join(GUARD_S)
    assert all(isinstance(answers[s.session_id], pb.SaveChunksResponse) for s in made), answers
    assert txns() == before + 2  # the parked one's, then one for the other three
    assert all(sessions.get("ns", s.session_id).chunk_keys == s.keys for s in made)
