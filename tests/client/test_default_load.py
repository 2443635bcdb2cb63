"""The default load is the fast one (issue 28): on the daemon's host ``Client.load_session()`` is answered
by the daemon writing the whole session into one buffer of the client's (kvstore/client/load_into.py),
whose read-only views it hands out; an answer the caller keeps is never written again; a buffer too
small is replaced by one that fits; elsewhere (gRPC) the stream, as before. On a real daemon."""

from __future__ import annotations

import asyncio
import gc
import uuid
from collections.abc import Iterator

import pytest

from kvstore.client import Client
from kvstore.client.aio import AsyncClient
from kvstore.client.load_into import LoadBuffers
from kvstore.transport import cma, shm
from tests.helpers.daemon import Daemon, make_session, running_daemon, save_session, transport_stats

pytestmark = pytest.mark.skipif(shm.default_shm_dir() is None, reason="no writable /dev/shm on this host")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("default-load") / "data") as d:
        yield d


@pytest.fixture
def ns() -> str:
    return f"d-{uuid.uuid4().hex[:12]}"


def test_the_default_load_is_one_write_into_the_clients_memory(daemon: Daemon, ns: str) -> None:
    s = make_session(namespace=ns, tokens=1300)
    with Client(address=daemon.address) as c:
        save_session(c, s)
        before = transport_stats(daemon)
        m, pairs = c.load_session(ns, "s1")
        got = list(pairs)
        after = transport_stats(daemon)
        assert m.chunk_keys == tuple(s.keys) and [i for i, _ in got] == list(range(len(s.blobs)))
        assert [bytes(b) for _, b in got] == list(s.blobs)
        assert all(isinstance(b, memoryview) and b.readonly for _, b in got)  # the caller's to keep, not to scribble
        assert after.caller_memory_calls == before.caller_memory_calls + 1
        assert after.arena_calls == before.arena_calls and after.stream_calls == before.stream_calls


def test_a_kept_answer_is_never_written_again(daemon: Daemon, ns: str) -> None:
    """The buffer is answered in again only once nothing of its last answer is alive: a kept answer keeps
    its bytes through later loads, and a dropped one's buffer is reused (no fresh pages to fault in)."""
    a, b = make_session(namespace=ns, session_id="a", tokens=1300, seed=1), make_session(
        namespace=ns, session_id="b", tokens=1300, seed=2)
    with Client(address=daemon.address) as c:
        save_session(c, a)
        save_session(c, b)
        kept = list(c.load_session(ns, "a")[1])
        loaded_b = list(c.load_session(ns, "b")[1])
        where = cma.address_of(loaded_b[0][1])
        assert where != cma.address_of(kept[0][1])  # a buffer of its own: the first answer is alive
        assert [bytes(x) for _, x in kept] == list(a.blobs) and [bytes(x) for _, x in loaded_b] == list(b.blobs)
        del loaded_b
        gc.collect()
        again = list(c.load_session(ns, "b")[1])
        assert cma.address_of(again[0][1]) == where  # nothing of its last answer alive: answered in again
        assert [bytes(x) for _, x in again] == list(b.blobs)
        assert [bytes(x) for _, x in kept] == list(a.blobs)  # the kept answer, untouched throughout


def test_a_buffer_too_small_is_replaced_by_one_that_fits(daemon: Daemon, ns: str) -> None:
    """The daemon writes nothing into a buffer the answer does not fit and says what it needs
    (CALLER_MEMORY_TOO_SMALL, typed); the client asks again in one that fits, and keeps that size."""
    s = make_session(namespace=ns, tokens=2600)
    size = sum(map(len, s.blobs))
    with Client(address=daemon.address) as c:
        save_session(c, s)
        c._buffers = LoadBuffers(c.config.max_arena_bytes, reserve_bytes=size // 3)
        before = transport_stats(daemon)
        assert [bytes(b) for _, b in c.load_session(ns, "s1")[1]] == list(s.blobs)
        assert transport_stats(daemon).caller_memory_calls == before.caller_memory_calls + 1  # the one that fit
        assert len(c._buffers.take()) >= size


def test_the_async_face_loads_the_same_way(daemon: Daemon, ns: str) -> None:
    s = make_session(namespace=ns, tokens=1300)

    async def main() -> list[bytes]:
        async with AsyncClient(address=daemon.address) as c:
            await asyncio.to_thread(save_session, c.client, s)
            _, pairs = await c.load_session(ns, "s1")
            return [bytes(b) async for _, b in pairs]

    before = transport_stats(daemon)
    assert asyncio.run(main()) == list(s.blobs)
    assert transport_stats(daemon).caller_memory_calls == before.caller_memory_calls + 1


def test_over_grpc_the_default_load_takes_the_stream(daemon: Daemon, ns: str) -> None:
    s = make_session(namespace=ns, tokens=1300)
    with Client(address=daemon.address, shared_memory=False) as c:
        save_session(c, s)
        before = transport_stats(daemon)
        assert [bytes(b) for _, b in c.load_session(ns, "s1")[1]] == list(s.blobs)
        after = transport_stats(daemon)
        assert after.stream_calls == before.stream_calls + 1
        assert after.caller_memory_calls == before.caller_memory_calls
