"""Carriers on a real daemon: the path is chosen once, when a client connects; a batch larger than
the arena overflows to the stream; a turn (new chunks + manifest) is one SaveChunks call whose failed
commit leaves no new session version; the daemon's stats say which path calls took."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Iterator

import grpc
import pytest

from kvstore.client import Client
from kvstore.client.aio import AsyncClient
from kvstore.errors import InvalidArgument
from kvstore.transport import shm
from kvstore.transport.carrier import ARENA, STREAM
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers.daemon import Daemon, make_session, running_daemon, status_of, transport_stats

pytestmark = pytest.mark.skipif(shm.default_shm_dir() is None, reason="no writable /dev/shm on this host")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("carrier") / "data") as d:
        yield d


@pytest.fixture
def ns() -> str:
    return f"c-{uuid.uuid4().hex[:12]}"


def test_the_path_is_chosen_once_at_connect(daemon: Daemon, ns: str) -> None:
    """A fresh client's first call, a save, already takes the arena (no info() needed first), and
    every later call uses that same carrier."""
    s = make_session(namespace=ns, tokens=700)
    before = transport_stats(daemon)
    with Client(address=daemon.address, arena_bytes=4 << 20) as c:
        c.save_session(s.manifest, s.blobs)
        carrier = c.carrier
        assert carrier.name == ARENA and c.uses_shared_memory
        _, chunks = c.load_session(ns, "s1", zero_copy=True)  # the arena's own load (the default: caller memory)
        assert {i: bytes(b) for i, b in chunks} == dict(enumerate(s.blobs))
        assert c.carrier is carrier
        assert ARENA in c.info().carriers
    after = transport_stats(daemon)
    assert after.arena_calls == before.arena_calls + 2
    assert after.attaches == before.attaches + 1 and after.stream_calls == before.stream_calls
    with Client(address=daemon.address, shared_memory=False) as c:
        c.save_session(s.manifest, s.blobs)
        assert c.carrier.name == STREAM and not c.uses_shared_memory
    assert transport_stats(daemon).stream_calls == after.stream_calls + 1


def test_a_closing_client_detaches_its_arena(daemon: Daemon, ns: str) -> None:
    s = make_session(namespace=ns, tokens=300)
    with Client(address=daemon.address, arena_bytes=1 << 20) as c:
        c.save_session(s.manifest, s.blobs)
        attached = transport_stats(daemon)
    after = transport_stats(daemon)
    assert after.arenas == attached.arenas - 1 and after.detaches == attached.detaches + 1


def test_a_save_larger_than_the_arena_overflows_and_a_load_grows_the_arena(daemon: Daemon, ns: str) -> None:
    small, large = make_session(namespace=ns, session_id="small", tokens=300), \
        make_session(namespace=ns, session_id="large", tokens=1200, seed=1)
    with Client(address=daemon.address, arena_bytes=len(small.blobs[0]) + 100) as c:
        before = transport_stats(daemon)
        c.save_session(small.manifest, small.blobs)  # fits
        c.save_session(large.manifest, large.blobs)  # 4 chunks: 1 in the arena, 3 on the stream
        first_arena = c.carrier.arena.size  # type: ignore[attr-defined]
        for s in (small, large):  # the large load is told the arena is too small, grows it, asks again
            _, chunks = c.load_session(ns, s.session_id, zero_copy=True)
            assert {i: bytes(b) for i, b in chunks} == dict(enumerate(s.blobs))
        assert c.carrier.name == ARENA
        assert c.carrier.arena.size >= sum(map(len, large.blobs)) > first_arena  # type: ignore[attr-defined]
        _, chunks = c.load_session(ns, "large", zero_copy=True)  # now it fits at once
        assert {i: bytes(b) for i, b in chunks} == dict(enumerate(large.blobs))
    after = transport_stats(daemon)
    assert after.arena_calls == before.arena_calls + 5 and after.overflow_calls == before.overflow_calls + 1
    assert after.attaches == before.attaches + 2  # the first arena, and the grown one


def test_a_load_larger_than_the_largest_arena_takes_the_stream(daemon: Daemon, ns: str) -> None:
    large = make_session(namespace=ns, session_id="large", tokens=1200, seed=1)
    cap = len(large.blobs[0]) + 100
    with Client(address=daemon.address, arena_bytes=cap, max_arena_bytes=cap) as c:
        c.save_session(large.manifest, large.blobs)
        before = transport_stats(daemon)
        _, chunks = c.load_session(ns, "large", zero_copy=True)  # the arena's load, not caller memory
        assert {i: bytes(b) for i, b in chunks} == dict(enumerate(large.blobs))
        assert c.carrier.name == ARENA and c.carrier.arena.size == cap  # type: ignore[attr-defined]
    after = transport_stats(daemon)
    assert after.stream_calls == before.stream_calls + 1 and after.attaches == before.attaches


def test_a_turn_is_one_call_and_a_failed_commit_publishes_nothing(daemon: Daemon, ns: str) -> None:
    first = make_session(namespace=ns, session_id="t", tokens=600)
    grown = make_session(namespace=ns, session_id="t", token_ids=[*first.token_ids, *range(600)])
    with Client(address=daemon.address, arena_bytes=4 << 20) as c:
        saved = c.save_session(first.manifest, first.blobs)
        assert saved.keys == first.keys and saved.written == 2
        assert saved.manifest.chunk_keys == tuple(first.keys) and saved.manifest.created_at > 0
        v1, _ = c.get_session(ns, "t")
        bad_tail = bytearray(grown.manifest.tail)
        bad_tail[100] ^= 0x40
        with pytest.raises(InvalidArgument, match="trailing span"):
            c.save_session(dataclasses.replace(grown.manifest, tail=bytes(bad_tail)), grown.blobs[2:])
        assert c.get_session(ns, "t")[0] == v1  # the failed turn left the previous version
        ids = [int(t) for t in grown.token_ids]
        assert c.lookup(ns, grown.layout.layout_id, ids).chunks == 2  # and stored none of its chunks
        turn = c.save_session(grown.manifest, grown.blobs[2:])  # only the new chunks travel
        assert turn.keys == grown.keys[2:] and turn.written == 2
        m, chunks = c.load_session(ns, "t")
        assert m.chunk_keys == tuple(grown.keys) and {i: bytes(b) for i, b in chunks} == dict(enumerate(grown.blobs))


def test_a_turn_commit_must_name_the_saved_namespace(daemon: Daemon, ns: str) -> None:
    s = make_session(namespace=ns, tokens=600)
    with Client(address=daemon.address) as c:
        header = pb.SaveHeader(namespace=ns, layout_id=s.layout.layout_id, parent_key=bytes(16))
        header.commit.namespace = ns + "-other"
        with grpc.insecure_channel(daemon.address) as channel:  # raw: the client never builds this
            code, message = status_of(lambda: pb_grpc.KVStoreStub(channel).SaveChunks(
                iter([pb.SaveChunksRequest(header=header)]), timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "must name the header's namespace" in message
        assert c.list_sessions(ns) == []


def test_the_async_client_uses_the_same_carrier(daemon: Daemon, ns: str) -> None:
    s = make_session(namespace=ns, tokens=700)

    async def go() -> None:
        async with AsyncClient(address=daemon.address, arena_bytes=4 << 20) as c:
            saved = await c.save_session(s.manifest, s.blobs)
            assert saved.written == 2 and c.uses_shared_memory
            _, chunks = await c.load_session(ns, "s1")
            assert {i: bytes(b) async for i, b in chunks} == dict(enumerate(s.blobs))
            got = await asyncio.gather(*(_load(c, ns, s.keys) for _ in range(4)))  # concurrent tasks, one arena
            assert all(g == dict(enumerate(s.blobs)) for g in got)

    asyncio.run(go())


async def _load(c: AsyncClient, ns: str, keys: list[bytes]) -> dict[int, bytes]:
    return {i: bytes(b) async for i, b in c.load_chunks(ns, keys)}
