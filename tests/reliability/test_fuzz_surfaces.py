"""Fuzzing the surfaces added most recently (issue 27, item 6), on a real daemon, over a stock gRPC
channel and over the local socket: RegisterLayout (definitions mutated field by field, numbers JSON
cannot hold in an int, deep nesting, non-ASCII names, random bytes), LookupKeys, page blobs saved
and loaded, page sessions committed, read, touched and deleted, and loads into the caller's own
memory (``CallerMemory``: what ``load_session_into`` / ``load_chunks_into`` send) at every kind of
address and size.

What must hold, as in tests/reliability/test_fuzz.py: no INTERNAL/UNKNOWN and no dead daemon; team-a's and
team-b's sessions (token chunks and page blobs) byte-identical afterwards. And for loads into the
caller's memory: the fuzzer's buffer sits between two PROT_NONE pages, filled with a canary; after
every call, every byte the answer did not place a blob at still holds the canary (0 writes outside
the caller's buffer, or outside the range it named), and every blob placed is one of the keys the
call asked for, of a namespace its token covers, byte for byte (0 cross-tenant reads).

Short in CI (KVSTORE_FUZZ_EXAMPLES, default 25, derandomized: the same cases every run);
``benchmarks/reliability/bench_fuzz.py`` runs the long mode and writes the counts
(KVSTORE_FUZZ_SURFACES_REPORT) into benchmarks/results/fuzz.json.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvstore.client import Client
from kvstore.client import load_into as into
from kvstore.format import page
from kvstore.format.manifest import Kind, Manifest, Retention
from kvstore.server.request_checks import MAX_KEYS
from kvstore.transport import shm
from kvstore.v1 import kvstore_pb2 as pb
from tests.helpers.daemon import running_daemon, save_session
from tests.helpers.pages import opaque_layout
from tests.reliability.test_fuzz import (
    BAD_CODES,
    EXAMPLES,
    FUZZ,
    SESSIONS,
    TOKENS,
    Fuzzed,
    Target,
    _checksums,
    call,
    keys,
    mutate,
    namespaces,
    open_target,
    read_tokens,
    session_ids,
    u64,
    user_tokens,
)

PAGES = opaque_layout("fuzz/pages", 4096, {"tp_size": "1"})


def page_blob(ns: str, seed: int) -> tuple[bytes, bytes]:
    g = PAGES.groups[seed % len(PAGES.groups)]
    h = xxhash.xxh3_128_digest(f"{ns}/{seed}".encode())
    key = page.page_key(PAGES.layout_id, ns, g.group, h)
    block = np.random.default_rng(seed).integers(0, 256, g.block_bytes, dtype=np.uint8)
    return key, page.encode(PAGES, g.group, h, key, block)


FUZZ_PAGES = [page_blob("fuzz", s) for s in range(4)]
A_PAGES = [page_blob("team-a", s) for s in range(10, 14)]
A_TOKENS = SESSIONS[0]  # team-a's token session of tests/reliability/test_fuzz.py
BLOB_OF = {**dict(FUZZ_PAGES), **dict(A_PAGES), **dict(zip(A_TOKENS.keys, A_TOKENS.blobs)),
           **dict(zip(SESSIONS[2].keys, SESSIONS[2].blobs))}
OWNER = {**{k: "fuzz" for k, _ in FUZZ_PAGES}, **{k: "team-a" for k, _ in A_PAGES},
         **{k: "team-a" for k in A_TOKENS.keys}, **{k: "fuzz" for k in SESSIONS[2].keys}}
COVERS = {"tok-fuzz": {"fuzz"}, "tok-admin": {"fuzz", "team-a", "team-b"}}
page_keys = st.one_of(st.sampled_from([k for k, _ in FUZZ_PAGES + A_PAGES]), keys)


def page_session(ns: str, sid: str, items: list[tuple[bytes, bytes]]) -> Manifest:
    return Manifest(sid, ns, PAGES.layout_id, 16 * len(items), 0, tuple(k for k, _ in items), b"", (),
                    retention=Retention(ttl_s=3600), kind=Kind.ENGINE_PAGES)


@dataclass
class Guarded:
    """The fuzzer's buffer for loads into its own memory: ``size`` writable bytes at ``address``
    between two PROT_NONE pages (a range the daemon may write past either end is refused by the
    kernel), filled with a canary before every call."""

    map: mmap.mmap
    address: int
    size: int
    CANARY = 0xA5

    @classmethod
    def make(cls, size: int) -> Guarded:
        m = mmap.mmap(-1, size + 2 * mmap.PAGESIZE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        libc = ctypes.CDLL(None, use_errno=True)
        for at in (base, base + mmap.PAGESIZE + size):
            assert libc.mprotect(ctypes.c_void_p(at), mmap.PAGESIZE, 0) == 0, os.strerror(ctypes.get_errno())
        return cls(m, base + mmap.PAGESIZE, size)

    def view(self) -> memoryview:
        return memoryview(self.map)[mmap.PAGESIZE : mmap.PAGESIZE + self.size]

    def fill(self) -> None:
        self.view()[:] = bytes([self.CANARY]) * self.size


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    tmp = tmp_path_factory.mktemp("fuzz-surfaces")
    (tmp / "tokens.toml").write_text(TOKENS)
    arena = shm.Arena.create(shm.default_shm_dir() or tmp, 4096)  # not used here: the shape of Fuzzed
    with running_daemon(tmp / "data", "--tokens-file", str(tmp / "tokens.toml")) as d:
        for token, ns, s, items in (("tok-a", "team-a", A_TOKENS, A_PAGES), ("tok-b", "team-b", SESSIONS[1], []),
                                    ("tok-fuzz", "fuzz", SESSIONS[2], FUZZ_PAGES)):
            with Client(address=d.address, token=token, arena_bytes=1 << 20) as c:
                save_session(c, s)
                if items:
                    assert c.register_layout(PAGES.definition()) == PAGES.layout_id
                    c.save_session(page_session(ns, f"{ns[0]}p1", items), [b for _, b in items])
                    assert len(list(c.load_chunks(ns, [k for k, _ in items]))) == len(items)  # in memory
        with Client(address=d.address, token="tok-admin") as admin:
            before = _checksums(admin)
            local_socket = admin.info().local_socket
        f = Fuzzed(d, local_socket, [], arena, [])
        yield f
        assert d.proc.poll() is None, "the daemon died"
        with Client(address=d.address, token="tok-admin") as admin:
            assert admin.health() == "SERVING"
            assert _checksums(admin) == before, "a protected session changed"
            admin.stats()  # Stats answers, whatever the fuzzer registered
        assert "internal error" not in d.log(), d.log()[-3000:]
    if os.path.exists(arena.path):
        os.unlink(arena.path)
    arena.close()
    report = os.environ.get("KVSTORE_FUZZ_SURFACES_REPORT")
    if report:
        Path(report).write_text(json.dumps({"examples_per_test": EXAMPLES, "cases": f.cases,
                                            "total_cases": sum(f.cases.values()), "status_codes": f.codes,
                                            "by_case": f.by_case}, indent=1))


@pytest.fixture(scope="module", params=["grpc", "local socket"])
def target(request: pytest.FixtureRequest, fuzzed: Fuzzed) -> Iterator[Target]:
    # on the local socket, where Yama asks for it: the daemon may write into this process
    yield from open_target(request.param, fuzzed, lambda local: into.allow_daemon(local.peer_pid()))


# -- RegisterLayout --------------------------------------------------------------------------------------
def _paths(v: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield at, v
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        yield from _paths(x, (*at, k))


def _set(doc: Any, at: tuple[Any, ...], value: Any) -> Any:
    if not at:
        return value
    doc[at[0]] = _set(doc[at[0]], at[1:], value)
    return doc


RAW = "\x00raw\x00"  # a placeholder for JSON text json.dumps cannot make (Infinity, 1e400, deep nesting)
ODD_NUMBERS = ["Infinity", "-Infinity", "NaN", "1e400", "-1e400", "1e308", "1" + "0" * 30, "18446744073709551616",
               "-1", "0", "2.5", "4294967296", "9007199254740993"]
ODD_STRINGS = ["", "é" * 20_000, "\u2603" * 30_000, "\x00", "a" * 70_000, "../x", "\ud800"]


@st.composite
def definitions(draw: st.DrawFn) -> bytes:
    """A page layout definition: the real one, one value replaced (by an odd number, string, nesting,
    or nothing), a key added, cut short, or random bytes."""
    doc = json.loads(PAGES.definition())
    op = draw(st.sampled_from(["real", "number", "number", "string", "nest", "drop", "extra", "cut", "random"]))
    if op == "random":
        return draw(st.binary(max_size=300))
    raw = ""
    spots = [(at, v) for at, v in _paths(doc) if at]
    if op in ("number", "string", "nest", "drop"):
        at, old = draw(st.sampled_from(spots))
        if op == "drop" and isinstance(at[-1], str):
            parent = doc
            for k in at[:-1]:
                parent = parent[k]
            del parent[at[-1]]
        else:
            raw = {"number": lambda: draw(st.sampled_from(ODD_NUMBERS)),
                   "string": lambda: json.dumps(draw(st.sampled_from(ODD_STRINGS)), ensure_ascii=draw(st.booleans())),
                   "nest": lambda: (lambda n: "[" * n + "]" * n)(draw(st.sampled_from([2, 64, 1000, 100_000]))),
                   "drop": lambda: "null"}[op]()
            doc = _set(doc, at, RAW)
    elif op == "extra":
        doc[draw(st.text(max_size=12))] = draw(st.one_of(st.integers(), st.text(max_size=20)))
    text = json.dumps(doc, ensure_ascii=False).replace(json.dumps(RAW), raw)
    out = text.encode("utf-8", errors="surrogatepass")
    return out[: draw(st.integers(0, len(out)))] if op == "cut" else out


@FUZZ
@given(data=st.data())
def test_fuzz_register_layout(target: Target, data: st.DataObject) -> None:
    call(target, "RegisterLayout", pb.RegisterLayoutRequest(definition=data.draw(definitions())),
         data.draw(user_tokens))


# -- LookupKeys --------------------------------------------------------------------------------------------
@FUZZ
@given(data=st.data())
def test_fuzz_lookup_keys(target: Target, data: st.DataObject) -> None:
    ks = data.draw(st.lists(page_keys, max_size=16))
    if data.draw(st.integers(0, 19)) == 0:  # now and then: more keys than a call may name
        ks = ks[:1] * (MAX_KEYS + 1) if ks else []
    call(target, "LookupKeys", pb.LookupKeysRequest(namespace=data.draw(namespaces), keys=ks),
         data.draw(read_tokens))


# -- page blobs and page sessions ----------------------------------------------------------------------------
@st.composite
def page_bytes(draw: st.DrawFn) -> bytes:
    """A page blob (the fuzzer's or team-a's), mutated (test_fuzz.mutate): header fields are the page header's."""
    return mutate(draw, [b for _, b in FUZZ_PAGES + A_PAGES], page.HEADER_BYTES,
                  ["real", "real", "flip", "cut", "extend", "header", "header", "random"], 5000)


layout_choice = st.one_of(st.just(PAGES.layout_id), st.just(PAGES.layout_id),
                          st.sampled_from([SESSIONS[2].layout.layout_id, bytes(16)]), st.binary(max_size=20))


@st.composite
def page_sessions(draw: st.DrawFn, ns: str, sid: str, blob_keys: list[bytes]) -> pb.Session:
    chunk_keys = draw(st.one_of(st.just(blob_keys), st.lists(page_keys, max_size=6)))
    return pb.Session(session_id=sid, namespace=ns, layout_id=draw(layout_choice),
                      token_count=draw(st.one_of(st.just(16 * len(chunk_keys)), u64)),
                      chunk_tokens=draw(st.sampled_from([0, 0, 0, 256, 2**32 - 1])), chunk_keys=chunk_keys,
                      tail=draw(st.one_of(st.just(b""), st.binary(max_size=40))),
                      last_token_ids=draw(st.one_of(st.just([]), st.lists(st.integers(0, 2**32 - 1), max_size=4))),
                      retention=pb.Retention(ttl_s=draw(st.sampled_from([0.0, 3600.0, -1.0, float("nan")]))))


@FUZZ
@given(data=st.data())
def test_fuzz_page_saves_and_loads(target: Target, data: st.DataObject) -> None:
    ns = data.draw(st.one_of(st.just("fuzz"), st.just("fuzz"), namespaces))
    blobs = data.draw(st.lists(page_bytes(), max_size=4))
    header = pb.SaveHeader(namespace=ns, layout_id=data.draw(layout_choice))
    if data.draw(st.booleans()):  # a turn: the blobs and a page session naming them, in one call
        blob_keys = [page.read_header(b).key for b in blobs if _parses(b)]
        header.commit.CopyFrom(data.draw(page_sessions(ns, data.draw(st.sampled_from(["fp2", "fp3"])), blob_keys)))
    stream = b"".join(blobs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=3)))
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    call(target, "SaveChunks", [pb.SaveChunksRequest(header=header, data=pieces[0]),
                                *(pb.SaveChunksRequest(data=p) for p in pieces[1:])], data.draw(user_tokens), "pages")
    call(target, "LoadChunks", pb.LoadChunksRequest(namespace=data.draw(namespaces),
                                                    keys=data.draw(st.lists(page_keys, max_size=8))),
         data.draw(read_tokens), "pages")


def _parses(b: bytes) -> bool:
    try:
        page.read_header(b)
    except page.PageError:
        return False
    return True


@FUZZ
@given(data=st.data())
def test_fuzz_page_sessions(target: Target, data: st.DataObject) -> None:
    ns = data.draw(st.one_of(st.just("fuzz"), st.just("fuzz"), namespaces))
    sid = data.draw(st.one_of(st.sampled_from(["fp1", "fp2", "fp3", "ap1"]), session_ids))
    session = data.draw(page_sessions(ns, sid if sid != "fp1" else "fp2", [k for k, _ in FUZZ_PAGES]))
    call(target, "CommitSession", pb.CommitSessionRequest(session=session), data.draw(user_tokens), "page sessions")
    call(target, "LoadSession", pb.LoadSessionRequest(namespace=ns, session_id=sid), data.draw(read_tokens),
         "page sessions")
    call(target, "GetSession", pb.GetSessionRequest(namespace=ns, session_id=sid), data.draw(read_tokens),
         "page sessions")
    call(target, "TouchSession", pb.TouchSessionRequest(namespace=ns, session_id=sid, retention=pb.Retention(
        ttl_s=data.draw(st.sampled_from([0.0, 3600.0, -1.0, float("inf")])))), data.draw(user_tokens), "page sessions")
    if sid in ("fp2", "fp3") and data.draw(st.integers(0, 4)) == 0:  # now and then: delete one of its own
        call(target, "DeleteSession", pb.DeleteSessionRequest(namespace=ns, session_id=sid), data.draw(user_tokens),
             "page sessions")


# -- loads into the caller's memory -------------------------------------------------------------------------
BUFFER = 1 << 20  # room for a few of the fuzzer's ~58 KB chunks and 4 KB page blobs
WILD = [0, 1, 4096, 1 << 47, 1 << 63, 2**64 - 16, 2**64 - 1]


@pytest.fixture(scope="module")
def guarded() -> Guarded:
    return Guarded.make(BUFFER)


@FUZZ
@given(data=st.data())
def test_fuzz_caller_memory_loads(target: Target, guarded: Guarded, data: st.DataObject) -> None:
    """LoadChunks and LoadSession into the fuzzer's memory at any address and size. Whatever the
    answer, only the blobs it names were written, each where it says, each a key the call asked
    for in a namespace its token covers; every other byte of the buffer keeps its canary."""
    g = guarded
    where = data.draw(st.sampled_from(["inside", "inside", "inside", "around", "wild"]))
    if where == "inside":
        off = data.draw(st.integers(0, BUFFER))
        address = g.address + off
        size = data.draw(st.one_of(st.just(BUFFER - off), st.just(BUFFER - off), st.integers(0, BUFFER - off), u64))
    else:
        address = (g.address + data.draw(st.integers(-mmap.PAGESIZE, BUFFER + mmap.PAGESIZE)) if where == "around"
                   else data.draw(st.sampled_from(WILD)))
        size = data.draw(st.one_of(st.integers(0, BUFFER + 2 * mmap.PAGESIZE), u64))
    token = data.draw(st.one_of(st.just("tok-fuzz"), read_tokens))
    ns = data.draw(st.one_of(st.sampled_from(["fuzz", "fuzz", "fuzz", "team-a"]), namespaces))
    memory = pb.CallerMemory(address=address, size=size)
    g.fill()
    if data.draw(st.booleans()):
        real = st.sampled_from(list(BLOB_OF))  # the fuzzer's and team-a's chunks and page blobs
        asked = data.draw(st.one_of(st.lists(real, max_size=8), st.lists(real, max_size=8),
                                    st.lists(st.one_of(real, keys), max_size=8)))
        request: Any = pb.LoadChunksRequest(namespace=ns, keys=asked, into=memory)
        method = "LoadChunks"
    else:
        sid = data.draw(st.one_of(st.sampled_from(["f1", "fp1", "a1", "ap1"]), session_ids))
        request, method = pb.LoadSessionRequest(namespace=ns, session_id=sid, into=memory), "LoadSession"
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        answers = list(getattr(target.stub, method)(request, timeout=60, metadata=metadata))
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        answers, code = [], e.code()  # type: ignore[attr-defined]
        assert code not in BAD_CODES, (target.transport, method, request, code, e.details())  # type: ignore[attr-defined]
    target.count(f"{method} into caller memory", code)
    placed = bytearray(BUFFER)  # 1 where the answer says a blob was written
    buf = bytes(g.view())
    for a in answers:
        chunks = a if method == "LoadChunks" else a.chunks
        if method == "LoadSession" and a.HasField("session"):
            order = list(a.session.chunk_keys)
        h = chunks.shm
        if not h.caller_memory:  # a message of the stream (the manifest's): nothing written for it
            continue
        for i, o, n in zip(h.indices, h.offsets, h.sizes):
            key = bytes(request.keys[i]) if method == "LoadChunks" else order[i]
            at = address + o - g.address
            assert at >= 0 and at + n <= BUFFER and o + n <= size, ("written outside the named range", o, n)
            assert OWNER.get(key) in COVERS.get(token or "", set()) and OWNER.get(key) == ns, "a cross-tenant read"
            assert buf[at : at + n] == BLOB_OF[key], "a blob other than the key's"
            placed[at : at + n] = b"\x01" * n
            target.count("caller memory: blobs written, checked in place", "blob")
    stray = np.flatnonzero((np.frombuffer(placed, np.uint8) == 0) & (np.frombuffer(buf, np.uint8) != Guarded.CANARY))
    assert not stray.size, f"{stray.size} bytes written outside the blobs the answer names, first at {stray[0]}"
    target.count("caller memory: buffers checked, canary intact outside the blobs", "buffer")
