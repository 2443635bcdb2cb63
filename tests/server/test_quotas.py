"""Per-namespace quotas (docs/CONFIG.md, "Quotas"), on a real daemon with a small host tier and a real
LMDB: a noisy tenant saving and prefetching in a loop cannot move a quiet tenant's session out of the
host tier while the quiet one is within its share, and is refused (RESOURCE_EXHAUSTED naming the
namespace and the quota) past its ssd share without losing anything stored; usage per namespace in
Stats, the metrics and `kvstore stats`, each tenant seeing only its own; bad quotas refused at start;
and the prefetch queue served fairly."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvstore.client import Client
from kvstore.errors import ResourceExhausted
from kvstore.server.auth import load_quotas
from kvstore.server.startup import CannotStart
from kvstore.store import SessionStore
from kvstore.store.quotas import Quota
from kvstore.store.sessions.prefetch import PrefetchConfig, Prefetcher
from tests.helpers.daemon import (
    REPO,
    Daemon,
    clean_env,
    free_port,
    kvstore_command,
    make_session,
    running_daemon,
    save_session,
    status_of,
)
from tests.helpers.store import build_session, make_tiered, save, store_config, token_stream

HOST_BYTES = 4 << 20  # ~70 chunks of tiny-16 at 256 tokens
QUIET_HOST, NOISY_HOST, NOISY_SSD = 3 << 19, 2 << 20, 8 << 20
TOKENS = f"""
[tokens]
"tok-admin" = ["*"]
"tok-quiet" = ["quiet"]
"tok-noisy" = ["noisy"]

[quotas.quiet]
host_bytes = {QUIET_HOST}
sessions = 4

[quotas.noisy]
host_bytes = {NOISY_HOST}
ssd_bytes = {NOISY_SSD}
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, int]]:
    tmp = tmp_path_factory.mktemp("quotas")
    (tmp / "tokens.toml").write_text(TOKENS)
    port = free_port()
    with running_daemon(tmp / "data", "--tokens-file", str(tmp / "tokens.toml"), "--metrics-port", str(port),
                        "--host-capacity-bytes", str(HOST_BYTES)) as d:
        yield d, port


def client(d: Daemon, token: str) -> Client:
    return Client(address=d.address, token=token, shared_memory=False, timeout_s=60)


def usage(c: Client, namespace: str) -> object:
    return next(u for u in c.namespace_stats() if u.namespace == namespace)


def test_a_noisy_tenant_cannot_evict_a_quiet_one_nor_fill_the_disk(daemon: tuple[Daemon, int]) -> None:
    d, _ = daemon
    with client(d, "tok-quiet") as quiet, client(d, "tok-noisy") as noisy, client(d, "tok-admin") as admin:
        q = make_session(namespace="quiet", session_id="q1", tokens=4000, seed=7)
        save_session(quiet, q)
        chunks = len(q.blobs)
        assert admin.get_session("quiet", "q1")[1] == {"host": chunks}
        saved, refused = [], ""
        for i in range(400):  # far past what the host tier and the noisy tenant's ssd share hold
            s = make_session(namespace="noisy", session_id=f"n{i}", tokens=2000, seed=1000 + i)
            try:
                save_session(noisy, s)
            except ResourceExhausted as e:
                refused = str(e)
                break
            saved.append(s)
            for old in saved[-4:]:  # and prefetching its earlier sessions back up, in a loop
                noisy.prefetch_session("noisy", old.session_id)
        assert refused, "the noisy tenant was never refused: its ssd quota is not enforced"
        assert "'noisy'" in refused and "ssd" in refused and str(NOISY_SSD) in refused, refused
        deadline = time.monotonic() + 60
        while admin.stats().prefetch.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        # the quiet session never left the host tier
        assert admin.get_session("quiet", "q1")[1] == {"host": chunks}
        u = usage(admin, "noisy")
        assert u.ssd_bytes <= NOISY_SSD and u.host_bytes <= NOISY_HOST, u
        assert u.has_ssd_quota and u.ssd_quota == NOISY_SSD
        # the noisy tenant pushed only itself down, and lost nothing it had stored
        assert {t.name: t for t in admin.stats().tiers}["host"].used_bytes <= HOST_BYTES
        for s in saved[:2] + saved[-2:]:
            _, got = noisy.load_session("noisy", s.session_id)
            assert {i: bytes(b) for i, b in got} == dict(enumerate(s.blobs))
        _, got = quiet.load_session("quiet", "q1")
        assert {i: bytes(b) for i, b in got} == dict(enumerate(q.blobs))
        # deleting sessions makes room: the refused save goes through again
        for s in saved[:3]:
            noisy.delete_session("noisy", s.session_id)
        save_session(noisy, make_session(namespace="noisy", session_id="again", tokens=2000, seed=999))


def test_a_sessions_quota_refuses_a_new_session_not_a_new_turn(daemon: tuple[Daemon, int]) -> None:
    d, _ = daemon
    with client(d, "tok-quiet") as quiet:
        have = usage(quiet, "quiet").sessions
        for i in range(4 - have):
            save_session(quiet, make_session(namespace="quiet", session_id=f"extra{i}", tokens=300, seed=50 + i))
        code, message = status_of(lambda: save_session(quiet, make_session(namespace="quiet", session_id="one-more",
                                                                            tokens=300, seed=90)))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "'quiet'" in message and "sessions" in message
        assert "4" in message
        assert usage(quiet, "quiet").sessions == 4
        assert [s.session_id for s in quiet.list_sessions("quiet")].count("one-more") == 0
        # a session already there saves again (a new turn)
        save_session(quiet, make_session(namespace="quiet", session_id="extra0", tokens=600, seed=50))
        for i in range(4 - have):
            quiet.delete_session("quiet", f"extra{i}")


def test_usage_per_namespace_in_stats_metrics_and_cli_each_tenant_its_own(daemon: tuple[Daemon, int]) -> None:
    d, port = daemon
    with client(d, "tok-admin") as admin, client(d, "tok-quiet") as quiet:
        save_session(quiet, make_session(namespace="quiet", session_id="shown", tokens=600, seed=3))
        every = {u.namespace: u for u in admin.stats().namespaces}
        assert {"quiet", "noisy"} <= set(every)
        assert every["quiet"].host_bytes > 0 and every["quiet"].ssd_bytes > 0 and every["quiet"].sessions >= 1
        assert every["quiet"].has_host_quota and every["quiet"].host_quota == QUIET_HOST
        assert not every["quiet"].has_ssd_quota
        assert {u.namespace for u in admin.namespace_stats()} == set(every)
        mine = quiet.namespace_stats()
        assert [u.namespace for u in mine] == ["quiet"]
        assert mine[0].ssd_bytes == every["quiet"].ssd_bytes
        assert status_of(lambda: quiet.namespace_stats("noisy"))[0] == grpc.StatusCode.PERMISSION_DENIED
        assert status_of(quiet.stats)[0] == grpc.StatusCode.PERMISSION_DENIED
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'kvstore_namespace_bytes{namespace="quiet",tier="host"}' in text
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines['kvstore_namespace_quota_bytes{namespace="noisy",tier="ssd"}']) == NOISY_SSD
    assert 'kvstore_namespace_quota_bytes{namespace="quiet",tier="ssd"}' not in text  # unlimited: absent
    assert 'kvstore_namespace_quota_sessions{namespace="quiet"} 4.0' in text
    for token, shown, hidden in (("tok-quiet", "quiet", "noisy"), ("tok-admin", "noisy", None)):
        env = clean_env(KVSTORE_ADDRESS=d.address, KVSTORE_TOKEN=token)
        r = subprocess.run([*kvstore_command(), "stats"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        assert shown in r.stdout and (hidden is None or hidden not in r.stdout), r.stdout


@pytest.mark.parametrize(("table", "why"), [
    ("[quotas.team-a]\nhost_bytes = -1\n", "'team-a'] host_bytes: must be a non-negative integer"),
    ("[quotas.team-a]\nssd_byte = 5\n", "'team-a'] ssd_byte: not a quota"),
    ('[quotas."no such ns"]\nssd_bytes = 5\n', "no such ns"),
    ("[quotas.team-a]\nsessions = \"ten\"\n", "'team-a'] sessions: must be a non-negative integer"),
    ("[quotas]\nteam-a = 5\n", "'team-a']: must be a table"),
])
def test_bad_quotas_are_refused_at_start_naming_the_namespace_and_field(tmp_path: Path, table: str, why: str) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(f'[tokens]\n"tok-a" = ["team-a"]\n{table}')
    with pytest.raises(CannotStart, match=f"tokens file {path}") as e:
        load_quotas(str(path))
    assert why in str(e.value), str(e.value)


def test_quotas_parse_with_a_default_for_every_other_namespace(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text('[tokens]\n"t" = ["a"]\n[quotas.a]\nssd_bytes = 10\n[quotas."*"]\nhost_bytes = 5\n')
    q = load_quotas(str(path))
    assert q.of("a") == Quota(ssd_bytes=10) and q.of("zzz") == Quota(host_bytes=5)
    assert q.shares("host") and q.shares("ssd") and load_quotas("").enabled is False


def test_the_prefetch_queue_is_served_round_robin_with_a_cap_per_namespace(tmp_path: Path) -> None:
    """One namespace's prefetches in a loop: at most its cap waits, and another namespace's request
    is served after at most one of them, not after all."""
    config = store_config(tmp_path, host_capacity=64 << 20)
    sessions = SessionStore(make_tiered(config), config)
    for i in range(6):
        save(sessions, build_session("noisy", f"n{i}", token_stream(i, 16 * 4 + 3)))
    save(sessions, build_session("quiet", "q", token_stream(99, 16 * 4 + 3)))
    for ns, sid in [*(("noisy", f"n{i}") for i in range(6)), ("quiet", "q")]:
        sessions.evict(ns, sid, "ssd")
    order: list[str] = []
    p = Prefetcher(sessions, PrefetchConfig(max_pending=64, max_pending_per_namespace=3))
    real = p._promote

    def promote(namespace: str, session_id: str) -> tuple[int, int]:
        order.append(session_id)
        return real(namespace, session_id)

    p._promote = promote  # type: ignore[method-assign]
    p.start()
    sessions.store.run_behind(lambda: time.sleep(0.5))  # the worker busy: requests queue up behind it
    answers = [p.request("noisy", f"n{i}") for i in range(6)]
    assert [a.dropped for a in answers] == [False] * 3 + [True] * 3
    assert not p.request("quiet", "q").dropped
    sessions.store.settle()
    assert order == ["n0", "q", "n1", "n2"], order
    sessions.close()


WB_SSD, RE_SSD = 2 << 20, 1 << 20
WB_TOKENS = f"""
[tokens]
"tok-admin" = ["*"]
"tok-wb" = ["wb"]
"tok-re" = ["re"]

[quotas.wb]
ssd_bytes = {WB_SSD}

[quotas.re]
ssd_bytes = {RE_SSD}
"""


@pytest.fixture(scope="module")
def write_back(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon in write-back mode: saved chunks stay in the (large) host tier until a commit names them."""
    tmp = tmp_path_factory.mktemp("quotas-wb")
    (tmp / "tokens.toml").write_text(WB_TOKENS)
    with running_daemon(tmp / "data", "--tokens-file", str(tmp / "tokens.toml"), "--store-write-mode", "back") as d:
        yield d


def test_write_back_chunks_not_yet_flushed_count_toward_the_ssd_quota(write_back: Daemon) -> None:
    """Chunks saved (SaveChunks) in write-back mode and never committed are in the host tier only: they
    count toward the ssd quota all the same, so a backlog of them cannot take a tenant past it."""
    with client(write_back, "tok-wb") as wb:
        sent, refused = 0, ""
        for i in range(40):  # ~17 MiB, far past the quota
            s = make_session(namespace="wb", session_id=f"w{i}", tokens=2000, seed=300 + i)
            try:
                wb.save_chunks("wb", s.layout.layout_id, b"\0" * 16, 0, s.blobs)
            except ResourceExhausted as e:
                refused = str(e)
                break
            sent += sum(len(b) for b in s.blobs)
        assert refused, "the write-back backlog was never refused: it is not counted toward the ssd quota"
        assert "'wb'" in refused and "ssd" in refused and str(WB_SSD) in refused, refused
        u = usage(wb, "wb")
        assert sent == u.ssd_bytes <= WB_SSD, (sent, u)
        assert u.sessions == 0


def test_a_whole_save_at_the_ssd_quota_is_checked_by_what_it_frees(write_back: Daemon) -> None:
    """A tenant at its ssd quota re-saves its session shorter, every chunk new: the chunks only the old
    version used go in the same commit, so it fits; a version that grows past the quota does not."""
    first = make_session(namespace="re", session_id="r", tokens=4000, seed=400)  # 15 chunks
    shorter = make_session(namespace="re", session_id="r", tokens=3000, seed=401)
    longer = make_session(namespace="re", session_id="r", tokens=8000, seed=402)
    with client(write_back, "tok-re") as re:
        save_session(re, first)
        held = usage(re, "re").ssd_bytes
        assert held <= RE_SSD < held + sum(len(b) for b in shorter.blobs)  # the gross check would refuse it
        save_session(re, shorter)
        assert re.get_session("re", "r")[0].chunk_keys == tuple(shorter.keys)
        assert usage(re, "re").ssd_bytes < held
        code, message = status_of(lambda: save_session(re, longer))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "'re'" in message and str(RE_SSD) in message, message
        assert "freed by the version it replaces" in message
        assert re.get_session("re", "r")[0].chunk_keys == tuple(shorter.keys)
