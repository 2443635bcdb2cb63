"""Fuzzing every RPC of a real daemon with random and malformed messages, chunk bytes, ids, arena
ids and shm paths (hypothesis): the daemon never crashes, never answers INTERNAL or UNKNOWN (a
client-caused error is INVALID_ARGUMENT, NOT_FOUND, ...), and the sessions of the namespaces the
fuzzer may not write are byte-identical afterwards. Every RPC test runs over a stock gRPC channel
and over the local socket (the same-host default); the local socket's own surface is fuzzed too:
raw frames of every kind (cut, oversized, garbage) and fds passed with calls (sealed, unsealed,
sparse, write-sealed memfds, pipes, files, directories, two at once).

The fuzzer calls with no token, an unknown token, its own token (namespace "fuzz") and, for RPCs
that only read or move data between tiers, the admin token. Short in CI (KVSTORE_FUZZ_EXAMPLES
examples per RPC, default 25, derandomized); ``benchmarks/reliability/bench_fuzz.py`` runs the long mode and
writes ``KVSTORE_FUZZ_REPORT`` (the case count) into benchmarks/results/fuzz.json.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import struct
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.client import Client
from kvstore.format import chunk
from kvstore.format.layout import get_layout
from kvstore.transport import convert, local_channel, shm
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers.daemon import Daemon, make_session, running_daemon, save_session

EXAMPLES = int(os.environ.get("KVSTORE_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
TOKENS = """
[tokens]
"tok-fuzz" = ["fuzz"]
"tok-a" = ["team-a"]
"tok-b" = ["team-b"]
"tok-admin" = ["*"]
"""
PROTECTED = ("team-a", "team-b")  # the fuzzer's tokens may not write here: checksummed before and after
TINY16, TINY8 = get_layout("tiny-16"), get_layout("tiny-8")
SESSIONS = [make_session(namespace="team-a", session_id="a1", tokens=600, seed=1),
            make_session(namespace="team-b", session_id="b1", tokens=600, seed=2),
            make_session(namespace="fuzz", session_id="f1", tokens=600, seed=3)]
REAL_KEYS = [k for s in SESSIONS for k in s.keys]
BLOBS = [b for s in SESSIONS for b in s.blobs] + [s.manifest.tail for s in SESSIONS]
BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE,
             grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclass
class Fuzzed:
    """The daemon under fuzzing and what the fuzzer may name, shared by both transports."""

    daemon: Daemon
    local_socket: str
    paths: list[str]  # shm paths worth naming: FIFOs, directories, real files, arenas
    arena: shm.Arena  # an arena the fuzzer's token may attach (it knows the nonce)
    arena_ids: list[str]  # attached by the admin and by team-a: unknown to the fuzzer's token
    cases: dict[str, int] = field(default_factory=dict)
    codes: dict[str, int] = field(default_factory=dict)
    by_case: dict[str, dict[str, int]] = field(default_factory=dict)  # case -> status code -> calls

    def count(self, case: str, code: grpc.StatusCode | str) -> None:
        name = code if isinstance(code, str) else code.name
        self.cases[case] = self.cases.get(case, 0) + 1
        self.codes[name] = self.codes.get(name, 0) + 1
        per = self.by_case.setdefault(case, {})
        per[name] = per.get(name, 0) + 1


@dataclass
class Target:
    """One transport to the fuzzed daemon: a stock gRPC channel, or the local socket's channel."""

    fuzzed: Fuzzed
    transport: str
    channel: Any  # grpc.Channel or local_channel.LocalChannel: the same call surface
    stub: pb_grpc.KVStoreStub

    @property
    def daemon(self) -> Daemon:
        return self.fuzzed.daemon

    @property
    def paths(self) -> list[str]:
        return self.fuzzed.paths

    @property
    def arena(self) -> shm.Arena:
        return self.fuzzed.arena

    @property
    def arena_ids(self) -> list[str]:
        return self.fuzzed.arena_ids

    def count(self, case: str, code: grpc.StatusCode) -> None:
        self.fuzzed.count(case if self.transport == "grpc" else f"{case} (local socket)", code)


def _checksums(admin: Client) -> dict[str, str]:
    out = {}
    for ns in PROTECTED:
        for summary in admin.list_sessions(ns):
            m, chunks = admin.load_session(ns, summary.session_id)
            h = hashlib.sha256(repr((m.chunk_keys, m.tail, m.last_token_ids, m.metadata, m.retention)).encode())
            for i, blob in chunks:
                h.update(i.to_bytes(4, "little") + bytes(blob))
            out[f"{ns}/{summary.session_id}"] = h.hexdigest()
    return out


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    shm_dir = shm.default_shm_dir()
    if shm_dir is None:
        pytest.skip("no writable /dev/shm on this host")
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "tokens.toml").write_text(TOKENS)
    made: list[Path] = []

    def entry(make: Callable[[Path], object]) -> str:
        p = shm_dir / f"kvstore-cli-{uuid.uuid4().hex}"
        make(p)
        made.append(p)
        return str(p)

    paths = [entry(os.mkfifo), entry(os.mkdir), entry(lambda p: p.write_bytes(b"".join(SESSIONS[2].blobs))),
             entry(lambda p: p.write_bytes(b"")), "/dev/shm", "/etc/passwd", "/dev/shm/../etc/passwd",
             f"/dev/shm/kvstore-srv-{uuid.uuid4().hex}", f"/tmp/kvstore-cli-{uuid.uuid4().hex}", "",
             f"/dev/shm\0/kvstore-cli-{uuid.uuid4().hex}", f"/dev/shm/kvstore-cli-{uuid.uuid4().hex}\0"]
    arena = shm.Arena.create(shm_dir, 1 << 20)
    paths.append(arena.path)
    with running_daemon(tmp / "data", "--tokens-file", str(tmp / "tokens.toml")) as d:
        arena_ids = []
        for token, s in (("tok-admin", SESSIONS[0]), ("tok-b", SESSIONS[1]), ("tok-fuzz", SESSIONS[2])):
            with Client(address=d.address, token=token, arena_bytes=1 << 20) as c:
                save_session(c, s)
                list(c.load_chunks(s.namespace, s.keys, zero_copy=True))
                if token != "tok-fuzz":
                    arena_ids.append(c.carrier.arena_id)
        with Client(address=d.address, token="tok-admin") as admin:
            before = _checksums(admin)
            local_socket = admin.info().local_socket
        f = Fuzzed(d, local_socket, paths, arena, arena_ids)
        yield f
        assert d.proc.poll() is None, "the daemon died"
        with Client(address=d.address, token="tok-admin") as admin:
            assert admin.health() == "SERVING"
            assert _checksums(admin) == before, "a protected session changed"
        assert "internal error" not in d.log(), d.log()[-3000:]
    for p in made:
        p.rmdir() if p.is_dir() else p.unlink()
    if os.path.exists(arena.path):
        os.unlink(arena.path)
    arena.close()
    report = os.environ.get("KVSTORE_FUZZ_REPORT")
    if report:
        Path(report).write_text(json.dumps({"examples_per_test": EXAMPLES, "cases": f.cases,
                                            "total_cases": sum(f.cases.values()), "status_codes": f.codes},
                                           indent=1))


def open_target(front: str, fuzzed: Fuzzed, on_open: Callable[[local_channel.LocalChannel], None] | None = None
                ) -> Iterator[Target]:
    """A fuzz target over ``front``: a stock gRPC channel, or the local socket, which same-host
    clients use by default (the same handlers behind other framing: server/local.py); ``on_open``
    runs on a fresh local channel first. Shared by test_fuzz_surfaces.py."""
    if front == "grpc":
        with grpc.insecure_channel(fuzzed.daemon.address) as channel:
            yield Target(fuzzed, "grpc", channel, pb_grpc.KVStoreStub(channel))
        return
    if not fuzzed.local_socket:
        pytest.skip("the daemon serves no local socket here")
    local = local_channel.LocalChannel(fuzzed.local_socket)
    if on_open is not None:
        on_open(local)
    yield Target(fuzzed, "local", local, pb_grpc.KVStoreStub(local))
    local.close()


@pytest.fixture(scope="module", params=["grpc", "local socket"])
def target(request: pytest.FixtureRequest, fuzzed: Fuzzed) -> Iterator[Target]:
    """Every fuzz test runs over both front ends (``open_target``)."""
    yield from open_target(request.param, fuzzed)


def call(t: Target, method: str, request: Any, token: str | None, case: str = "") -> None:
    """One RPC; any answer but INTERNAL/UNKNOWN (or a dead or hung daemon) is fine. Counted as
    ``method``, or as ``method case`` where a case is named."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    fn = getattr(t.stub, method)
    try:
        if method == "SaveChunks":
            fn(iter(request), timeout=60, metadata=metadata)
        elif method in ("LoadChunks", "LoadSession"):
            list(fn(request, timeout=60, metadata=metadata))
        else:
            fn(request, timeout=60, metadata=metadata)
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()  # type: ignore[attr-defined]
        assert code not in BAD_CODES, (t.transport, method, request, code, e.details())  # type: ignore[attr-defined]
    t.count(f"{method} {case}" if case else method, code)


# -- strategies -----------------------------------------------------------------------------------
# about half the draws are the fuzzer's own names, so calls get past validation to the deeper paths
namespaces = st.one_of(st.just("fuzz"), st.sampled_from(["team-a", "team-b", "", "a b", "../x", "x" * 65]),
                       st.text(max_size=70))
session_ids = st.one_of(st.just("f1"), st.sampled_from(["a1", "b1", "", "-x", "x" * 129, "s/../t"]),
                        st.text(max_size=140))
keys = st.one_of(st.sampled_from(REAL_KEYS), st.binary(min_size=16, max_size=16), st.binary(max_size=40),
                 st.sampled_from([b"m:team-b/b1" + bytes(5), b"m:fuzz/f1" + bytes(7)]))
layout_ids = st.one_of(st.sampled_from([TINY16.layout_id, TINY8.layout_id, bytes(16)]), st.binary(max_size=20))
token_ids = st.lists(st.integers(0, 2**32 - 1), max_size=700)
u64 = st.one_of(st.integers(0, 4), st.integers(0, 2**64 - 1))
u32 = st.one_of(st.integers(0, 1024), st.integers(0, 2**32 - 1))
floats = st.floats(allow_nan=True, allow_infinity=True)
user_tokens = st.sampled_from([None, "garbage", *["tok-fuzz"] * 8])
read_tokens = st.sampled_from([None, "garbage", "tok-admin", "tok-admin", *["tok-fuzz"] * 6])


def mutate(draw: st.DrawFn, blobs: list[bytes], header_span: int, ops: list[str], random_max: int) -> bytes:
    """One of ``blobs``, mutated by one of ``ops``: kept ("real"), bits flipped, cut, extended, a
    4-byte field of its first ``header_span`` bytes patched (checksum fixed up or not), or random
    bytes. Shared by the chunk and the page fuzzers (test_fuzz_surfaces.py)."""
    blob = bytearray(draw(st.sampled_from(blobs)))
    op = draw(st.sampled_from(ops))
    if op == "flip":
        for i in draw(st.lists(st.integers(0, len(blob) - 1), min_size=1, max_size=8)):
            blob[i] ^= 1 << draw(st.integers(0, 7))
    elif op == "cut":
        blob = blob[: draw(st.integers(0, len(blob) - 1))]
    elif op == "extend":
        blob += draw(st.binary(min_size=1, max_size=64))
    elif op == "header":
        off = draw(st.integers(0, header_span - 4))
        struct.pack_into("<I", blob, off, draw(st.sampled_from([0, 1, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF,
                                                                draw(st.integers(0, 2**32 - 1))])))
    elif op == "random":
        return draw(st.binary(max_size=random_max))
    if op != "real" and len(blob) >= 16 and draw(st.booleans()):  # a valid checksum: reach the deeper checks
        struct.pack_into("<Q", blob, len(blob) - 8, xxhash.xxh3_64_intdigest(bytes(blob[:-8])))
    return bytes(blob)


@st.composite
def chunk_bytes(draw: st.DrawFn) -> bytes:
    """A real chunk, mutated (``mutate``): header fields are the chunk header and its key table."""
    return mutate(draw, BLOBS, chunk.HEADER_BYTES + 16 * 8,
                  ["real", "flip", "cut", "extend", "header", "header", "random"], 2048)


def shm_paths(t: Target) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(t.paths), st.text(max_size=80))


def arena_ids(t: Target) -> st.SearchStrategy[str]:
    return st.one_of(st.just(""), st.sampled_from(t.arena_ids), st.text(max_size=40))


@st.composite
def retention(draw: st.DrawFn) -> pb.Retention:
    return pb.Retention(pinned=draw(st.booleans()), ttl_s=draw(floats))


# -- one test per RPC -------------------------------------------------------------------------------
@FUZZ
@given(data=st.data())
def test_fuzz_save_chunks(target: Target, data: st.DataObject) -> None:
    t = target
    header = pb.SaveHeader(namespace=data.draw(namespaces), layout_id=data.draw(layout_ids),
                           parent_key=data.draw(st.one_of(st.just(b""), keys)), first_index=data.draw(u64),
                           arena_id=data.draw(arena_ids(t)), arena_bytes=data.draw(u64))
    if data.draw(st.booleans()):  # a valid header for the fuzzer's session, one field left random
        keep = data.draw(st.sampled_from(["namespace", "layout_id", "parent_key", "first_index", "arena_id"]))
        valid = pb.SaveHeader(namespace="fuzz", layout_id=TINY16.layout_id)
        valid.MergeFrom(pb.SaveHeader(**{keep: getattr(header, keep)}))
        header = valid
    if data.draw(st.booleans()):  # a turn: chunks, then the commit of the fuzzer's session (or another namespace's)
        turn = convert.session_to_pb(SESSIONS[2].manifest)
        turn.namespace = data.draw(st.one_of(st.just(header.namespace), namespaces))
        turn.session_id = data.draw(st.sampled_from(["f1", "f2"]))
        header.commit.CopyFrom(turn)
    stream = b"".join(data.draw(st.lists(chunk_bytes(), max_size=4)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=4)))
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    requests = [pb.SaveChunksRequest(header=header, data=pieces[0])]
    requests += [pb.SaveChunksRequest(data=p) for p in pieces[1:]]
    if data.draw(st.booleans()):  # no header first, or a second header
        requests.insert(data.draw(st.integers(0, len(requests))), pb.SaveChunksRequest(header=header))
    call(t, "SaveChunks", requests, data.draw(user_tokens))


@FUZZ
@given(data=st.data())
def test_fuzz_loads(target: Target, data: st.DataObject) -> None:
    t = target
    arena_id = data.draw(arena_ids(t))
    call(t, "LoadChunks", pb.LoadChunksRequest(namespace=data.draw(namespaces),
                                               keys=data.draw(st.lists(keys, max_size=12)),
                                               arena_id=arena_id), data.draw(read_tokens))
    call(t, "LoadSession", pb.LoadSessionRequest(namespace=data.draw(namespaces), session_id=data.draw(session_ids),
                                                 arena_id=arena_id), data.draw(read_tokens))


@FUZZ
@given(data=st.data())
def test_fuzz_lookup_and_session_reads(target: Target, data: st.DataObject) -> None:
    t = target
    call(t, "Lookup", pb.LookupRequest(namespace=data.draw(namespaces), layout_id=data.draw(layout_ids),
                                       token_ids=data.draw(token_ids)), data.draw(read_tokens))
    call(t, "GetSession", pb.GetSessionRequest(namespace=data.draw(namespaces), session_id=data.draw(session_ids)),
         data.draw(read_tokens))
    call(t, "ListSessions", pb.ListSessionsRequest(namespace=data.draw(namespaces)), data.draw(read_tokens))
    call(t, "PrefetchSession", pb.PrefetchSessionRequest(namespace=data.draw(namespaces),
                                                         session_id=data.draw(session_ids)), data.draw(read_tokens))
    call(t, "GetServerInfo", pb.GetServerInfoRequest(), data.draw(read_tokens))
    call(t, "Stats", pb.StatsRequest(), data.draw(read_tokens))


@FUZZ
@given(data=st.data())
def test_fuzz_session_writes(target: Target, data: st.DataObject) -> None:
    t = target
    ns, sid = data.draw(namespaces), data.draw(session_ids)
    if data.draw(st.booleans()):  # the fuzzer's real session, one field changed: reaches the deeper checks
        ns, sid = "fuzz", data.draw(st.sampled_from(["f1", "f2"]))
    session = pb.Session(session_id=sid, namespace=ns, layout_id=data.draw(layout_ids), token_count=data.draw(u64),
                         chunk_tokens=data.draw(st.one_of(st.just(256), u32)),
                         chunk_keys=data.draw(st.lists(keys, max_size=6)), tail=data.draw(chunk_bytes()),
                         last_token_ids=data.draw(st.lists(st.integers(0, 2**32 - 1), max_size=200)),
                         created_at=data.draw(floats), updated_at=data.draw(floats), retention=data.draw(retention()),
                         metadata=data.draw(st.dictionaries(st.text(max_size=20), st.text(max_size=40), max_size=4)))
    if ns == "fuzz" and sid in ("f1", "f2"):
        real = convert.session_to_pb(SESSIONS[2].manifest)
        real.session_id = sid
        field_name = data.draw(st.sampled_from(["layout_id", "token_count", "chunk_tokens", "chunk_keys", "tail",
                                                "last_token_ids", "retention", "metadata", None]))
        if field_name is not None:
            real.ClearField(field_name)
            real.MergeFrom(pb.Session(**{field_name: getattr(session, field_name)}))
        session = real
    call(t, "CommitSession", pb.CommitSessionRequest(session=session), data.draw(user_tokens))
    call(t, "TouchSession", pb.TouchSessionRequest(namespace=ns, session_id=sid, retention=data.draw(retention())),
         data.draw(user_tokens))
    call(t, "EvictSession", pb.EvictSessionRequest(namespace=ns, session_id=sid, tier=data.draw(
        st.one_of(st.sampled_from(["host", "ssd", "redis", ""]), st.text(max_size=10)))), data.draw(read_tokens))
    if data.draw(st.integers(0, 9)) == 0:  # rarely: a delete (it may remove the fuzzer's own session)
        call(t, "DeleteSession", pb.DeleteSessionRequest(namespace=ns, session_id=sid), data.draw(user_tokens))


@FUZZ
@given(data=st.data())
def test_fuzz_attach_arena(target: Target, data: st.DataObject) -> None:
    t = target
    nonce = data.draw(st.one_of(st.just(t.arena.nonce), st.binary(max_size=20)))
    size = data.draw(st.one_of(st.just(t.arena.size), u64))
    call(t, "AttachArena", pb.AttachArenaRequest(path=data.draw(shm_paths(t)), size=size, nonce=nonce),
         data.draw(user_tokens))
    call(t, "DetachArena", pb.DetachArenaRequest(arena_id=data.draw(arena_ids(t))), data.draw(user_tokens))


METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods]


@FUZZ
@given(method=st.sampled_from(METHODS), payload=st.binary(max_size=256), token=user_tokens)
def test_fuzz_raw_request_bytes(target: Target, method: str, payload: bytes, token: str | None) -> None:
    """Random bytes as the serialized request of any RPC (many parse as some message: fine too)."""
    t = target
    m = pb.DESCRIPTOR.services_by_name["KVStore"].methods_by_name[method]
    path = f"/kvstore.v1.KVStore/{method}"
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    raw = {"request_serializer": _same, "response_deserializer": _same}
    try:
        if m.client_streaming:
            t.channel.stream_unary(path, **raw)(iter([payload]), timeout=60, metadata=metadata)
        elif m.server_streaming:
            list(t.channel.unary_stream(path, **raw)(payload, timeout=60, metadata=metadata))
        else:
            t.channel.unary_unary(path, **raw)(payload, timeout=60, metadata=metadata)
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()  # type: ignore[attr-defined]
        assert code not in BAD_CODES, (t.transport, method, payload, code, e.details())  # type: ignore[attr-defined]
    t.count("raw bytes", code)


def _same(b: bytes) -> bytes:
    return b


# -- the local socket's own surface: its framing, and fds passed with a call ------------------------------
METHOD_PATHS = [f"/kvstore.v1.KVStore/{m}" for m in METHODS]
FUZZ_REQUESTS = [pb.GetServerInfoRequest().SerializeToString(),
                 pb.ListSessionsRequest(namespace="fuzz").SerializeToString(),
                 pb.LoadSessionRequest(namespace="fuzz", session_id="f1").SerializeToString(),
                 pb.LoadChunksRequest(namespace="fuzz", keys=SESSIONS[2].keys).SerializeToString(),
                 pb.LookupRequest(namespace="fuzz", layout_id=TINY16.layout_id,
                                  token_ids=[int(x) for x in SESSIONS[2].token_ids]).SerializeToString(),
                 pb.SaveChunksRequest(header=pb.SaveHeader(namespace="fuzz", layout_id=TINY16.layout_id),
                                      data=SESSIONS[2].blobs[0]).SerializeToString()]
FRAME_TOKENS = [(), (("authorization", "Bearer tok-fuzz"),), (("authorization", "Bearer garbage"),)]


@st.composite
def local_frames(draw: st.DrawFn) -> bytes:
    """A connection's bytes: mostly a well-formed call to a real method first, then frames of every
    kind (calls to real and made-up methods, real and random request messages, ends, statuses a
    client must not send, unknown kinds), whole, cut short, with a length out of range, or garbage."""
    out = []
    if draw(st.sampled_from([True, True, False])):  # a well-formed call first, answered before what follows is read
        out += [local_channel.call_frame(draw(st.sampled_from(METHOD_PATHS)), draw(st.sampled_from(FRAME_TOKENS))),
                *(local_channel.frame(local_channel.MSG, draw(st.sampled_from(FUZZ_REQUESTS))) for _ in range(draw(
                    st.sampled_from([1, 1, 1, 0, 2])))), local_channel.frame(local_channel.END)]
    for _ in range(draw(st.integers(0 if out else 1, 6))):
        lc = local_channel
        kind = draw(st.sampled_from([lc.CALL, lc.CALL, lc.MSG, lc.MSG, lc.END,
                                     local_channel.STATUS, 0, 9, 255]))
        if kind == local_channel.CALL and draw(st.booleans()):
            path = draw(st.one_of(st.sampled_from(METHOD_PATHS), st.text(max_size=60)))
            out.append(local_channel.call_frame(path, draw(st.sampled_from(FRAME_TOKENS))))
        elif kind == local_channel.MSG and draw(st.booleans()):
            out.append(local_channel.frame(kind, draw(st.sampled_from(FUZZ_REQUESTS))))
        else:
            out.append(local_channel.frame(kind, draw(st.binary(max_size=120))))
    data = b"".join(out)
    op = draw(st.sampled_from(["whole", "whole", "whole", "cut", "bad length", "garbage"]))
    if op == "cut":
        return data[: draw(st.integers(0, len(data)))]
    if op == "bad length":
        return data + struct.pack("<IB", draw(st.sampled_from([0, local_channel.MAX_FRAME + 1, 2**32 - 1])), 2)
    if op == "garbage":
        return draw(st.binary(max_size=300))
    return data


def _answers(raw: bytes) -> list[int]:
    """The status codes in what the daemon sent back; its framing must hold throughout."""
    codes, pos = [], 0
    while pos + local_channel.HEADER.size <= len(raw):
        length, kind = local_channel.HEADER.unpack_from(raw, pos)
        assert kind in (local_channel.MSG, local_channel.STATUS), kind
        assert 1 <= length <= local_channel.MAX_FRAME, length
        if kind == local_channel.STATUS:
            codes.append(raw[pos + local_channel.HEADER.size])
        pos += local_channel.HEADER.size + length - 1  # the length counts the kind byte, part of the header
    assert pos == len(raw), "the daemon's answer ends inside a frame"
    return codes


@FUZZ
@given(data=local_frames())
def test_fuzz_local_socket_frames(fuzzed: Fuzzed, data: bytes) -> None:
    """Raw bytes on a fresh local connection: whatever the daemon answers is well framed and no
    INTERNAL/UNKNOWN; a connection it cannot parse is closed; the daemon serves the next client."""
    if not fuzzed.local_socket:
        pytest.skip("the daemon serves no local socket here")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(fuzzed.local_socket)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it may close on bad framing at once
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        raw = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk_ := s.recv(1 << 16):
                raw += chunk_
    codes = [local_channel.status_code(c) for c in _answers(raw)]
    assert not set(codes) & BAD_CODES, codes
    for code in codes or ["closed"]:
        fuzzed.count("raw frames (local socket)", code)
    with Client(address=fuzzed.daemon.address, token="tok-fuzz") as c:  # same host: over the local socket
        assert c.list_sessions("fuzz") is not None


FD_KINDS = ["sealed", "sealed", "unsealed", "sparse", "shrink only", "write sealed", "future write sealed", "pipe",
            "shm file", "directory", "none", "two"]
F_SEAL_WRITE, F_SEAL_FUTURE_WRITE = 0x8, 0x10


def _fds(kind: str, size: int, nonce: bytes, shm_dir: Path) -> list[int]:
    """The fds a call passes: a memfd of ``size`` bytes (sealed or not, allocated or not), or anything else."""
    if kind == "none":
        return []
    if kind == "pipe":
        r, w = os.pipe()
        os.close(w)
        return [r]
    if kind == "directory":
        return [os.open(shm_dir, os.O_RDONLY)]
    if kind == "shm file":
        a = shm.Arena.create(shm_dir, size)
        fd = os.open(a.path, os.O_RDWR)
        os.unlink(a.path)
        a.close()
        return [fd]
    fd = os.memfd_create("fuzz", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if kind != "sparse":
        os.posix_fallocate(fd, 0, size)
    os.pwrite(fd, nonce, 0)
    seals = {"unsealed": 0, "shrink only": shm.SEAL_SHRINK, "write sealed": shm.SEALS | F_SEAL_WRITE,
             "future write sealed": shm.SEALS | F_SEAL_FUTURE_WRITE}.get(kind, shm.SEALS)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return [fd, os.dup(fd)] if kind == "two" else [fd]


@FUZZ
@given(data=st.data())
def test_fuzz_fds_passed_over_the_local_socket(fuzzed: Fuzzed, data: st.DataObject) -> None:
    """AttachArena (and, now and then, another method) with every kind of fd, size, nonce and path; an
    arena that is attached then carries a load, is truncated (a sealed one refuses) and is detached.
    No INTERNAL/UNKNOWN, no dead daemon, and the daemon keeps none of the fds it was passed."""
    if not fuzzed.local_socket:
        pytest.skip("the daemon serves no local socket here")
    local = local_channel.LocalChannel(fuzzed.local_socket)
    t = Target(fuzzed, "local", local, pb_grpc.KVStoreStub(local))
    size = 64 << 10
    nonce = os.urandom(shm.NONCE_BYTES)
    kind = data.draw(st.sampled_from(FD_KINDS))
    method = data.draw(st.sampled_from(["AttachArena"] * 6 + METHODS))
    token = data.draw(user_tokens)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    req = pb.AttachArenaRequest(size=data.draw(st.one_of(st.just(size), u64)),
                                nonce=data.draw(st.one_of(st.just(nonce), st.binary(max_size=20))),
                                path=data.draw(st.one_of(st.just(""), shm_paths(t))))
    shm_dir = shm.default_shm_dir()
    assert shm_dir is not None
    fds = _fds(kind, size, nonce, shm_dir)
    try:
        with_fds = local.unary_with_fds(f"/kvstore.v1.KVStore/{method}", _same, _same)
        try:
            raw = with_fds(req.SerializeToString() if method == "AttachArena" else b"",
                           [os.dup(fd) for fd in fds], timeout=60, metadata=metadata)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            raw, code = b"", e.code()  # type: ignore[attr-defined]
            assert code not in BAD_CODES, (kind, method, req, code, e.details())  # type: ignore[attr-defined]
        fuzzed.count(f"fds with {'AttachArena' if method == 'AttachArena' else 'another method'} (local socket)",
                     code)
        if method == "AttachArena" and code == grpc.StatusCode.OK:
            arena_id = pb.AttachArenaResponse.FromString(raw).arena_id
            call(t, "LoadChunks", pb.LoadChunksRequest(namespace="fuzz", keys=SESSIONS[2].keys, arena_id=arena_id),
                 token)
            with contextlib.suppress(OSError):
                os.ftruncate(fds[0], 0)  # refused: only a memfd sealed against shrinking is attached
            header = pb.SaveHeader(namespace="fuzz", layout_id=TINY16.layout_id, arena_id=arena_id,
                                   arena_bytes=len(SESSIONS[2].blobs[0]))
            call(t, "SaveChunks", [pb.SaveChunksRequest(header=header)], token)
            t.stub.DetachArena(pb.DetachArenaRequest(arena_id=arena_id), timeout=60, metadata=metadata)
    finally:
        for fd in fds:
            os.close(fd)
        local.close()
    assert fuzzed.daemon.proc.poll() is None, "the daemon died"
