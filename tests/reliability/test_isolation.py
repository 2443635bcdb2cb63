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
import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import KvstoreError
from kvstore.format import page
from kvstore.format.keys import ROOT, chain_keys
from kvstore.format.manifest import Kind, Manifest, Retention
from kvstore.format.page_layout import PageLayout
from kvstore.transport import local_channel, shm
from kvstore.transport.carrier import UNKNOWN_ARENA, ArenaCarrier, Blob
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers.daemon import CODE, Daemon, SyntheticSession, make_session, running_daemon, save_session
from tests.helpers.pages import opaque_layout

TOKENS = """
[tokens]
"tok-a" = ["team-a"]
"tok-b" = ["team-b"]
"tok-admin" = ["*"]
"""
A, B = "team-a", "team-b"
PAGES = opaque_layout("iso/pages")
PAGES_B = opaque_layout("iso/pages-of-b")


def page_blob(ns: str, seed: int, lay: PageLayout = PAGES) -> tuple[bytes, bytes]:
    """(key, blob) of one engine block of ``ns`` (the key hashes layout, namespace, group, block hash)."""
    g = lay.groups[seed % len(lay.groups)]
    h = seed.to_bytes(32, "little")
    key = page.page_key(lay.layout_id, ns, g.group, h)
    return key, page.encode(lay, g.group, h, key, np.random.default_rng(seed).integers(0, 256, g.block_bytes,
                                                                                          dtype=np.uint8))


def page_manifest(ns: str, sid: str, items: list[tuple[bytes, bytes]], lay: PageLayout = PAGES) -> Manifest:
    return Manifest(sid, ns, lay.layout_id, 16 * len(items), 0, tuple(k for k, _ in items), b"", (),
                    retention=Retention(ttl_s=3600), kind=Kind.ENGINE_PAGES)


B_PAGES = [page_blob(B, s) for s in range(6)]
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
            for lay in (PAGES, PAGES_B):  # PAGES_B: B's alone
                assert b.register_layout(lay.definition()) == lay.layout_id
            b.save_session(page_manifest(B, "bp1", B_PAGES), [blob for _, blob in B_PAGES])
            assert len(list(b.load_chunks(B, [k for k, _ in B_PAGES]))) == len(B_PAGES)  # in the memory tier
        with Client(address=d.address, token="tok-a", arena_bytes=4 << 20) as a:
            save_session(a, a_session)
            assert a.register_layout(PAGES.definition()) == PAGES.layout_id  # A saves page blobs too
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


# -- the newer surfaces (issue 27): LookupKeys, page blobs and page sessions, RegisterLayout, loads into
# -- the caller's own memory -------------------------------------------------------------------------------
def decoy_pages(round_: int) -> list[tuple[bytes, bytes]]:
    """Page blobs of the same shape as B's, never saved by anyone."""
    return [page_blob(B, 1000 + 10 * round_ + s) for s in range(len(B_PAGES))]


def _page_names(items: object) -> tuple[bytes | str, ...]:
    """The keys, and the keys the same blocks have in team-a (a refused save says which it expected)."""
    assert isinstance(items, list)
    names: list[bytes | str] = []
    for key, blob in items:
        h = page.read_header(blob)
        names += [key, page.page_key(PAGES.layout_id, A, h.group, h.block_hash)]
    return tuple(names)


def _keys_of(items: object) -> list[bytes]:
    assert isinstance(items, list)
    return [k for k, _ in items]


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_learns_nothing_from_lookup_keys(world: World, round_: int) -> None:
    d = world.daemon
    s = world.b_sessions[0]
    with Client(address=d.address, token="tok-a", shared_memory=False) as c, \
            Client(address=d.address, token="tok-a", arena_bytes=1 << 20) as local:
        assert over_local_socket(local) and not over_local_socket(c)
        for kind, real, decoy in (("chunk keys", list(s.keys), list(decoy_session(round_).keys)),
                                  ("page keys", _keys_of(B_PAGES), _keys_of(decoy_pages(round_)))):
            for ns in (A, B):
                for transport, x in (("", c), (" local socket", local)):
                    code, text = probe(world, f"LookupKeys {kind}{transport}",
                                       lambda k: x.lookup_keys(ns, k), real, decoy)  # noqa: B023
                    assert code == "PERMISSION_DENIED" or text == repr([None] * len(real)), text


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_cannot_read_or_overwrite_b_page_blobs(world: World, round_: int) -> None:
    d = world.daemon
    with Client(address=d.address, token="tok-a", shared_memory=False) as stream, \
            Client(address=d.address, token="tok-a", arena_bytes=1 << 20) as arena:
        decoy = decoy_pages(round_)
        for ns in (A, B):
            for path, c, zero_copy in (("stream", stream, False), ("arena", arena, True)):
                code, text = probe(world, f"LoadChunks page keys {path}",
                                   lambda x: loaded(c.load_chunks(ns, _keys_of(x), zero_copy=zero_copy)),  # noqa: B023
                                   B_PAGES, decoy, _page_names)
                assert (code, text) in (("OK", "[]"), ("PERMISSION_DENIED", f"token does not cover namespace {B!r}"))
            # B's page blobs saved by A: under A they are not A's keys; under B, not A's namespace
            for path, c in (("stream", stream), ("arena", arena)):
                def save(x: object, c: Client = c, ns: str = ns) -> object:
                    assert isinstance(x, list)
                    return c.save_chunks(ns, PAGES.layout_id, ROOT, 0, [b for _, b in x])
                code, _ = probe(world, f"SaveChunks page blobs {path}", save, B_PAGES, decoy, _page_names)
                assert code != "OK"
        # under B's own layout, which A never registered: the answer for a layout nobody registered
        code, _ = probe(world, "SaveChunks under B's layout", lambda lid: stream.save_chunks(
            A, lid, ROOT, 0, [page_blob(A, 7, PAGES_B)[1]]), PAGES_B.layout_id, uuid.uuid4().bytes, lambda x: (x,))
        assert code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_cannot_touch_or_see_b_page_sessions(world: World, round_: int) -> None:
    d = world.daemon
    with Client(address=d.address, token="tok-a", shared_memory=False) as c, \
            Client(address=d.address, token="tok-a", arena_bytes=1 << 20) as local:
        for ns in (A, B):
            for transport, x in (("", c), (" local socket", local)):
                for kind, fn in (("GetSession", lambda sid, x=x: x.get_session(ns, sid)),  # noqa: B023
                                 ("LoadSession", lambda sid, x=x: loaded(x.load_session(ns, sid)[1])),  # noqa: B023
                                 ("TouchSession", lambda sid, x=x: x.touch_session(ns, sid, Retention(ttl_s=1))),  # noqa: B023
                                 ("DeleteSession", lambda sid, x=x: x.delete_session(ns, sid))):  # noqa: B023
                    code, _ = probe(world, f"{kind} page session{transport}", fn, "bp1",
                                    f"d{uuid.uuid4().hex[:6]}", lambda x: (x,))
                    assert code != "OK"
        # a page session of A's naming B's page blobs: the refusal for blobs nobody stored
        for transport, x in (("", c), (" local socket", local)):
            code, _ = probe(world, f"CommitSession naming B's page blobs{transport}", lambda items: x.commit(  # noqa: B023
                page_manifest(A, "stolen-pages", items)), B_PAGES, decoy_pages(round_), _page_names)
            assert code != "OK"


def test_a_learns_nothing_from_registering_b_layouts(world: World) -> None:
    """B's layout definitions registered by A answer as a definition nobody registered: OK, with the
    id the definition itself gives (A computes it anyway); nothing says B holds it."""
    d = world.daemon
    fresh = opaque_layout(f"iso/fresh-{uuid.uuid4().hex[:6]}")
    with Client(address=d.address, token="tok-a", shared_memory=False) as c, \
            Client(address=d.address, token="tok-a", arena_bytes=1 << 20) as local:
        for transport, x in (("", c), (" local socket", local)):
            for ns in ("", A, B):
                code, text = probe(world, f"RegisterLayout B's definition{transport}",
                                   lambda lay: x.register_layout(lay.definition(), ns),  # noqa: B023
                                   PAGES_B, fresh, lambda lay: (lay.layout_id, lay.name))
                assert code == ("PERMISSION_DENIED" if ns == B else "OK"), text


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_loads_into_its_own_memory_nothing_of_b(world: World, round_: int) -> None:
    """``load_chunks_into`` / ``load_session_into`` naming B's chunks, page blobs and sessions: the
    answer for made-up ones, and not a byte of A's buffer written."""
    d = world.daemon
    s = world.b_sessions[0]
    out = np.full(1 << 20, 0xA5, np.uint8)
    with Client(address=d.address, token="tok-a", arena_bytes=1 << 20) as c:
        assert over_local_socket(c)
        for ns in (A, B):
            for kind, real, decoy in (("chunk keys", list(s.keys), list(decoy_session(round_).keys)),
                                      ("page keys", _keys_of(B_PAGES), _keys_of(decoy_pages(round_)))):
                code, text = probe(world, f"load_chunks_into {kind}", lambda k: [
                    i for i, _ in c.load_chunks_into(ns, k, out)], real, decoy)  # noqa: B023
                assert (code, text) in (("OK", "[]"), ("PERMISSION_DENIED", f"token does not cover namespace {B!r}"))
            for sid in (s.session_id, "bp1"):
                code, _ = probe(world, "load_session_into", lambda x: c.load_session_into(ns, x, out),  # noqa: B023
                                sid, f"d{uuid.uuid4().hex[:6]}", lambda x: (x,))
                assert code != "OK"
    assert (out == 0xA5).all(), "a byte of A's buffer was written"
    with Client(address=d.address, token="tok-a", arena_bytes=1 << 20) as c:  # the path works: A's own session
        m, got = c.load_session_into(A, world.a_session.session_id, out)
        assert [bytes(v) for _, v in got] == list(world.a_session.blobs)


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
    from kvstore.server.carriers import Arenas

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
