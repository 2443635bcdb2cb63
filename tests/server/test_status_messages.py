"""Status messages quote what a request named, capped (server/status.py): a 100,000-character session
id once came back whole in the message, past a stock gRPC client's metadata limit, which then
reported RESOURCE_EXHAUSTED (in this API: the durable tier is full) instead of the real answer.
Checked with a default gRPC channel and over the local socket, for ids, namespaces, arena paths
and method paths; and a NUL byte in an arena path's directory is INVALID_ARGUMENT, not INTERNAL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest

from kvstore.client import Client
from kvstore.server.status import MAX_DETAILS_BYTES, capped
from kvstore.transport import local_channel
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers.daemon import Daemon, running_daemon

LONG = "x" * 100_000
# the cap, and the marker that says how much was cut
MOST = MAX_DETAILS_BYTES + 64


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("status") / "data") as d:
        yield d


@pytest.fixture(scope="module", params=["grpc", "local socket"])
def channel(request: pytest.FixtureRequest, daemon: Daemon) -> Iterator[object]:
    """A stock gRPC channel (default options: 8 KiB of metadata at most), or the local socket."""
    if request.param == "grpc":
        with grpc.insecure_channel(daemon.address) as ch:
            yield ch
        return
    with Client(address=daemon.address) as c:
        path = c.info().local_socket
    if not path:
        pytest.skip("no local socket here")
    ch = local_channel.LocalChannel(path)
    yield ch
    ch.close()


CALLS: dict[str, Callable[[pb_grpc.KVStoreStub], object]] = {
    "GetSession id": lambda s: s.GetSession(pb.GetSessionRequest(namespace="ns", session_id=LONG), timeout=30),
    "GetSession namespace": lambda s: s.GetSession(pb.GetSessionRequest(namespace=LONG, session_id="s"), timeout=30),
    "LoadSession id": lambda s: list(s.LoadSession(pb.LoadSessionRequest(namespace="ns", session_id=LONG),
                                                   timeout=30)),
    "DeleteSession id": lambda s: s.DeleteSession(pb.DeleteSessionRequest(namespace="ns", session_id=LONG),
                                                  timeout=30),
    "TouchSession id": lambda s: s.TouchSession(pb.TouchSessionRequest(namespace="ns", session_id=LONG), timeout=30),
    "EvictSession tier": lambda s: s.EvictSession(pb.EvictSessionRequest(namespace="ns", session_id="s",
                                                                          tier=LONG), timeout=30),
    "PrefetchSession id": lambda s: s.PrefetchSession(pb.PrefetchSessionRequest(namespace="ns", session_id=LONG),
                                                      timeout=30),
    "AttachArena path": lambda s: s.AttachArena(pb.AttachArenaRequest(path=f"/dev/shm/{LONG}", size=4096,
                                                                      nonce=bytes(16)), timeout=30),
    "AttachArena NUL in the directory": lambda s: s.AttachArena(pb.AttachArenaRequest(
        path=f"/dev/shm\0{LONG}/kvstore-cli-{'ab' * 16}", size=4096, nonce=bytes(16)), timeout=30),
}
EXPECTED = {"GetSession id": "INVALID_ARGUMENT", "GetSession namespace": "INVALID_ARGUMENT",
            "LoadSession id": "INVALID_ARGUMENT", "DeleteSession id": "INVALID_ARGUMENT",
            "TouchSession id": "INVALID_ARGUMENT", "EvictSession tier": "NOT_FOUND",
            "PrefetchSession id": "INVALID_ARGUMENT", "AttachArena path": "INVALID_ARGUMENT",
            "AttachArena NUL in the directory": "INVALID_ARGUMENT"}


def failure(fn: Callable[[], object]) -> tuple[str, str]:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""  # type: ignore[attr-defined]
    raise AssertionError("the call succeeded")


@pytest.mark.parametrize("name", list(CALLS))
def test_a_long_input_gets_its_own_status_with_a_capped_message(channel: object, daemon: Daemon, name: str) -> None:
    code, details = failure(lambda: CALLS[name](pb_grpc.KVStoreStub(channel)))
    assert code == EXPECTED[name], (code, details[:300])  # before the fix (gRPC): RESOURCE_EXHAUSTED
    assert 0 < len(details.encode()) <= MOST, len(details)
    assert "bytes, cut]" in details or len(details) < 300
    if "NUL" in name:
        assert "contains a NUL byte" in details
    assert "internal error" not in daemon.log() and "Traceback" not in daemon.log()


def test_a_long_method_path_over_the_local_socket(daemon: Daemon) -> None:
    with Client(address=daemon.address) as c:
        path = c.info().local_socket
    if not path:
        pytest.skip("no local socket here")
    ch = local_channel.LocalChannel(path)
    code, details = failure(lambda: ch.unary_unary("/" + "m" * 60_000, lambda b: b, lambda b: b)(b"", timeout=30))
    ch.close()
    assert code == "UNIMPLEMENTED" and len(details.encode()) <= MOST and details.startswith("no method /mmm")


def test_capped_keeps_head_and_tail_and_whole_characters() -> None:
    short = "no session 's1' in namespace 'ns'"
    assert capped(short) == short
    text = "no session '" + "é" * 5000 + "' in namespace 'team-a'"
    out = capped(text)
    assert len(out.encode()) <= MAX_DETAILS_BYTES
    assert out.startswith("no session 'é") and out.endswith("' in namespace 'team-a'")
    assert f"[{len(text.encode())} bytes, cut]" in out
    out.encode("utf-8")  # whole characters only: no half of a two-byte one at either cut
