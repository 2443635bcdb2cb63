"""Bearer tokens (per-namespace, admin scope) and the Prometheus endpoint, on a real daemon."""

from __future__ import annotations

import functools
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from kvstore.client import Client
from kvstore.format.keys import ROOT
from kvstore.format.layout import get_layout
from kvstore.format.manifest import Retention
from kvstore.server.auth import Auth
from kvstore.server.startup import CannotStart
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers.daemon import (
    REPO,
    Daemon,
    attach_arena,
    clean_env,
    free_port,
    make_session,
    running_daemon,
    save_session,
    serve_command,
    status_of,
)

TINY16 = get_layout("tiny-16")


# -- bearer tokens and metrics ---------------------------------------------------------------------------
TOKENS = """
[tokens]
"tok-a" = ["team-a"]
"tok-b" = ["team-b"]
"tok-admin" = ["*"]
"""


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, int]]:
    """A daemon with bearer tokens and metrics; team-a and team-b each hold one session."""
    tmp = tmp_path_factory.mktemp("secured")
    (tmp / "tokens.toml").write_text(TOKENS)
    metrics_port = free_port()
    with running_daemon(tmp / "data", "--tokens-file", str(tmp / "tokens.toml"),
                        "--metrics-port", str(metrics_port)) as d:
        with Client(address=d.address, token="tok-admin", arena_bytes=4 << 20) as admin:  # shm with a token
            save_session(admin, make_session(namespace="team-a", session_id="a1"))
            save_session(admin, make_session(namespace="team-b", session_id="b1", seed=1))
        yield d, metrics_port


def _reads(c: Client) -> list[Callable[[], object]]:
    return [lambda: c.list_sessions(""), lambda: c.get_session("team-a", "a1"), c.stats,
            lambda: c.lookup("team-a", TINY16.layout_id, [1] * 256)]


def test_missing_or_wrong_token_is_unauthenticated(secured: tuple[Daemon, int]) -> None:
    d, _ = secured
    for token, message in (("", "missing bearer token"), ("tok-nope", "unknown bearer token")):
        with Client(address=d.address, token=token, shared_memory=False) as c:
            for call in _reads(c):
                code, got = status_of(call)
                assert code == grpc.StatusCode.UNAUTHENTICATED and message in got


def test_a_bare_bearer_header_is_unauthenticated(secured: tuple[Daemon, int]) -> None:
    d, _ = secured
    with grpc.insecure_channel(d.address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        for header in ("Bearer ", "Bearer    "):
            code, got = status_of(lambda h=header: stub.ListSessions(  # type: ignore[misc]
                pb.ListSessionsRequest(), metadata=(("authorization", h),), timeout=30))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "missing bearer token" in got


@pytest.mark.parametrize("token", ["", "   "])
def test_a_tokens_file_with_an_empty_token_is_refused_at_start(tmp_path: Path, token: str) -> None:
    """`"" = ["tenant-b"]` would serve every request whose header is a bare `Bearer ` as tenant-b."""
    path = tmp_path / "tokens.toml"
    path.write_text(f'[tokens]\n"tok-a" = ["team-a"]\n"{token}" = ["tenant-b"]\n')
    done = subprocess.run(serve_command(tmp_path / "data", "--tokens-file", str(path)), cwd=REPO, env=clean_env(),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "kvstore serving on" not in done.stdout
    assert f"tokens file {path}" in done.stderr and "empty or blank" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("table", "why"), [
    ('"" = ["tenant-b"]', "empty or blank"),
    ('"\\t" = ["tenant-b"]', "empty or blank"),
    ('" tok-c" = ["team-c"]', "leading or trailing whitespace"),
    ('"tok-c" = ["team c"]', "malformed namespace"),
    ('"tok-c" = "team-c"', "token = [namespaces]"),
    ('"tok-c" = [1]', "list of namespaces"),
    ('"tok-c" = ["team-c"', "tokens file"),  # not TOML
])
def test_unusable_tokens_files_are_refused_naming_the_file(tmp_path: Path, table: str, why: str) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(f"[tokens]\n{table}\n")
    with pytest.raises(CannotStart, match=f"tokens file {path}") as e:
        Auth.from_file(str(path))
    assert why in str(e.value)
    assert "tok-c" not in str(e.value).replace(f"tokens file {path}", "")  # a secret is never echoed
    with pytest.raises(CannotStart, match="tokens file"):
        Auth.from_file(str(tmp_path / "missing.toml"))


def test_attaching_an_arena_needs_a_known_token(secured: tuple[Daemon, int]) -> None:
    d, _ = secured
    with grpc.insecure_channel(d.address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        for metadata, message in (((), "missing bearer token"),
                                  ((("authorization", "Bearer tok-nope"),), "unknown bearer token")):
            code, got = status_of(functools.partial(attach_arena, stub, metadata=metadata))
            assert code == grpc.StatusCode.UNAUTHENTICATED and message in got
        assert attach_arena(stub, metadata=(("authorization", "Bearer tok-a"),))  # any known token will do


def test_a_token_covers_only_its_namespaces(secured: tuple[Daemon, int]) -> None:
    d, _ = secured
    with Client(address=d.address, token="tok-a", shared_memory=False) as c:
        assert c.get_session("team-a", "a1")[0].token_count == 1000
        assert [(x.namespace, x.session_id) for x in c.list_sessions("")] == [("team-a", "a1")]
        denied: list[Callable[[], object]] = [
            lambda: c.get_session("team-b", "b1"), lambda: c.list_sessions("team-b"),
            lambda: c.delete_session("team-b", "b1"), lambda: c.load_session("team-b", "b1"),
            lambda: c.lookup("team-b", TINY16.layout_id, [1] * 256),
            lambda: c.touch_session("team-b", "b1", Retention(pinned=True)),
            lambda: c.save_chunks("team-b", TINY16.layout_id, ROOT, 0, []),
            lambda: c.get_session("team-b", "no-such-session"),  # no hint whether it exists
        ]
        for call in denied:
            code, message = status_of(call)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "team-b" in message
    with Client(address=d.address, token="tok-admin") as admin:
        assert [x.session_id for x in admin.list_sessions("")] == ["a1", "b1"]  # nothing was deleted


def test_admin_rpcs_need_the_admin_token(secured: tuple[Daemon, int]) -> None:
    d, _ = secured
    with Client(address=d.address, token="tok-admin") as admin:
        assert admin.stats().sessions == 2
    with Client(address=d.address, token="tok-a", shared_memory=False) as c:
        for call in (c.stats, lambda: c.evict("team-a", "a1", "ssd")):
            code, message = status_of(call)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "admin" in message


def test_metrics_endpoint(secured: tuple[Daemon, int]) -> None:
    _, port = secured
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'kvstore_tier_used_bytes{tier="ssd"}' in text
    assert "kvstore_sessions 2.0" in text


def test_metrics_count_every_rpc_with_its_code_latency_and_bytes(secured: tuple[Daemon, int]) -> None:
    """What Stats returns is on the metrics port too, plus what only the gRPC layer sees: calls by
    method and final code, their latency histogram, and message bytes in each direction."""
    d, port = secured
    with Client(address=d.address, token="tok-a", shared_memory=False) as c:
        c.load_session("team-a", "a1")
        c.get_session("team-a", "a1")
        assert status_of(lambda: c.get_session("team-a", "nope"))[0] == grpc.StatusCode.NOT_FOUND
    # a call is recorded when the server finishes it, which may be just after the client saw its status
    for _ in range(100):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        if 'kvstore_rpc_total{code="NOT_FOUND",method="GetSession"}' in lines:
            break
        time.sleep(0.05)

    def value(name: str) -> float:
        return float(lines[name])

    assert value('kvstore_rpc_total{code="NOT_FOUND",method="GetSession"}') >= 1
    assert value('kvstore_rpc_total{code="OK",method="GetSession"}') >= 1
    assert value('kvstore_rpc_duration_seconds_count{method="LoadSession"}') >= 1
    assert value('kvstore_rpc_message_bytes_total{direction="sent",method="LoadSession"}') > 10_000  # chunks streamed
    for name in ("kvstore_lookups_total", "kvstore_loaded_chunks_total", "kvstore_missed_chunks_total",
                 "kvstore_loads_total", 'kvstore_transport_calls_total{carrier="stream"}', "kvstore_transport_arenas"):
        assert name in lines, name
    assert value('kvstore_transport_calls_total{carrier="stream"}') >= 1
    # the ssd tier is unlimited here: no capacity and no fill ratio, never a used/0 = +Inf
    assert 'kvstore_tier_capacity_bytes{tier="host"}' in lines and 'kvstore_tier_fill_ratio{tier="host"}' in lines
    assert 'kvstore_tier_capacity_bytes{tier="ssd"}' not in lines and 'kvstore_tier_fill_ratio{tier="ssd"}' not in lines
