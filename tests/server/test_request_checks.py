"""Every request is checked once, up front, before any body, auth check, quick-path test or tier sees it
(issue 27, item 4: ``kvstore/server/request_checks.py``): a key of the wrong length, too many keys, a
malformed name, retention or caller-memory range is INVALID_ARGUMENT naming the message, the field
and the key's index, the same on gRPC and on the local socket; nothing is logged as an internal
error and nothing stored changes. (A 0-byte or a 65,536-byte key in LoadChunks once reached the
memory tier over gRPC, through the quick-path test, and answered INTERNAL with a traceback.)"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from kvstore.client import Client
from kvstore.server.handlers import SERVICE
from kvstore.server.request_checks import CHECKS, MAX_KEYS
from kvstore.transport import local_channel
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers.daemon import Daemon, make_session, running_daemon, save_session

S = make_session(namespace="ns", session_id="s1", tokens=600, seed=27)
K = S.keys[0]
LAYOUT = S.layout.layout_id


def _session(**fields: Any) -> pb.Session:
    base = {"session_id": "s2", "namespace": "ns", "layout_id": LAYOUT, "chunk_keys": list(S.keys)}
    return pb.Session(**{**base, **fields})


def _save(header: pb.SaveHeader) -> list[pb.SaveChunksRequest]:
    return [pb.SaveChunksRequest(header=header, data=S.blobs[0])]


#: (method, request, the start of the status message)
CASES: list[tuple[str, Any, str]] = [
    ("LoadChunks", pb.LoadChunksRequest(namespace="ns", keys=[b""]), "LoadChunksRequest.keys[0] is 0 bytes long"),
    ("LoadChunks", pb.LoadChunksRequest(namespace="ns", keys=[K, b"x" * 65536]),
     "LoadChunksRequest.keys[1] is 65536 bytes long"),
    ("LoadChunks", pb.LoadChunksRequest(namespace="ns", keys=[K, K, b"x" * 300]),
     "LoadChunksRequest.keys[2] is 300 bytes long"),
    ("LoadChunks", pb.LoadChunksRequest(namespace="ns", keys=[K] * (MAX_KEYS + 1)),
     f"LoadChunksRequest.keys names {MAX_KEYS + 1} keys"),
    ("LoadChunks", pb.LoadChunksRequest(namespace="", keys=[K]), "LoadChunksRequest.namespace: malformed namespace"),
    ("LoadChunks", pb.LoadChunksRequest(namespace="ns", keys=[K], arena_id="a" * 300),
     "LoadChunksRequest.arena_id is 300 characters long"),
    ("LoadChunks", pb.LoadChunksRequest(namespace="ns", keys=[K], into=pb.CallerMemory(address=2**64 - 8, size=64)),
     "LoadChunksRequest.into runs past the end of the address space"),
    ("LoadSession", pb.LoadSessionRequest(namespace="ns", session_id="x" * 129),
     "LoadSessionRequest.session_id: malformed session id"),
    ("LoadSession", pb.LoadSessionRequest(namespace="ns", session_id="s1", into=pb.CallerMemory(address=4096)),
     "LoadSessionRequest.into needs an address and a size"),
    ("Lookup", pb.LookupRequest(namespace="ns", layout_id=b"abc", token_ids=[1, 2]),
     "LookupRequest.layout_id is 3 bytes long"),
    ("LookupKeys", pb.LookupKeysRequest(namespace="ns", keys=[K, K, K, b""]),
     "LookupKeysRequest.keys[3] is 0 bytes long"),
    ("LookupKeys", pb.LookupKeysRequest(namespace="ns", keys=[K] * (MAX_KEYS + 1)),
     f"LookupKeysRequest.keys names {MAX_KEYS + 1} keys"),
    ("SaveChunks", _save(pb.SaveHeader(namespace="ns", layout_id=LAYOUT[:8])),
     "SaveChunksRequest.header.layout_id is 8 bytes long"),
    ("SaveChunks", _save(pb.SaveHeader(namespace="ns", layout_id=LAYOUT, parent_key=b"short")),
     "SaveChunksRequest.header.parent_key (empty for chunk 0) is 5 bytes long"),
    ("SaveChunks", _save(pb.SaveHeader(namespace="ns", layout_id=LAYOUT, commit=_session(chunk_keys=[K, b"k"]))),
     "SaveChunksRequest.header.commit.chunk_keys[1] is 1 bytes long"),
    ("SaveChunks", _save(pb.SaveHeader(namespace="ns", layout_id=LAYOUT, commit=_session(namespace="other"))),
     "SaveChunksRequest.header.commit must name the header's namespace and layout"),
    ("CommitSession", pb.CommitSessionRequest(session=_session(chunk_keys=[b"x" * 65536])),
     "CommitSessionRequest.session.chunk_keys[0] is 65536 bytes long"),
    ("CommitSession", pb.CommitSessionRequest(session=_session(layout_id=b"")),
     "CommitSessionRequest.session.layout_id is 0 bytes long"),
    ("CommitSession", pb.CommitSessionRequest(session=_session(session_id="")),
     "CommitSessionRequest.session.session_id: malformed session id"),
    ("GetSession", pb.GetSessionRequest(namespace="a b", session_id="s1"), "GetSessionRequest.namespace: malformed"),
    ("DeleteSession", pb.DeleteSessionRequest(namespace="ns", session_id=""), "DeleteSessionRequest.session_id: "),
    ("TouchSession", pb.TouchSessionRequest(namespace="ns", session_id="s1", retention=pb.Retention(ttl_s=-1)),
     "TouchSessionRequest.retention.ttl_s must be a positive, finite number"),
    ("TouchSession", pb.TouchSessionRequest(namespace="ns", session_id="s1",
                                            retention=pb.Retention(ttl_s=float("nan"))),
     "TouchSessionRequest.retention.ttl_s must be a positive, finite number"),
    ("ListSessions", pb.ListSessionsRequest(namespace="../x"), "ListSessionsRequest.namespace: malformed"),
    ("EvictSession", pb.EvictSessionRequest(namespace="ns", session_id="s/../t", tier="ssd"),
     "EvictSessionRequest.session_id: malformed"),
    ("PrefetchSession", pb.PrefetchSessionRequest(namespace="x" * 65, session_id="s1"),
     "PrefetchSessionRequest.namespace: malformed"),
    ("RegisterLayout", pb.RegisterLayoutRequest(namespace="a/b", definition=b"{}"),
     "RegisterLayoutRequest.namespace: malformed"),
    ("DetachArena", pb.DetachArenaRequest(arena_id="a" * 129), "DetachArenaRequest.arena_id is 129 characters"),
    ("LoadSessionToDevice", pb.LoadSessionToDeviceRequest(namespace="ns", session_id="s1", buffer_id="b" * 200),
     "LoadSessionToDeviceRequest.buffer_id is 200 characters"),
]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("checks") / "data") as d:
        with Client(address=d.address) as c:
            save_session(c, S)
            assert len(list(c.load_chunks("ns", S.keys))) == len(S.keys)  # in the memory tier: quick on gRPC
        yield d


def _stored(d: Daemon) -> str:
    with Client(address=d.address, shared_memory=False) as c:
        m, chunks = c.load_session("ns", "s1")
        return hashlib.sha256(b"".join(bytes(b) for _, b in chunks) + bytes(m.tail)).hexdigest()


def _stubs(d: Daemon) -> Iterator[tuple[str, pb_grpc.KVStoreStub]]:
    with grpc.insecure_channel(d.address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        sock = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30).local_socket
        yield "grpc", stub
    assert sock, "the daemon serves no local socket"
    local = local_channel.LocalChannel(sock)
    try:
        yield "local socket", pb_grpc.KVStoreStub(local)
    finally:
        local.close()


def _invoke(stub: pb_grpc.KVStoreStub, method: str, request: Any) -> tuple[grpc.StatusCode, str]:
    fn: Callable[..., Any] = getattr(stub, method)
    try:
        if method == "SaveChunks":
            fn(iter(request), timeout=30)
        elif method in ("LoadChunks", "LoadSession"):
            list(fn(request, timeout=30))
        else:
            fn(request, timeout=30)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("method, request_, message", CASES,
                         ids=[f"{m}: {msg.split('.', 1)[1][:40]}" for m, _, msg in CASES])
def test_a_malformed_field_is_invalid_argument_naming_it_on_both_front_ends(
        daemon: Daemon, method: str, request_: Any, message: str) -> None:
    before = _stored(daemon)
    for transport, stub in _stubs(daemon):
        code, details = _invoke(stub, method, request_)
        assert (transport, code) == (transport, grpc.StatusCode.INVALID_ARGUMENT), details
        assert details.startswith(message), (transport, details)
    assert _stored(daemon) == before
    log = daemon.log()
    assert "internal error" not in log and "Traceback" not in log, log[-3000:]


def test_every_request_that_names_a_namespace_key_or_id_has_its_checks() -> None:
    """A new RPC (or one that grew such a field) cannot reach its body unchecked by forgetting CHECKS."""
    named = {"namespace", "keys", "session_id", "layout_id", "arena_id", "buffer_id", "header", "session"}
    for m in SERVICE.methods:
        cls = getattr(pb, m.input_type.name)
        if named & {f.name for f in m.input_type.fields}:
            assert cls in CHECKS, f"{m.name}: {m.input_type.name} has no entry in request_checks.CHECKS"


BAD_KEYS = [b"", b"x" * 65536]  # no tier can hold either (1 to 256 bytes): once they answered INTERNAL


@pytest.mark.parametrize("bad", BAD_KEYS, ids=["0 bytes", "65,536 bytes"])
def test_a_bad_key_beside_good_ones_is_invalid_argument_on_both_front_ends_wherever_they_sit(
        tmp_path_factory: pytest.TempPathFactory, bad: bytes) -> None:
    """Issue 28: LoadChunks naming a 0-byte or a 65,536-byte key after keys the memory tier holds (the quick
    path) and after keys only the ssd tier holds (the batch read) is INVALID_ARGUMENT naming that key, on gRPC
    and on the local socket, before any tier is asked; the session stored reads back as it was."""
    with running_daemon(tmp_path_factory.mktemp("bad-keys") / "data") as d:
        with Client(address=d.address) as c:
            save_session(c, S)
            before = _stored(d)
            for where in ("host", "ssd"):
                if where == "ssd":
                    assert c.evict("ns", "s1", "ssd") == len(S.keys)
                for transport, stub in _stubs(d):
                    request = pb.LoadChunksRequest(namespace="ns", keys=[*S.keys[:2], bad])
                    code, details = _invoke(stub, "LoadChunks", request)
                    assert (where, transport, code) == (where, transport, grpc.StatusCode.INVALID_ARGUMENT), details
                    assert details.startswith(f"LoadChunksRequest.keys[2] is {len(bad)} bytes long"), details
            assert _stored(d) == before
        log = d.log()
        assert "internal error" not in log and "Traceback" not in log, log[-3000:]
