"""Tenant isolation on a real daemon with per-namespace tokens: with team-a's token, no RPC and no
carrier (stream, arena, an arena overflowing to the stream), over gRPC or over the local socket that
same-host clients use by default, reads, lists, deletes, overwrites or reveals the existence of team-b's data.

Every probe is made twice: once naming team-b's real thing (a chunk key, a session id, an arena
id, an in-flight transfer file) and once naming a random one of the same shape. The two answers
must be identical in status code and message (the name itself, where an answer echoes it, is
normalized away), and must not carry data. Afterwards team-b's sessions are checksummed against
what was stored before. ``KVSTORE_ISOLATION_REPORT=<file>`` makes the module write its count of
cross-tenant attempts (benchmarks/reliability/bench_fuzz.py uses it); ``KVSTORE_ISOLATION_ROUNDS`` repeats the
probes with fresh decoys (default 1).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from daemon_helpers import CODE, Daemon, SyntheticSession, make_session, running_daemon, save_session

from kvstore.client import Client
from kvstore.errors import KvstoreError
from kvstore.format.keys import ROOT, chain_keys
from kvstore.format.manifest import Retention
from kvstore.transport import local_channel, shm
from kvstore.transport.carrier import UNKNOWN_ARENA, ArenaCarrier, Blob
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

TOKENS = """
[tokens]
"tok-a" = ["team-a"]
"tok-b" = ["team-b"]
"tok-admin" = ["*"]
"""
A, B = "team-a", "team-b"
META_A = (("authorization", "Bearer tok-a"),)
ROUNDS = int(os.environ.get("KVSTORE_ISOLATION_ROUNDS", "1"))


@dataclass
class World:
    daemon: Daemon
    b_sessions: list[SyntheticSession]
    a_session: SyntheticSession
    attempts: dict[str, int] = field(default_factory=dict)  # cross-tenant attempts, by kind, all refused


def _checksums(admin: Client, namespace: str) -> dict[str, str]:
    """sha256 of every session's manifest and chunk bytes in ``namespace``."""
    out = {}
    for summary in admin.list_sessions(namespace):
        m, chunks = admin.load_session(namespace, summary.session_id)
        h = hashlib.sha256(repr((m.chunk_keys, m.tail, m.last_token_ids, m.metadata, m.retention)).encode())
        for i, blob in chunks:
            h.update(i.to_bytes(4, "little") + bytes(blob))
        out[summary.session_id] = h.hexdigest()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("isolation")
    (tmp / "tokens.toml").write_text(TOKENS)
    # s123456: its manifest key, m:team-b/s123456, is 16 bytes long, the length of a chunk key
    b_sessions = [make_session(namespace=B, session_id=sid, tokens=700, seed=i)
                  for i, sid in enumerate(["b1", "s123456"])]
    a_session = make_session(namespace=A, session_id="a1", tokens=700, seed=7)
    with running_daemon(tmp / "data", "--tokens-file", str(tmp / "tokens.toml")) as d:
        with Client(address=d.address, token="tok-b", arena_bytes=4 << 20) as b:
            for s in b_sessions:
                save_session(b, s)
        with Client(address=d.address, token="tok-a", arena_bytes=4 << 20) as a:
            save_session(a, a_session)
        world = World(d, b_sessions, a_session)
        with Client(address=d.address, token="tok-admin") as admin:
            before = _checksums(admin, B), _checksums(admin, A)
        yield world
        with Client(address=d.address, token="tok-admin") as admin:
            assert (_checksums(admin, B), _checksums(admin, A)) == before, "stored data changed"
        report = os.environ.get("KVSTORE_ISOLATION_REPORT")
        if report:
            Path(report).write_text(json.dumps({"attempts": world.attempts, "refused": sum(world.attempts.values()),
                                                "rounds": ROUNDS}, indent=1))


# -- answers, normalized ----------------------------------------------------------------------------
def answer(call: Callable[[], object], *names: bytes | str) -> tuple[str, str]:
    """(status code name, message or result) of a call, with each of ``names`` (and its hex form)
    replaced by a placeholder: an answer may echo what was asked, never what is stored."""
    try:
        result = call()
        code, text = "OK", repr(result)
    except grpc.RpcError as e:
        code, text = e.code().name, e.details() or ""  # type: ignore[attr-defined]
    except KvstoreError as e:  # the client maps each status code to one class
        code, text = CODE[type(e)].name if type(e) in CODE else type(e).__name__, str(e)
    for n in names:
        for form in ((n, n.hex()) if isinstance(n, bytes) else (n,)):
            text = text.replace(str(form), "<name>")
    return code, text


def loaded(items: Iterator[tuple[int, Blob]]) -> list[tuple[int, bytes]]:
    return [(i, bytes(b)) for i, b in items]


def decoy_session(seed: int) -> SyntheticSession:
    """Same shape as team-b's sessions, never saved by anyone."""
    return make_session(namespace=B, session_id=f"d{uuid.uuid4().hex[:6]}", tokens=700, seed=1000 + seed)


def probe(world: World, kind: str, call: Callable[[object], object], real: object, decoy: object,
          names: Callable[[object], tuple[bytes | str, ...]] = lambda x: ()) -> tuple[str, str]:
    """A's call on B's real thing and on a decoy: identical answers, and none carries B's data."""
    got_real = answer(lambda: call(real), *names(real))
    got_decoy = answer(lambda: call(decoy), *names(decoy))
    assert got_real == got_decoy, (kind, got_real, got_decoy)
    world.attempts[kind] = world.attempts.get(kind, 0) + 1
    return got_real


def _keys_and_ids(s: object) -> tuple[bytes | str, ...]:
    assert isinstance(s, SyntheticSession)
    return (s.session_id, *s.keys)


def _keys_as_a(s: object) -> tuple[bytes | str, ...]:
    """Also the keys the same tokens have in team-a (a refused save says which key it expected)."""
    assert isinstance(s, SyntheticSession)
    return (*_keys_and_ids(s), *chain_keys(s.layout.layout_id, A, s.token_ids, s.chunk_tokens))


# -- every RPC, every transfer path -------------------------------------------------------------------
@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_cannot_read_b_chunks_on_any_path(world: World, round_: int) -> None:
    d = world.daemon
    with Client(address=d.address, token="tok-a", shared_memory=False) as stream, \
            Client(address=d.address, token="tok-a", arena_bytes=64 << 10) as overflow, \
            Client(address=d.address, token="tok-a", arena_bytes=1 << 20) as arena:
        for s in world.b_sessions:
            decoy = decoy_session(round_)
            for ns in (A, B):  # B's keys under A's own namespace (a miss), and under B's (denied)
                for path, c, zero_copy in (("stream", stream, False), ("arena overflow", overflow, True),
                                           ("arena", arena, True)):
                    code, text = probe(world, f"LoadChunks {path}",
                                       lambda x: loaded(c.load_chunks(ns, x.keys, zero_copy=zero_copy)),  # noqa: B023
                                       s, decoy, _keys_and_ids)
                    assert (code, text) in (("OK", "[]"),
                                            ("PERMISSION_DENIED", f"token does not cover namespace {B!r}"))
            # a manifest key that is 16 bytes long, named as a chunk: a miss, and nothing is deleted
            mkey = f"m:{B}/{s.session_id}".encode()
            if len(mkey) == 16:
                code, text = probe(world, "LoadChunks manifest key", lambda k: loaded(stream.load_chunks(A, [k])),
                                   mkey, f"m:{B}/x{uuid.uuid4().hex[:6]}".encode())
                assert (code, text) == ("OK", "[]")


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_cannot_touch_or_see_b_sessions(world: World, round_: int) -> None:
    d = world.daemon
    with Client(address=d.address, token="tok-a", shared_memory=False) as c, \
            Client(address=d.address, token="tok-a", arena_bytes=1 << 20) as arena:
        calls: dict[str, Callable[[str, str], object]] = {
            "LoadSession stream": lambda ns, sid: loaded(c.load_session(ns, sid)[1]),
            "LoadSession arena": lambda ns, sid: loaded(arena.load_session(ns, sid, zero_copy=True)[1]),
        }
        for transport_, x in (("", c), (" local socket", arena)):  # gRPC, and the same host's default
            calls.update({
                f"GetSession{transport_}": lambda ns, sid, x=x: x.get_session(ns, sid),
                f"DeleteSession{transport_}": lambda ns, sid, x=x: x.delete_session(ns, sid),
                f"TouchSession{transport_}": lambda ns, sid, x=x: x.touch_session(ns, sid, Retention(ttl_s=0.001)),
                f"ListSessions{transport_}": lambda ns, sid, x=x: [y.session_id for y in x.list_sessions(ns)],
                f"EvictSession{transport_}": lambda ns, sid, x=x: x.evict(ns, sid, "ssd"),
                f"PrefetchSession{transport_}": lambda ns, sid, x=x: x.prefetch(ns, sid),
            })
        assert over_local_socket(arena) and not over_local_socket(c)
        for s in world.b_sessions:
            decoy = decoy_session(round_)
            for ns in (A, B):
                for kind, call in calls.items():
                    code, _ = probe(world, kind, lambda x: call(ns, x.session_id), s, decoy,  # noqa: B023
                                    _keys_and_ids)
                    assert code != "OK" or kind.startswith("ListSessions")
        assert [x.session_id for x in c.list_sessions("")] == ["a1"]


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_learns_nothing_from_lookups_commits_and_saves(world: World, round_: int) -> None:
    d = world.daemon
    with Client(address=d.address, token="tok-a", shared_memory=False) as c, \
            Client(address=d.address, token="tok-a", arena_bytes=1 << 20) as arena:
        assert over_local_socket(arena)
        for s in world.b_sessions:
            decoy = decoy_session(round_)
            for ns in (A, B):
                for kind, x in (("Lookup", c), ("Lookup local socket", arena)):
                    code, text = probe(world, kind, lambda v: x.lookup(ns, v.layout.layout_id,  # noqa: B023
                                                                       [int(t) for t in v.token_ids]), s, decoy)
                    assert code == "PERMISSION_DENIED" or "cached_tokens=0" in text
            # a team-a manifest naming B's chunks: the same refusal as naming chunks nobody stored
            for kind, names in (("CommitSession", lambda x: x.keys), ("CommitSession one chunk", lambda x: x.keys[:1]),
                                ("CommitSession local socket", lambda x: x.keys),
                                ("SaveChunks turn", lambda x: x.keys)):
                def commit(x: object, names: Callable[[SyntheticSession], list[bytes]] = names,
                           kind: str = kind) -> object:
                    assert isinstance(x, SyntheticSession)
                    m = x.manifest
                    keys = tuple(names(x))
                    own = make_session(namespace=A, tokens=len(keys) * 256 + 10, seed=5).manifest
                    # last ids as a valid manifest has them (the chunks' own, then the tail's): it gets as far
                    # as the ownership check
                    last = (*(int(t) for t in x.token_ids[: len(keys) * 256][-118:]), *own.last_token_ids[-10:])
                    stolen = type(m)(**{**m.__dict__, "namespace": A, "session_id": "stolen", "chunk_keys": keys,
                                        "tail": own.tail, "token_count": len(keys) * 256 + 10,
                                        "last_token_ids": last})
                    if kind == "SaveChunks turn":  # no new chunks, a commit naming B's: in one call
                        return arena.save_session(stolen, [])
                    return (arena if "local" in kind else c).commit(stolen)
                code, _ = probe(world, kind, commit, s, decoy, _keys_and_ids)
                assert code != "OK"
            # B's chunk bytes saved under A (stream and arena): refused, since keys are namespace-salted
            for path, client in (("stream", c), ("arena", arena)):
                code, _ = probe(world, f"SaveChunks {path}",
                                lambda x: client.save_chunks(A, x.layout.layout_id, ROOT, 0, x.blobs),  # noqa: B023
                                s, decoy, _keys_as_a)
                assert code != "OK"
        with pytest.raises(KvstoreError):
            c.get_session(A, "stolen")


# -- shared memory: arena ids, arena files, transfer files ---------------------------------------------
def _stub(d: Daemon) -> Iterator[pb_grpc.KVStoreStub]:
    """A stub over gRPC, then one over the local socket (what same-host clients use by default)."""
    with grpc.insecure_channel(d.address) as channel:
        yield pb_grpc.KVStoreStub(channel)
        info = pb_grpc.KVStoreStub(channel).GetServerInfo(pb.GetServerInfoRequest(), metadata=META_A, timeout=30)
    if info.local_socket:
        local = local_channel.LocalChannel(info.local_socket)
        yield pb_grpc.KVStoreStub(local)
        local.close()


def over_local_socket(c: Client) -> bool:
    """Whether a client makes its calls over the daemon's local socket."""
    c.connect()
    return c._local is not None


def test_a_cannot_use_b_arena_id(world: World) -> None:
    """B's arena id in A's calls is an unknown arena: nothing read from it, nothing written into it."""
    d, a_s = world.daemon, world.a_session
    with Client(address=d.address, token="tok-b", arena_bytes=1 << 20) as b:
        s = world.b_sessions[0]
        assert dict(loaded(b.load_chunks(B, s.keys, zero_copy=True))) == dict(enumerate(s.blobs))
        if not isinstance(b.carrier, ArenaCarrier):
            pytest.skip("no same-host arena here")
        b_id, before = b.carrier.arena_id, bytes(b.carrier.arena.view)
        for stub in _stub(d):
            calls: dict[str, Callable[[object], object]] = {
                "LoadChunks arena id": lambda x: list(stub.LoadChunks(pb.LoadChunksRequest(  # noqa: B023
                    namespace=A, keys=a_s.keys, arena_id=x), metadata=META_A, timeout=30)),
                "LoadSession arena id": lambda x: list(stub.LoadSession(pb.LoadSessionRequest(  # noqa: B023
                    namespace=A, session_id="a1", arena_id=x), metadata=META_A, timeout=30)),
                "SaveChunks arena id": lambda x: stub.SaveChunks(iter([pb.SaveChunksRequest(  # noqa: B023
                    header=pb.SaveHeader(namespace=A, layout_id=a_s.layout.layout_id, arena_id=x,
                                         arena_bytes=len(s.blobs[0])))]), metadata=META_A, timeout=30),
            }
            code, _ = probe(world, "DetachArena arena id", lambda x: stub.DetachArena(  # noqa: B023
                pb.DetachArenaRequest(arena_id=x), metadata=META_A, timeout=30), b_id, uuid.uuid4().hex, lambda x: (x,))
            assert code == "OK"  # ignored, like any id that is not the caller's
            for kind, call in calls.items():
                code, text = probe(world, kind, call, b_id, uuid.uuid4().hex, lambda x: (x,))
                assert code == "INVALID_ARGUMENT" and text.startswith(UNKNOWN_ARENA), text
        assert bytes(b.carrier.arena.view) == before  # A's load wrote nothing into B's arena
        assert dict(loaded(b.load_chunks(B, s.keys, zero_copy=True))) == dict(enumerate(s.blobs))
        assert b.carrier.arena_id == b_id  # B's arena is still mapped: B did not have to attach again


def test_a_cannot_attach_b_arena_file(world: World) -> None:
    """B's arena file, named by A before B attached it: refused without B's nonce, left in place, and
    B attaches it afterwards."""
    directory = shm.default_shm_dir()
    if directory is None:
        pytest.skip("no writable /dev/shm on this host")
    d = world.daemon
    b_arena = shm.Arena.create(directory, 1 << 20)
    try:
        for stub in _stub(d):
            for guess in (bytes(16), os.urandom(16)):
                code, text = answer(lambda: stub.AttachArena(pb.AttachArenaRequest(  # noqa: B023
                    path=b_arena.path, size=b_arena.size, nonce=guess), metadata=META_A, timeout=30))  # noqa: B023
                assert code == "INVALID_ARGUMENT" and "does not hold the nonce" in text
                world.attempts["AttachArena B's file"] = world.attempts.get("AttachArena B's file", 0) + 1
            assert Path(b_arena.path).exists()
            r = stub.AttachArena(pb.AttachArenaRequest(path=b_arena.path, size=b_arena.size, nonce=b_arena.nonce),
                                 metadata=(("authorization", "Bearer tok-b"),), timeout=30)
            assert r.arena_id
    finally:
        if os.path.exists(b_arena.path):
            os.unlink(b_arena.path)
        b_arena.close()


def test_one_owner_attaching_many_arenas_never_unmaps_another_owners(tmp_path: Path) -> None:
    """The per-identity cap evicts only the attaching identity's least recently used arenas."""
    from kvstore.server.arenas import Arenas

    arenas = Arenas(per_owner=3)
    b_id = arenas.add("b", shm.Arena.create(tmp_path, 4096))
    a_ids = [arenas.add("a", shm.Arena.create(tmp_path, 4096)) for _ in range(5)]
    assert arenas.get("b", b_id).size == 4096
    for gone in a_ids[:2]:
        with pytest.raises(KvstoreError, match=UNKNOWN_ARENA):
            arenas.get("a", gone)
    assert all(arenas.get("a", i) for i in a_ids[2:])
    with pytest.raises(KvstoreError, match=UNKNOWN_ARENA):
        arenas.get("a", b_id)  # another's id: exactly an unknown one
    arenas.close_all()
