"""Resume-ahead prefetch (PrefetchSession, `kvstore prefetch`): a real daemon with a small host tier
promotes an evicted session back to host memory in the background; loads meanwhile stay bit-exact;
tenants cannot prefetch (or learn about) each other's sessions; and, in-process on a real store, the
worker's bounds: one session at a time, a waiting duplicate coalesced, a full queue dropped, a session
bigger than the fast tier promoted as far as it fits."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from kvstore.client import Client
from kvstore.client.aio import AsyncClient
from kvstore.store import SessionStore
from kvstore.store.sessions.prefetch import PrefetchConfig, Prefetcher
from tests.helpers.daemon import (
    REPO,
    Daemon,
    clean_env,
    kvstore_command,
    make_session,
    running_daemon,
    save_session,
    status_of,
)
from tests.helpers.store import build_session, make_tiered, save, store_config, token_stream

ADMIN, TOK_A, TOK_B = "tok-admin", "tok-a", "tok-b"
TOKENS = f'[tokens]\n"{ADMIN}" = ["*"]\n"{TOK_A}" = ["a"]\n"{TOK_B}" = ["b"]\n'
HOST_BYTES = 4 << 20  # ~70 chunks of tiny-16 at 256 tokens
WAIT_S = 60.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("prefetch")
    (tmp / "tokens.toml").write_text(TOKENS)
    with running_daemon(tmp / "data", "--tokens-file", str(tmp / "tokens.toml"),
                        "--host-capacity-bytes", str(HOST_BYTES)) as d:
        yield d


@pytest.fixture(scope="module")
def admin(daemon: Daemon) -> Iterator[Client]:
    with Client(address=daemon.address, token=ADMIN, shared_memory=False, timeout_s=30) as c:
        yield c


def sid() -> str:
    return f"s-{uuid.uuid4().hex[:10]}"


def wait_until(what: str, done: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    """Poll ``done`` until it holds (never a wall-clock assertion: ``timeout_s`` only ends a hang)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def wait_prefetched(c: Client, completed_before: int) -> None:
    """Until the daemon's prefetch worker has finished one more session and has none pending."""
    def done() -> bool:
        p = c.stats().prefetch
        return p.completed > completed_before and p.pending == 0
    wait_until("the prefetch to complete", done)


def kvstore(*args: str, daemon: Daemon, token: str) -> subprocess.CompletedProcess[str]:
    env = clean_env(KVSTORE_ADDRESS=daemon.address, KVSTORE_TOKEN=token)
    return subprocess.run([*kvstore_command(), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=WAIT_S)


def ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r.stdout


def blobs_of(items: object) -> dict[int, bytes]:
    return {i: bytes(b) for i, b in items}  # type: ignore[attr-defined]


def test_prefetch_brings_an_evicted_session_back_to_host(admin: Client) -> None:
    s = make_session(namespace="a", session_id=sid(), tokens=1000, seed=1)
    save_session(admin, s)
    assert admin.evict("a", s.session_id, "ssd") == 3
    assert admin.get_session("a", s.session_id)[1] == {"ssd": 3}
    before = admin.stats()
    r = admin.prefetch_session("a", s.session_id)
    assert (r.queued, r.already_fast, r.dropped, r.tier) == (3, 0, False, "host")
    wait_prefetched(admin, before.prefetch.completed)
    assert admin.get_session("a", s.session_id)[1] == {"host": 3}
    after = admin.stats()
    assert after.prefetch.requested == before.prefetch.requested + 1
    assert after.prefetch.chunks_promoted == before.prefetch.chunks_promoted + 3
    host = {t.name: t for t in after.tiers}["host"]
    assert host.promotions == {t.name: t for t in before.tiers}["host"].promotions + 3
    _, chunks = admin.load_session("a", s.session_id)
    assert blobs_of(chunks) == dict(enumerate(s.blobs))
    served = {t.name: t.hits for t in admin.stats().tiers}
    assert served["host"] == {t.name: t.hits for t in after.tiers}["host"] + 3  # the load read host memory
    # already in host memory: nothing to queue, and the client method answers how many were queued
    assert admin.prefetch("a", s.session_id) == 0
    assert admin.prefetch_session("a", s.session_id).already_fast == 3


def test_wait_prefetched_measures_the_promotion(daemon: Daemon, admin: Client) -> None:
    s = make_session(namespace="a", session_id=sid(), tokens=8 * 256, seed=6)
    save_session(admin, s)
    with Client(address=daemon.address, token=TOK_A, shared_memory=False, timeout_s=30) as a:
        assert a.wait_prefetched("a", s.session_id) is not None  # in host memory since its save
        admin.evict("a", s.session_id, "ssd")
        assert a.wait_prefetched("a", s.session_id, timeout_s=0.0) is None  # nothing asked it to move
        assert a.prefetch("a", s.session_id) == 8
        waited = a.wait_prefetched("a", s.session_id, timeout_s=WAIT_S)
        assert waited is not None and waited >= 0
        assert a.get_session("a", s.session_id)[1] == {"host": 8}


def test_the_async_client_prefetches(daemon: Daemon, admin: Client) -> None:
    s = make_session(namespace="a", session_id=sid(), tokens=600, seed=2)
    save_session(admin, s)
    admin.evict("a", s.session_id, "ssd")
    before = admin.stats().prefetch.completed

    async def go() -> int:
        async with AsyncClient(address=daemon.address, token=TOK_A, shared_memory=False) as c:
            return await c.prefetch("a", s.session_id)

    assert asyncio.run(go()) == 2
    wait_prefetched(admin, before)
    assert admin.get_session("a", s.session_id)[1] == {"host": 2}


def test_loads_during_a_prefetch_are_bit_exact(daemon: Daemon, admin: Client) -> None:
    """Loads racing the worker (stream and arena paths) read each chunk whole from one tier or the other."""
    s = make_session(namespace="a", session_id=sid(), tokens=20 * 256 + 7, seed=3)
    save_session(admin, s)
    want = dict(enumerate(s.blobs))
    with Client(address=daemon.address, token=TOK_A, shared_memory=False, timeout_s=30) as stream, \
            Client(address=daemon.address, token=TOK_A, arena_bytes=4 << 20, timeout_s=30) as arena, \
            ThreadPoolExecutor(4) as pool:
        for _ in range(4):
            assert admin.evict("a", s.session_id, "ssd") == 20
            before = admin.stats().prefetch.completed
            assert stream.prefetch("a", s.session_id) == 20
            loads = [pool.submit(lambda c=c: blobs_of(c.load_session("a", s.session_id)[1]))
                     for c in (stream, arena, stream, arena)]
            for f in loads:
                assert f.result() == want
            wait_prefetched(admin, before)
            assert admin.get_session("a", s.session_id)[1] == {"host": 20}


def test_another_tenants_session_is_not_found_like_an_absent_one(daemon: Daemon, admin: Client) -> None:
    b = make_session(namespace="b", session_id=sid(), tokens=600, seed=4)
    save_session(admin, b)
    admin.evict("b", b.session_id, "ssd")
    requested = admin.stats().prefetch.requested
    with Client(address=daemon.address, token=TOK_A, shared_memory=False, timeout_s=30) as a:
        # b's session id in a's namespace: exactly an absent id's answer
        code, text = status_of(lambda: a.prefetch("a", b.session_id))
        absent = f"x{b.session_id[1:]}"
        code2, text2 = status_of(lambda: a.prefetch("a", absent))
        assert code == code2 == grpc.StatusCode.NOT_FOUND
        assert text.replace(b.session_id, "ID") == text2.replace(absent, "ID")
        # b's namespace itself: refused by the token, as a load is
        assert status_of(lambda: a.prefetch("b", b.session_id))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert admin.stats().prefetch.requested == requested  # nothing was queued for them
    assert admin.get_session("b", b.session_id)[1] == {"ssd": 2}


@pytest.mark.parametrize(("ns", "session_id"), [("", "s1"), ("a/b", "s1"), ("a", ""), ("a", "-x"),
                                                ("a", "x" * 129), ("a", "s p")])
def test_bad_input_is_invalid_argument(admin: Client, ns: str, session_id: str) -> None:
    code, text = status_of(lambda: admin.prefetch(ns, session_id))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in text


def test_cli_prefetch_and_stats(daemon: Daemon, admin: Client) -> None:
    s = make_session(namespace="a", session_id=sid(), tokens=1000, seed=5)
    save_session(admin, s)
    admin.evict("a", s.session_id, "ssd")
    before = admin.stats().prefetch.completed
    out = ok(kvstore("prefetch", "a", s.session_id, daemon=daemon, token=TOK_A))
    assert out == f"prefetch of a/{s.session_id}: 3 chunks queued for host, 0 already there\n"
    wait_prefetched(admin, before)
    out = ok(kvstore("prefetch", "a", s.session_id, daemon=daemon, token=TOK_A))
    assert out == f"prefetch of a/{s.session_id}: 0 chunks queued for host, 3 already there\n"
    r = kvstore("prefetch", "a", "nope", daemon=daemon, token=TOK_A)
    assert r.returncode != 0 and "no session 'nope'" in r.stderr and len(r.stderr.splitlines()) == 1
    assert "prefetch: " in ok(kvstore("stats", daemon=daemon, token=ADMIN))


# -- the worker's bounds, in-process on a real store ---------------------------------------------
@pytest.fixture
def store(tmp_path: Path) -> Iterator[SessionStore]:
    config = store_config(tmp_path)
    sessions = SessionStore(make_tiered(config), config)
    yield sessions
    sessions.close()


def _evicted(store: SessionStore, session_id: str, chunks: int, seed: int) -> list[bytes]:
    s = build_session("n", session_id, token_stream(seed, chunks * 16 + 3))
    save(store, s)
    store.evict("n", session_id, "ssd")
    return list(s.keys)


def test_one_worker_coalesces_and_drops_past_its_bound(store: SessionStore) -> None:
    for i in range(3):
        _evicted(store, f"s{i}", 4, seed=i)
    gate, entered = threading.Event(), threading.Event()
    real = store.store.prefetch

    def held(keys: Sequence[bytes], verify: Callable[..., Sequence[bool]]) -> list[bool | None]:  # waits for the gate
        entered.set()
        gate.wait(WAIT_S)
        return real(keys, verify)

    store.store.prefetch = held  # type: ignore[method-assign]
    p = Prefetcher(store, PrefetchConfig(max_pending=2))
    assert p.request("n", "s0").dropped  # not started: nothing would run it
    p.start()
    try:
        assert p.request("n", "s0").queued == 4
        entered.wait(WAIT_S)  # the worker holds s0 (busy): one place left
        a1, a2, a3 = p.request("n", "s1"), p.request("n", "s1"), p.request("n", "s2")
        assert (a1.queued, a1.coalesced, a2.queued, a2.coalesced) == (4, False, 4, True)
        assert a3.dropped and a3.queued == 0
        gate.set()
        wait_until("both sessions promoted", lambda: p.counters().completed == 2 and p.counters().pending == 0)
        c = p.counters()
        assert (c.requested, c.coalesced, c.dropped, c.chunks_promoted, c.chunks_skipped) == (5, 1, 2, 8, 0)
        assert all(store.store.where(k)[0] == "host" for i in (0, 1) for k in store.session_chunks("n", f"s{i}"))
    finally:
        gate.set()
        p.stop()


def test_a_session_bigger_than_the_fast_tier_is_promoted_as_far_as_it_fits(tmp_path: Path) -> None:
    config = store_config(tmp_path, host_capacity=5 * 2500)  # 5 chunks of tiny-8 at 16 tokens (~2.4 KB)
    sessions = SessionStore(make_tiered(config), config)
    p = Prefetcher(sessions)
    p.start()
    try:
        keys = _evicted(sessions, "big", 12, seed=7)
        assert p.request("n", "big").queued == 12
        wait_until("the prefetch", lambda: p.counters().completed == 1)
        c = p.counters()
        assert c.chunks_promoted == 5 and c.chunks_skipped == 7
        assert [sessions.store.where(k)[0] for k in keys] == ["host"] * 5 + ["ssd"] * 7  # the first ones
        assert all("ssd" in sessions.store.where(k) for k in keys)  # the durable copies stay
    finally:
        p.stop()
        sessions.close()
