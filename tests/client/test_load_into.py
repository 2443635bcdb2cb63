"""Loads into the caller's memory (Client.load_session_into / load_chunks_into) on a real daemon: over
the local socket the daemon writes the chunks into the caller's buffer itself (process_vm_writev); over
gRPC the client loads and copies in; both give the same bytes, packed the same way."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvstore.client import Client
from kvstore.errors import InvalidArgument, ResourceExhausted
from kvstore.transport import local_channel, shm
from kvstore.v1 import kvstore_pb2 as pb
from tests.helpers.daemon import Daemon, make_session, running_daemon, transport_stats

pytestmark = pytest.mark.skipif(shm.default_shm_dir() is None, reason="no writable /dev/shm on this host")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("into") / "data") as d:
        yield d


@pytest.fixture
def ns() -> str:
    return f"i-{uuid.uuid4().hex[:12]}"


def packed(blobs: list[bytes]) -> bytes:
    return b"".join(blobs)


def test_the_daemon_writes_a_session_into_the_callers_buffer(daemon: Daemon, ns: str) -> None:
    s = make_session(namespace=ns, tokens=1300)
    with Client(address=daemon.address) as c:
        c.save_session(s.manifest, s.blobs)
        out = np.full(sum(map(len, s.blobs)) + 64, 0xAA, np.uint8)
        before = transport_stats(daemon)
        m, placed = c.load_session_into(ns, "s1", out)
        assert transport_stats(daemon).caller_memory_calls == before.caller_memory_calls + 1
    assert m.chunk_keys == tuple(s.keys) and [i for i, _ in placed] == list(range(len(s.blobs)))
    assert [bytes(v) for _, v in placed] == list(s.blobs)
    assert bytes(out[: len(packed(s.blobs))]) == packed(s.blobs) and not (out[-64:] != 0xAA).any()
    assert all(np.shares_memory(np.frombuffer(v, np.uint8), out) for _, v in placed)


def test_a_fresh_clients_first_call_is_written_into_its_buffer(daemon: Daemon, ns: str) -> None:
    """The first call of a client connects it (binds its calls to the local socket): a load into its
    buffer as that first call is written by the daemon too, not sent over gRPC and refused there."""
    s = make_session(namespace=ns, tokens=900)
    with Client(address=daemon.address) as c:
        c.save_session(s.manifest, s.blobs)
    for load in ("session", "chunks"):
        out = np.zeros(sum(map(len, s.blobs)), np.uint8)
        before = transport_stats(daemon).caller_memory_calls
        with Client(address=daemon.address) as fresh:
            if load == "session":
                fresh.load_session_into(ns, "s1", out)
            else:
                fresh.load_chunks_into(ns, s.keys, out)
        assert transport_stats(daemon).caller_memory_calls == before + 1 and bytes(out) == packed(s.blobs)


def test_grpc_loads_and_copies_in_the_same_way(daemon: Daemon, ns: str) -> None:
    s = make_session(namespace=ns, tokens=900)
    with Client(address=daemon.address) as c:
        c.save_session(s.manifest, s.blobs)
    out = np.zeros(sum(map(len, s.blobs)), np.uint8)
    with Client(address=daemon.address, shared_memory=False) as c:
        before = transport_stats(daemon)
        _, placed = c.load_session_into(ns, "s1", out)
        assert transport_stats(daemon).caller_memory_calls == before.caller_memory_calls
    assert bytes(out) == packed(s.blobs) and [bytes(v) for _, v in placed] == list(s.blobs)


def test_chunks_into_a_pinned_torch_tensor_with_misses_left_out(daemon: Daemon, ns: str) -> None:
    s = make_session(namespace=ns, tokens=1300)
    with Client(address=daemon.address) as c:
        c.save_session(s.manifest, s.blobs)
        out = torch.zeros(sum(map(len, s.blobs)), dtype=torch.uint8)
        keys = [s.keys[2], bytes(16), s.keys[0]]
        placed = c.load_chunks_into(ns, keys, out)
    assert [i for i, _ in placed] == [0, 2]
    assert bytes(out[: len(s.blobs[2]) + len(s.blobs[0])].numpy()) == s.blobs[2] + s.blobs[0]


def test_a_buffer_too_small_is_refused_and_the_client_serves_on(daemon: Daemon, ns: str) -> None:
    s = make_session(namespace=ns, tokens=1300)
    with Client(address=daemon.address) as c:
        c.save_session(s.manifest, s.blobs)
        with pytest.raises(ResourceExhausted, match="destination holds"):
            c.load_session_into(ns, "s1", np.zeros(len(s.blobs[0]) + 10, np.uint8))
        with pytest.raises(InvalidArgument, match="writable"):
            c.load_session_into(ns, "s1", bytes(10))
        _, placed = c.load_session_into(ns, "s1", np.zeros(sum(map(len, s.blobs)), np.uint8))
        assert [bytes(v) for _, v in placed] == list(s.blobs)


def test_caller_memory_is_refused_over_grpc_and_unmapped_memory_is_invalid(daemon: Daemon, ns: str) -> None:
    s = make_session(namespace=ns, tokens=600)
    with Client(address=daemon.address) as c:
        c.save_session(s.manifest, s.blobs)
        info = c.info()
    import grpc

    from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
    far = pb.CallerMemory(address=4096, size=1 << 20)  # page 1 is never mapped
    with grpc.insecure_channel(daemon.address) as ch:  # gRPC names no process: refused
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.KVStoreStub(ch).LoadSession(pb.LoadSessionRequest(namespace=ns, session_id="s1", into=far)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "local socket" in e.value.details()
    local = local_channel.LocalChannel(info.local_socket)
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.KVStoreStub(local).LoadSession(pb.LoadSessionRequest(namespace=ns, session_id="s1", into=far)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not writable memory" in e.value.details()
    finally:
        local.close()
    with Client(address=daemon.address) as c:  # nothing stored was harmed
        _, chunks = c.load_session(ns, "s1")
        assert [bytes(b) for _, b in chunks] == list(s.blobs)
