"""The daemon for real: a `kvstore serve` child process on port 0, driven by the real clients."""

from __future__ import annotations

import asyncio
import atexit
import os
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import grpc
import pytest
import xxhash
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvstore.client import Client, ClientConfig
from kvstore.client.aio import AsyncClient
from kvstore.errors import KvstoreError, NotFound
from kvstore.format import chunk
from kvstore.format.keys import ROOT
from kvstore.format.layout import get_layout
from kvstore.format.manifest import Retention
from kvstore.transport import shm
from kvstore.transport.framing import Blob
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers.daemon import (
    REPO,
    Daemon,
    SyntheticSession,
    attach_arena,
    clean_env,
    kvstore_command,
    make_session,
    running_daemon,
    save_session,
    start_daemon,
    status_of,
)

TINY16 = get_layout("tiny-16")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("daemon") / "data") as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[Client]:
    """The stream path (no shared memory)."""
    with Client(address=daemon.address, shared_memory=False, timeout_s=30) as c:
        yield c


@pytest.fixture(scope="module")
def stub(daemon: Daemon) -> Iterator[pb_grpc.KVStoreStub]:
    """The raw gRPC stub, for requests the client would refuse to build."""
    with grpc.insecure_channel(daemon.address) as channel:
        yield pb_grpc.KVStoreStub(channel)


@pytest.fixture
def ns() -> str:
    """A fresh namespace, so tests sharing the module's daemon do not see each other's sessions."""
    return f"t-{uuid.uuid4().hex[:12]}"


def blobs_of(items: Iterable[tuple[int, Blob]]) -> dict[int, bytes]:
    return {i: bytes(b) for i, b in items}


def tier_items(c: Client) -> dict[str, tuple[int, int]]:
    return {t.name: (t.items, t.used_bytes) for t in c.stats().tiers}


# -- the happy paths ----------------------------------------------------------------------------------
def test_health_and_server_info(client: Client) -> None:
    assert client.health() == "SERVING"
    info = client.info()
    assert info.chunk_tokens == 256
    assert {"tiny-16", "tiny-8", "deepseek-v4.1-flash"} <= set(info.layouts)
    assert list(info.tiers) == ["host", "ssd"]
    assert info.write_mode == "through"


@pytest.mark.parametrize("path", ["stream", "arena", "arena-overflow"])
def test_save_commit_load_round_trip(daemon: Daemon, ns: str, path: str) -> None:
    """The ways chunks travel: gRPC messages; a shared arena; an arena too small for the batch, so
    what does not fit follows on the stream in the same call."""
    if path != "stream" and shm.default_shm_dir() is None:
        pytest.skip("no writable /dev/shm on this host")
    s = make_session(namespace=ns, session_id="chat-1", tokens=1000, metadata={"model": "tiny"})
    config = ClientConfig(address=daemon.address, shared_memory=path != "stream",
                          arena_bytes={"stream": 0, "arena": 4 << 20, "arena-overflow": 64 << 10}[path])
    with Client(config) as c:
        assert c.uses_shared_memory == (path != "stream")  # this host has a writable /dev/shm
        res = c.save_chunks(ns, TINY16.layout_id, ROOT, 0, s.blobs)
        assert res.keys == s.keys and res.written == 3
        committed = c.commit(s.manifest)
        assert committed.created_at > 0 and committed.updated_at == committed.created_at
        manifest, chunks = c.load_session(ns, "chat-1", zero_copy=path != "stream")
        loaded = blobs_of(chunks)  # copies: zero-copy views are valid only until the next call
        again = blobs_of(c.load_chunks(ns, [bytes(16), *s.keys], zero_copy=path != "stream"))
    assert manifest.chunk_keys == tuple(s.keys)
    assert manifest.tail == s.manifest.tail
    assert manifest.token_count == 1000 and manifest.last_token_ids == s.manifest.last_token_ids
    assert manifest.metadata == {"model": "tiny"}
    assert loaded == dict(enumerate(s.blobs))
    assert again == {i + 1: b for i, b in enumerate(s.blobs)}


def test_load_chunks_skips_misses(client: Client, ns: str) -> None:
    s = make_session(namespace=ns, tokens=768)
    save_session(client, s)
    missing = [bytes([7]) * 16, bytes([9]) * 16]
    keys = [s.keys[0], missing[0], s.keys[2], missing[1], s.keys[1]]
    got = list(client.load_chunks(ns, keys))
    assert [i for i, _ in got] == [0, 2, 4]
    assert blobs_of(got) == {0: s.blobs[0], 2: s.blobs[2], 4: s.blobs[1]}
    assert list(client.load_chunks(ns, missing)) == []


def test_lookup_full_partial_miss(client: Client, ns: str) -> None:
    s = make_session(namespace=ns, tokens=1000)
    save_session(client, s)
    ids = [int(t) for t in s.token_ids]
    full = client.lookup(ns, TINY16.layout_id, ids)
    assert (full.cached_tokens, full.requested_tokens, full.chunks) == (768, 1000, 3)
    assert sum(full.tiers.values()) == 3 and set(full.tiers) <= {"host", "ssd"}
    partial = client.lookup(ns, TINY16.layout_id, ids[:600] + [1, 2, 3] * 100)
    assert (partial.cached_tokens, partial.chunks) == (512, 2)
    miss = client.lookup(ns, TINY16.layout_id, [ids[0] + 1, *ids[1:]])
    assert (miss.cached_tokens, miss.chunks, miss.tiers) == (0, 0, {})
    other_ns = client.lookup(ns + "-x", TINY16.layout_id, ids)  # keys are namespaced
    assert other_ns.cached_tokens == 0


def test_list_get_touch_delete(client: Client, ns: str) -> None:
    a, b = make_session(namespace=ns, session_id="a"), make_session(namespace=ns, session_id="b", seed=1)
    save_session(client, a)
    save_session(client, b)
    assert [(x.session_id, x.token_count, x.chunks, x.layout_name) for x in client.list_sessions(ns)] == [
        ("a", 1000, 3, "tiny-16"), ("b", 1000, 3, "tiny-16")]

    pinned = client.touch_session(ns, "a", Retention(pinned=True))
    assert pinned.retention == Retention(pinned=True)
    m, _ = client.get_session(ns, "a")
    assert m.retention.pinned and m.updated_at >= m.created_at
    kept = client.touch_session(ns, "a", Retention(ttl_s=3600))
    assert kept.retention == Retention(pinned=False, ttl_s=3600)

    assert client.delete_session(ns, "a") == 3
    with pytest.raises(NotFound, match="no session 'a'"):
        client.get_session(ns, "a")
    with pytest.raises(NotFound):
        client.delete_session(ns, "a")
    assert [x.session_id for x in client.list_sessions(ns)] == ["b"]


def test_delete_keeps_chunks_another_session_shares(client: Client, ns: str) -> None:
    a = make_session(namespace=ns, session_id="a", tokens=1000)
    b = make_session(namespace=ns, session_id="b", token_ids=[*a.token_ids[:600], *range(400)])
    save_session(client, a)
    assert client.save_chunks(ns, TINY16.layout_id, ROOT, 0, b.blobs).written == 1  # 2 shared chunks
    client.commit(b.manifest)
    assert client.delete_session(ns, "a") == 1  # only a's third chunk was its own
    _, chunks = client.load_session(ns, "b")
    assert blobs_of(chunks) == dict(enumerate(b.blobs))


def test_incremental_save_writes_only_new_chunks(client: Client, ns: str) -> None:
    first = make_session(namespace=ns, tokens=700)  # 2 chunks + 188-token tail
    save_session(client, first)
    grown = make_session(namespace=ns, token_ids=[*first.token_ids, *range(900)])  # 1600 tokens: 6 chunks
    assert grown.keys[:2] == first.keys
    res = client.save_chunks(ns, TINY16.layout_id, first.keys[-1], 2, grown.blobs[2:])
    assert res.keys == grown.keys[2:] and res.written == 4
    again = client.save_chunks(ns, TINY16.layout_id, ROOT, 0, grown.blobs)  # a resend writes nothing
    assert again.keys == grown.keys and again.written == 0
    client.commit(grown.manifest)
    assert client.get_session(ns, "s1")[0].chunk_keys == tuple(grown.keys)


def test_stats_counters_move(client: Client, ns: str) -> None:
    before = client.stats()
    s = make_session(namespace=ns, tokens=1000)
    save_session(client, s)
    client.lookup(ns, TINY16.layout_id, [int(t) for t in s.token_ids])
    list(client.load_chunks(ns, [*s.keys, bytes(16)]))
    after = client.stats()
    assert after.lookups == before.lookups + 1
    assert after.requested_tokens == before.requested_tokens + 1000
    assert after.hit_tokens == before.hit_tokens + 768
    assert after.loaded_chunks == before.loaded_chunks + 3
    assert after.missed_chunks == before.missed_chunks + 1
    assert after.sessions == before.sessions + 1
    old, new = ({t.name: t for t in r.tiers} for r in (before, after))
    assert new["ssd"].items == old["ssd"].items + 3  # 3 chunks (manifests are in their own keyspace)
    assert new["ssd"].used_bytes > old["ssd"].used_bytes and new["ssd"].persistent
    assert sum(t.hits for t in new.values()) == sum(t.hits for t in old.values()) + 3
    bpt = after.bytes_per_token
    assert bpt.tokens >= 1000 and bpt.formula == pytest.approx(float(TINY16.bytes_per_token))
    assert bpt.measured > 0 and bpt.stored > 0


def test_evict_to_ssd(client: Client, ns: str) -> None:
    s = make_session(namespace=ns, tokens=1000)
    save_session(client, s)
    assert client.get_session(ns, "s1")[1] == {"host": 3}
    assert client.evict(ns, "s1", "ssd") == 3
    assert client.get_session(ns, "s1")[1] == {"ssd": 3}
    _, chunks = client.load_session(ns, "s1")  # served from ssd, promoted back to host
    assert blobs_of(chunks) == dict(enumerate(s.blobs))
    assert client.get_session(ns, "s1")[1] == {"host": 3}


def test_async_client_round_trip(daemon: Daemon, ns: str) -> None:
    s = make_session(namespace=ns, tokens=600)

    async def run() -> None:
        async with AsyncClient(address=daemon.address) as c:
            await c.info()
            assert c.uses_shared_memory
            assert (await c.save_chunks(ns, TINY16.layout_id, ROOT, 0, s.blobs)).written == 2
            await c.commit(s.manifest)
            got = [(i, bytes(b)) async for i, b in c.load_chunks(ns, [bytes(16), *s.keys])]
            assert got == [(1, s.blobs[0]), (2, s.blobs[1])]
            assert (await c.lookup(ns, TINY16.layout_id, [int(t) for t in s.token_ids])).cached_tokens == 512
            m, tiers = await c.get_session(ns, "s1")
            assert m.chunk_keys == tuple(s.keys) and sum(tiers.values()) == 2
            assert [x.session_id for x in await c.list_sessions(ns)] == ["s1"]
            assert (await c.stats()).sessions >= 1
            assert await c.delete_session(ns, "s1") == 2
            with pytest.raises(NotFound):
                await c.get_session(ns, "s1")

    asyncio.run(run())


def test_server_reflection_lists_the_service(daemon: Daemon) -> None:
    with grpc.insecure_channel(daemon.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert {"kvstore.v1.KVStore", "grpc.health.v1.Health"} <= set(db.get_services())
        service = DescriptorPool(db).FindServiceByName("kvstore.v1.KVStore")
        assert {"SaveChunks", "LoadSession", "Stats", "EvictSession"} <= {m.name for m in service.methods}


# -- bad input: the right status, a useful message, nothing stored --------------------------------
def _patched(blob: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(blob)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def _flipped(blob: bytes, offset: int) -> bytes:
    out = bytearray(blob)
    out[offset] ^= 0x40
    return bytes(out)


def _save(c: Client, *blobs: bytes, layout_id: bytes = TINY16.layout_id, parent: bytes = ROOT,
          namespace: str = "val") -> object:
    return c.save_chunks(namespace, layout_id, parent, 0, list(blobs))


def _raw_save(stub: pb_grpc.KVStoreStub, *requests: pb.SaveChunksRequest) -> None:
    stub.SaveChunks(iter(requests), timeout=30)


def _header(**fields: object) -> pb.SaveChunksRequest:
    return pb.SaveChunksRequest(header=pb.SaveHeader(namespace="val", layout_id=TINY16.layout_id, **fields))


def _raw_load(stub: pb_grpc.KVStoreStub, s: SyntheticSession, **fields: object) -> list[pb.ChunkData]:
    return list(stub.LoadChunks(pb.LoadChunksRequest(namespace="val", keys=s.keys, **fields), timeout=30))


def _data(data: bytes) -> pb.SaveChunksRequest:
    return pb.SaveChunksRequest(data=data)


def _raw_commit(stub: pb_grpc.KVStoreStub, s: SyntheticSession, **changes: object) -> None:
    m = s.manifest
    fields = dict(session_id=m.session_id, namespace=m.namespace, layout_id=m.layout_id, token_count=m.token_count,
                  chunk_tokens=m.chunk_tokens, chunk_keys=list(m.chunk_keys), tail=m.tail)
    stub.CommitSession(pb.CommitSessionRequest(session=pb.Session(**{**fields, **changes})), timeout=30)


def _short_section_table() -> bytes:
    """An 80-byte tiny-16 chunk (header + checksum, valid) whose section table would lie past its end."""
    n_sections = 2 * len(TINY16.caches)
    head = struct.pack("<4sHHIIQ16s16sIHHII", chunk.MAGIC, chunk.VERSION, chunk.HEADER_BYTES + 16 * n_sections,
                       chunk.HEADER_BYTES + 8, 0, 0, TINY16.layout_id, bytes(16), chunk.HEADER_BYTES, n_sections,
                       0, 0, 0)
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def _rekeyed(s: SyntheticSession) -> bytes:
    """Chunk 0 of ``s``, re-encoded under a key that is not its own."""
    entries = chunk.decode(s.blobs[0], TINY16).entries
    return chunk.encode(TINY16, key=bytes(range(16)), start=0, token_ids=s.token_ids[:256], entries=entries)


def _shm_dir_entry(make: Callable[[str], object]) -> str:
    """A new kvstore-cli-* name in /dev/shm, made by ``make`` (mkdir, mkfifo); removed at exit."""
    path = f"/dev/shm/kvstore-cli-{uuid.uuid4().hex}"
    make(path)
    atexit.register(lambda: os.rmdir(path) if os.path.isdir(path) else os.unlink(path))
    return path


Case = Callable[[Client, pb_grpc.KVStoreStub, SyntheticSession], object]
INVALID, NOT_FOUND, PRECONDITION = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                    grpc.StatusCode.FAILED_PRECONDITION)
SHM_FILE = f"kvstore-cli-{'0' * 32}"
# name: (the failing call, given the client, the raw stub and session val/s1, stored), status, message
BAD: dict[str, tuple[Case, grpc.StatusCode, str]] = {
    "unknown layout id": (lambda c, _, s: _save(c, s.blobs[0], layout_id=bytes(range(16))),
                          INVALID, "unknown layout id 000102"),
    "unknown layout id in lookup": (lambda c, _, s: c.lookup("val", bytes(16), [1, 2, 3]),
                                    INVALID, "unknown layout id"),
    "tiny-8 chunk under tiny-16 id": (lambda c, _, s: _save(c, *make_session("tiny-8", tokens=256).blobs),
                                      INVALID, "expected tiny-16"),
    "chunk of 128 tokens": (lambda c, _, s: _save(c, *make_session(tokens=128, chunk_tokens=128).blobs),
                            INVALID, "holds tokens [0, 128), expected [0, 256)"),
    "chunk sent at the wrong index": (lambda c, _, s: _save(c, s.blobs[1]),
                                      INVALID, "holds tokens [256, 512), expected [0, 256)"),
    "first chunk with a parent": (lambda c, _, s: _save(c, s.blobs[0], parent=s.keys[0]), INVALID, "all-zero parent"),
    "truncated chunk stream": (lambda c, _, s: _save(c, s.blobs[0], s.blobs[1][:-100]), INVALID, "truncated"),
    "stream cut inside a header": (lambda c, stub, s: _raw_save(stub, _header(), _data(s.blobs[0][:7])),
                                   INVALID, "truncated"),
    "oversized declared chunk": (lambda c, _, s: _save(c, _patched(s.blobs[0], 8, "<I", 64 << 20)),
                                 INVALID, "exceeds"),
    "chunk declaring 4 GiB": (lambda c, _, s: _save(c, _patched(s.blobs[0], 8, "<I", 0xFFFFFFFF)), INVALID, "exceeds"),
    "garbage instead of a chunk": (lambda c, _, s: _save(c, b"x" * 4096), INVALID, "does not start a chunk"),
    "corrupted chunk": (lambda c, _, s: _save(c, s.blobs[0], _flipped(s.blobs[1], 5000)),
                        INVALID, "chunk 1: chunk checksum mismatch: its bytes were damaged after it was encoded"),
    "section table past the chunk's end": (lambda c, _, s: _save(c, _short_section_table()), INVALID, "chunk"),
    "wrong chunk key": (lambda c, _, s: _save(c, _rekeyed(s)), INVALID, "does not match its tokens"),
    "no header": (lambda c, stub, s: _raw_save(stub, _data(s.blobs[0])), INVALID, "must carry the header"),
    "a second header": (lambda c, stub, s: _raw_save(stub, _header(), _header()), INVALID, "only the first"),
    "malformed session id in commit": (lambda c, stub, s: _raw_commit(stub, s, session_id="bad id/../x"),
                                       INVALID, "malformed session id"),
    "malformed session id in get": (lambda c, _, s: c.get_session("val", "-dash"), INVALID, "malformed session id"),
    "namespace with bad chars": (lambda c, _, s: c.list_sessions("team a/../b"), INVALID, "malformed namespace"),
    "namespace with bad chars in save": (lambda c, _, s: _save(c, *s.blobs, namespace="a b"),
                                         INVALID, "malformed namespace"),
    "commit referencing missing chunks": (lambda c, _, s: c.commit(make_session(namespace="val", seed=99).manifest),
                                          PRECONDITION, "3 referenced chunks are not stored"),
    "commit with a bad trailing span": (lambda c, stub, s: _raw_commit(stub, s, tail=_flipped(s.manifest.tail, 100)),
                                        INVALID, "trailing span"),
    "unknown session: get": (lambda c, _, s: c.get_session("val", "nope"), NOT_FOUND, "no session 'nope'"),
    "unknown session: load": (lambda c, _, s: c.load_session("val", "nope"), NOT_FOUND, "no session 'nope'"),
    "unknown session: delete": (lambda c, _, s: c.delete_session("val", "nope"), NOT_FOUND, "no session"),
    "unknown session: touch": (lambda c, _, s: c.touch_session("val", "nope", Retention(pinned=True)),
                               NOT_FOUND, "no session"),
    "unknown session: evict": (lambda c, _, s: c.evict("val", "nope", "ssd"), NOT_FOUND, "no session"),
    "negative ttl": (lambda c, _, s: c.touch_session("val", "s1", Retention(ttl_s=-1)), INVALID,
                     "retention.ttl_s must be a positive"),
    "parent key of 5 bytes": (lambda c, stub, s: _raw_save(stub, _header(parent_key=b"12345", first_index=1),
                                                           _data(s.blobs[1])),
                              INVALID, "header.parent_key (empty for chunk 0) is 5 bytes long"),
    "chunk key of 5 bytes in a load": (lambda c, _, s: list(c.load_chunks("val", [b"12345"])),
                                       INVALID, "LoadChunksRequest.keys[0] is 5 bytes long"),
    "unknown arena in save": (lambda c, stub, s: _raw_save(stub, _header(arena_id="nope", arena_bytes=10)),
                              INVALID, "unknown arena: attach it"),
    "unknown arena in load": (lambda c, stub, s: _raw_load(stub, s, arena_id="nope"), INVALID, "unknown arena"),
    "arena outside /dev/shm": (lambda c, stub, s: stub.AttachArena(pb.AttachArenaRequest(
        path=f"/tmp/{SHM_FILE}", size=4096), timeout=30), INVALID, "is not a kvstore client file"),
    "arena named like a daemon file": (lambda c, stub, s: stub.AttachArena(pb.AttachArenaRequest(
        path=f"/dev/shm/{SHM_FILE.replace('cli', 'srv')}", size=4096), timeout=30),
        INVALID, "is not a kvstore client file"),
    "arena of another size": (lambda c, stub, s: attach_arena(stub, claimed=128 << 10), INVALID, "not 131072"),
    "arena without its nonce": (lambda c, stub, s: attach_arena(stub, nonce=bytes(16)),
                                INVALID, "does not hold the nonce"),
    "arena nonce of 5 bytes": (lambda c, stub, s: attach_arena(stub, nonce=b"12345"), INVALID, "nonce must be 16"),
    "arena that is a directory": (lambda c, stub, s: stub.AttachArena(pb.AttachArenaRequest(
        path=_shm_dir_entry(os.mkdir), size=4096, nonce=bytes(16)), timeout=30), INVALID, "Is a directory"),
    "arena that is a FIFO": (lambda c, stub, s: stub.AttachArena(pb.AttachArenaRequest(
        path=_shm_dir_entry(os.mkfifo), size=4096, nonce=bytes(16)), timeout=30), INVALID, "not a regular file"),
    "save beyond the arena": (lambda c, stub, s: _raw_save(stub, _header(arena_id=attach_arena(stub),
                                                                         arena_bytes=1 << 20)),
                              INVALID, "exceeds the arena's 65536"),
    "bad tier name in evict": (lambda c, _, s: c.evict("val", "s1", "nvme"),
                               INVALID, "unknown tier 'nvme'; this store has host, ssd"),
}


@pytest.fixture(scope="module")
def stored(client: Client) -> SyntheticSession:
    s = make_session(namespace="val", session_id="s1")
    save_session(client, s)
    return s


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_refused_and_changes_nothing(name: str, client: Client, stub: pb_grpc.KVStoreStub,
                                                  stored: SyntheticSession) -> None:
    call, code, message = BAD[name]
    sessions_before, tiers_before = client.list_sessions(""), tier_items(client)
    got_code, got_message = status_of(lambda: call(client, stub, stored))
    assert got_code == code, got_message
    assert message in got_message
    assert client.list_sessions("") == sessions_before
    assert tier_items(client) == tiers_before


# -- lifecycle: SIGTERM and restart ------------------------------------------------------------------
def _save_and_sigterm_midway(d: Daemon, s: SyntheticSession) -> object:
    """Stream ``s``'s chunks, SIGTERM the daemon after the first 20, go on streaming once it is
    shutting down, then commit. Returns the commit's result or the error the client got."""

    def blobs() -> Iterator[bytes]:
        for i, b in enumerate(s.blobs):
            if i == 20:
                d.proc.terminate()
                deadline = time.monotonic() + 10
                while "shutting down" not in d.log() and time.monotonic() < deadline:
                    time.sleep(0.01)
            yield b

    outcome: list[object] = []

    def save() -> None:
        with Client(address=d.address, shared_memory=False, retries=1, backoff_s=0.05) as c:
            try:
                c.save_chunks(s.namespace, s.layout.layout_id, ROOT, 0, blobs())
                outcome.append(c.commit(s.manifest))
            except KvstoreError as e:
                outcome.append(e)

    t = threading.Thread(target=save)
    t.start()
    t.join(60)
    assert not t.is_alive() and len(outcome) == 1
    return outcome[0]


@pytest.mark.parametrize("grace_s", ["10", "0"], ids=["save-finishes-in-grace", "save-cancelled"])
def test_sigterm_mid_save_then_restart(tmp_path: Path, grace_s: str) -> None:
    """SIGTERM while a large save streams in: the daemon exits 0. Restarted on the same data dir, it
    has every committed session (retention, metadata, chunks); the interrupted one whole or absent;
    and neither the chunks of the interrupted save nor an expired session's are still stored."""
    a = make_session(namespace="ns", session_id="a", retention=Retention(pinned=True), metadata={"k": "v"})
    b = make_session(namespace="other", session_id="b", tokens=300, seed=1)
    short = make_session(namespace="ns", session_id="short", tokens=600, seed=2)
    big = make_session(namespace="ns", session_id="big", tokens=256 * 300 + 10, seed=3, quantized=False)  # 17 MB
    d = start_daemon(tmp_path / "data", env=clean_env(KVSTORE_GRACE_S=grace_s))
    try:
        with Client(address=d.address, shared_memory=False) as c:
            for s in (a, b, short):
                save_session(c, s)
            c.touch_session("ns", "short", Retention(ttl_s=0.1))
            deadline = time.monotonic() + 10
            while len(c.list_sessions()) > 2 and time.monotonic() < deadline:  # expired: no longer listed
                time.sleep(0.02)
            with pytest.raises(NotFound):
                c.get_session("ns", "short")
        _save_and_sigterm_midway(d, big)
        assert d.proc.wait(30) == 0, d.log()[-3000:]
    finally:
        d.stop()
    assert "store closed" in d.log()

    with running_daemon(tmp_path / "data") as d, Client(address=d.address, shared_memory=False) as c:
        listed = [(x.namespace, x.session_id) for x in c.list_sessions()]
        assert listed in ([("ns", "a"), ("other", "b")], [("ns", "a"), ("ns", "big"), ("other", "b")])
        m, chunks = c.load_session("ns", "a")
        assert m.retention.pinned and m.metadata == {"k": "v"} and m.tail == a.manifest.tail
        assert blobs_of(chunks) == dict(enumerate(a.blobs))
        assert c.lookup("other", TINY16.layout_id, [int(t) for t in b.token_ids]).cached_tokens == 256
        expected_items = 3 + 1  # a's and b's chunks (manifests are in their own keyspace)
        if ("ns", "big") in listed:  # committed before the shutdown: then it must be whole
            m, chunks = c.load_session("ns", "big")
            assert m.chunk_keys == tuple(big.keys)
            assert blobs_of(chunks) == dict(enumerate(big.blobs))
            expected_items += 300
        assert tier_items(c)["ssd"][0] == expected_items  # leftovers were collected at start
    assert d.proc.returncode == 0


# -- requests that are not even messages ---------------------------------------------------------
def _raw_call(channel: grpc.Channel, method: str, payload: bytes) -> None:
    """Send ``payload`` as the request message of ``method``, whatever its shape (no serializer)."""
    m = pb.DESCRIPTOR.services_by_name["KVStore"].methods_by_name[method]
    path = f"/kvstore.v1.KVStore/{method}"
    if m.client_streaming:
        channel.stream_unary(path)(iter([payload]), timeout=30)
    elif m.server_streaming:
        list(channel.unary_stream(path)(payload, timeout=30))
    else:
        channel.unary_unary(path)(payload, timeout=30)


@pytest.mark.parametrize("method", [m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods])
def test_undecodable_request_bytes_are_invalid_argument(method: str, daemon: Daemon, client: Client) -> None:
    """Bytes that do not parse as the request message (a truncated varint, field number 0, a length
    past the end): INVALID_ARGUMENT naming the message type, not gRPC's "Exception deserializing"
    (INTERNAL) that a client would read as a daemon bug."""
    sessions_before = client.list_sessions("")
    with grpc.insecure_channel(daemon.address) as channel:
        for payload in (b"\x08\xff\xff\xff", b"\x00", b"\x0a\x10ab"):
            with pytest.raises(grpc.RpcError) as e:
                _raw_call(channel, method, payload)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert "request is not a valid kvstore.v1." in e.value.details()
    assert client.list_sessions("") == sessions_before


# -- transfer paths that would block a worker thread ---------------------------------------------
def test_a_fifo_at_a_transfer_path_stalls_nothing(daemon: Daemon, client: Client, stub: pb_grpc.KVStoreStub,
                                                  stored: SyntheticSession) -> None:
    """More calls naming a FIFO than the daemon has worker threads: each is refused at once (opening
    a FIFO for reading blocks until a writer comes), and the daemon still serves loads afterwards."""
    fifo = _shm_dir_entry(os.mkfifo)
    for _ in range(12):
        code, message = status_of(lambda: stub.AttachArena(pb.AttachArenaRequest(path=fifo, size=4096,
                                                                                 nonce=bytes(16)), timeout=30))
        assert code == INVALID and "not a regular file" in message
    assert blobs_of(client.load_chunks("val", stored.keys)) == dict(enumerate(stored.blobs))
    assert client.health() == "SERVING"


def test_an_arena_reached_by_a_hard_link_is_refused(stub: pb_grpc.KVStoreStub) -> None:
    """A second name for a file (it could be another user's) is not an arena, under either name."""
    directory = shm.default_shm_dir()
    if directory is None:
        pytest.skip("no writable /dev/shm on this host")
    arena = shm.Arena.create(directory, 64 << 10)
    link = directory / f"kvstore-cli-{uuid.uuid4().hex}"
    os.link(arena.path, link)
    try:
        for path in (arena.path, str(link)):
            code, message = status_of(lambda: stub.AttachArena(pb.AttachArenaRequest(
                path=path, size=arena.size, nonce=arena.nonce), timeout=30))  # noqa: B023
            assert code == INVALID and "hard link is refused" in message
    finally:
        os.unlink(link)
        os.unlink(arena.path)
        arena.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_an_arena_of_another_user_is_refused(stub: pb_grpc.KVStoreStub) -> None:
    directory = shm.default_shm_dir()
    if directory is None:
        pytest.skip("no writable /dev/shm on this host")
    arena = shm.Arena.create(directory, 64 << 10)
    try:
        os.chown(arena.path, 65534, 65534)
        code, message = status_of(lambda: stub.AttachArena(pb.AttachArenaRequest(
            path=arena.path, size=arena.size, nonce=arena.nonce), timeout=30))
        assert code == INVALID and "not owned by" in message
    finally:
        os.unlink(arena.path)
        arena.close()


# -- one daemon per port, one per data dir --------------------------------------------------------
def _serve_again(*flags: str) -> subprocess.CompletedProcess[str]:
    """Run `kvstore serve` in the foreground; it must exit by itself (it cannot start)."""
    return subprocess.run([*kvstore_command(), "serve", *flags], cwd=REPO, env=clean_env(),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)


def _one_line_error(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode != 0 and "serving on" not in r.stdout, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("kvstore: error:")]
    assert len(errors) == 1, r.stderr
    return errors[0]


def test_a_second_daemon_on_a_busy_port_refuses_to_start(daemon: Daemon, tmp_path: Path) -> None:
    r = _serve_again("--port", str(daemon.port), "--data-dir", str(tmp_path / "other"))
    assert f"port {daemon.port} is in use (another kvstore daemon, or another program)" in _one_line_error(r)


def test_a_second_daemon_on_the_same_data_dir_refuses_to_start(daemon: Daemon) -> None:
    r = _serve_again("--port", "0", "--data-dir", str(daemon.data_dir))
    line = _one_line_error(r)
    assert f"data dir {daemon.data_dir} is in use by another kvstore daemon (pid {daemon.proc.pid})" in line
