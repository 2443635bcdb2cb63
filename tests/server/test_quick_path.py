"""Ownership before speed (issue 27, item 2): whether a load takes the quick path (run on gRPC's event
loop when the memory tier holds its chunks) depends on the caller's own data only. Tenant B naming
tenant A's chunk, cached in memory, takes the path of a made-up key, and the memory tier is never
even asked about it: the ownership check comes first. (It once came after: B's LoadChunks of A's
cached key answered 100-250 us faster than for a made-up key, telling B which prompts A used
recently. benchmarks/reliability/bench_timing_oracle.py measures the timing; this checks the path.)"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from kvstore.server.auth import Auth
from kvstore.server.handlers import Call, methods
from kvstore.server.service import KVStoreService
from kvstore.store import SessionStore
from kvstore.v1 import kvstore_pb2 as pb
from tests.helpers.store import build_session, save, token_stream

CALL_A, CALL_B = (Call((("authorization", f"Bearer {t}"),)) for t in ("tok-a", "tok-b"))


def _quick(sessions: SessionStore, name: str) -> Callable[[Any, Call], bool]:
    service = KVStoreService(sessions, Auth({"tok-a": ["team-a"], "tok-b": ["team-b"]}), None)
    quick = methods(service)[f"/kvstore.v1.KVStore/{name}"].quick
    assert quick is not None
    return quick


def _asked(sessions: SessionStore, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every key the memory tier is asked the size of (the quick-path test's one question to a tier)."""
    fast, asked = sessions.store.tiers[0], []
    size_of = fast.size_of
    monkeypatch.setattr(fast, "size_of", lambda k: asked.append(bytes(k)) or size_of(k))
    return asked


def test_another_namespaces_cached_chunk_takes_the_path_of_a_made_up_key(
        sessions: SessionStore, monkeypatch: pytest.MonkeyPatch) -> None:
    a = build_session("team-a", "a1", token_stream(1, 50))
    save(sessions, a)
    quick, asked = _quick(sessions, "LoadChunks"), _asked(sessions, monkeypatch)
    assert sessions.lookup_keys("team-a", a.keys) == ["host"] * len(a.keys)
    assert quick(pb.LoadChunksRequest(namespace="team-a", keys=a.keys), CALL_A)  # A's own: quick
    asked.clear()
    for keys in ([k] for k in (*a.keys, os.urandom(16), os.urandom(16))):
        assert not quick(pb.LoadChunksRequest(namespace="team-b", keys=keys), CALL_B)
    # a mix of B's nothing and A's chunks: the same
    assert not quick(pb.LoadChunksRequest(namespace="team-b", keys=[os.urandom(16), *a.keys]), CALL_B)
    assert asked == [], "the memory tier was asked about a key the caller's namespace does not own"


def test_own_chunks_mixed_with_anothers_are_not_quick_either(
        sessions: SessionStore, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = build_session("team-a", "a1", token_stream(1, 50)), build_session("team-b", "b1", token_stream(2, 50))
    save(sessions, a)
    save(sessions, b)
    quick = _quick(sessions, "LoadChunks")
    assert quick(pb.LoadChunksRequest(namespace="team-b", keys=b.keys), CALL_B)
    for other in (a.keys[0], os.urandom(16)):  # A's cached chunk, or a made-up key: one answer
        assert not quick(pb.LoadChunksRequest(namespace="team-b", keys=[*b.keys, other]), CALL_B)


def test_a_request_that_will_be_refused_is_never_quick_and_asks_no_tier(
        sessions: SessionStore, monkeypatch: pytest.MonkeyPatch) -> None:
    a = build_session("team-a", "a1", token_stream(1, 50))
    save(sessions, a)
    quick, asked = _quick(sessions, "LoadChunks"), _asked(sessions, monkeypatch)
    for bad in (b"", b"x" * 17, b"x" * 65536):  # once: ValueError from the tier's key check, INTERNAL
        assert not quick(pb.LoadChunksRequest(namespace="team-a", keys=[*a.keys, bad]), CALL_A)
    assert not quick(pb.LoadChunksRequest(namespace="team-b", keys=a.keys), CALL_A)  # not A's namespace
    assert asked == []
