"""Sessions across daemons through a real 3-master Redis Cluster: saved through daemon A, listed by
and resumed through daemon B (bit-exact), continued there, raced from both (one wins, whole), kept
apart per tenant, and resumed after A is SIGKILLed right after acknowledging a save."""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from kvstore.client import Client
from kvstore.errors import FailedPrecondition, NotFound
from kvstore.tiers.redis.keys import RedisKeys
from tests.helpers.cluster import RedisClusterProcess, cluster_flags, require_cluster, running_cluster
from tests.helpers.daemon import Daemon, SyntheticSession, make_session, start_daemon, two_daemons

require_cluster()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcess]:
    with running_cluster(tmp_path_factory.mktemp("cluster"), masters=3) as c:
        yield c


@pytest.fixture(scope="module")
def daemons(cluster: RedisClusterProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    with two_daemons(tmp_path_factory.mktemp("daemons"), *cluster_flags(cluster.url)) as ab:
        yield ab


@pytest.fixture(scope="module")
def clients(daemons: tuple[Daemon, Daemon]) -> Iterator[tuple[Client, Client]]:
    with Client(address=daemons[0].address, shared_memory=False, timeout_s=30) as a, \
            Client(address=daemons[1].address, shared_memory=False, timeout_s=30) as b:
        yield a, b


@pytest.fixture
def ns() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def two_turns(ns: str, sid: str, seed: int) -> tuple[SyntheticSession, SyntheticSession]:
    """A session of 1000 tokens and its continuation to 1800 (the same first 3 chunks)."""
    ids = np.random.default_rng(seed).integers(0, 50_000, 1800)
    return (make_session(namespace=ns, session_id=sid, token_ids=ids[:1000], seed=seed),
            make_session(namespace=ns, session_id=sid, token_ids=ids, seed=seed))


def loaded(c: Client, ns: str, sid: str) -> tuple[tuple[bytes, ...], bytes, dict[int, bytes]]:
    m, chunks = c.load_session(ns, sid)
    return m.chunk_keys, m.tail, {i: bytes(b) for i, b in chunks}


def test_saved_through_a_listed_and_resumed_through_b(clients: tuple[Client, Client], ns: str) -> None:
    a, b = clients
    s, _ = two_turns(ns, "chat", seed=1)
    a.save_session(s.manifest, s.blobs)
    assert [x.session_id for x in b.list_sessions(ns)] == ["chat"]
    assert b.get_session(ns, "chat")[1] == {"redis": 3}  # B holds none of it: only the cluster does
    assert loaded(b, ns, "chat") == (tuple(s.keys), s.manifest.tail, dict(enumerate(s.blobs)))
    lookup = b.lookup(ns, s.layout.layout_id, [int(t) for t in s.token_ids])
    assert lookup.chunks == 3


def test_b_continues_the_session_and_a_resumes_b_s_version(clients: tuple[Client, Client], ns: str) -> None:
    a, b = clients
    t1, t2 = two_turns(ns, "chat", seed=2)
    a.save_session(t1.manifest, t1.blobs)
    b.get_session(ns, "chat")  # B resumes it ...
    b.save_session(t2.manifest, t2.blobs[3:])  # ... and saves the next turn: only its new chunks
    assert loaded(a, ns, "chat") == (tuple(t2.keys), t2.manifest.tail, dict(enumerate(t2.blobs)))
    assert a.get_session(ns, "chat")[0].token_count == 1800


def race(clients: tuple[Client, Client], sessions: list[SyntheticSession]) -> list[FailedPrecondition | None]:
    """Save ``sessions[i]`` through ``clients[i]`` at once; each one's FailedPrecondition or None."""
    start = threading.Barrier(2)
    failed: list[FailedPrecondition | None] = [None, None]

    def save(i: int) -> None:
        start.wait()
        try:
            clients[i].save_session(sessions[i].manifest, sessions[i].blobs)
        except FailedPrecondition as e:
            failed[i] = e

    threads = [threading.Thread(target=save, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failed


def test_concurrent_saves_from_two_daemons_one_wins_whole(clients: tuple[Client, Client], ns: str) -> None:
    for round_ in range(4):
        sid = f"race-{round_}"
        seeds = [10 + 2 * round_ + i for i in range(2)]
        sessions = [two_turns(ns, sid, seed)[0] for seed in seeds]
        failed = race(clients, sessions)
        assert sum(e is not None for e in failed) == 1, failed
        loser = 0 if failed[0] is not None else 1
        assert "was changed through another daemon" in str(failed[loser])
        won = sessions[1 - loser]
        for c in clients:  # both daemons serve the winner's version, whole
            assert loaded(c, ns, sid) == (tuple(won.keys), won.manifest.tail, dict(enumerate(won.blobs)))
    # the loser, having resumed the winner's version, saves the next turn
    _, t2 = two_turns(ns, sid, seeds[1 - loser])
    clients[loser].save_session(t2.manifest, t2.blobs[3:])
    assert loaded(clients[1 - loser], ns, sid)[0] == tuple(t2.keys)


def test_tenants_stay_apart_and_damaged_shared_chunks_are_misses(cluster: RedisClusterProcess,
                                                                 clients: tuple[Client, Client]) -> None:
    a, b = clients
    mine, other = f"t-{uuid.uuid4().hex[:10]}", f"t-{uuid.uuid4().hex[:10]}"
    s, _ = two_turns(mine, "private", seed=20)
    a.save_session(s.manifest, s.blobs)
    assert b.list_sessions(other) == []
    with pytest.raises(NotFound):
        b.get_session(other, "private")
    assert list(b.load_chunks(other, s.keys)) == []  # another tenant's chunks answer as absent
    # a chunk overwritten in the cluster by another chunk's bytes is a miss, never served
    keys = RedisKeys("kvstore", tagged=True)
    raw = redis.RedisCluster.from_url(cluster.url)
    raw.set(keys.value(s.keys[1]), s.blobs[2])
    raw.close()
    assert {i for i, _ in b.load_chunks(mine, s.keys)} == {0, 2}


def test_daemon_killed_after_acknowledging_a_save_is_resumed_elsewhere(
        cluster: RedisClusterProcess, clients: tuple[Client, Client], tmp_path: Path, ns: str) -> None:
    victim = start_daemon(tmp_path / "victim", *cluster_flags(cluster.url))
    try:
        s, _ = two_turns(ns, "orphan", seed=30)
        with Client(address=victim.address, shared_memory=False, timeout_s=30) as c:
            c.save_session(s.manifest, s.blobs)
        victim.proc.kill()  # SIGKILL the moment the save was acknowledged
        victim.proc.wait()
    finally:
        victim.stop()
    assert loaded(clients[1], ns, "orphan") == (tuple(s.keys), s.manifest.tail, dict(enumerate(s.blobs)))


def test_turns_appended_through_a_are_read_by_b_turn_by_turn(cluster: RedisClusterProcess,
                                                              clients: tuple[Client, Client], ns: str) -> None:
    """A session grown by appends through A: each turn goes to the cluster as a turn record in the
    session's list (its tenant's slot, beside its base), and B reads every version exactly as A has it."""
    a, b = clients
    ids = np.random.default_rng(40).integers(0, 50_000, 12 * 300 + 7)
    turns = [make_session(namespace=ns, session_id="grown", token_ids=ids[: 300 * (t + 1) + 7], seed=40)
             for t in range(12)]
    keys = RedisKeys("kvstore", tagged=True)
    raw = redis.RedisCluster.from_url(cluster.url)
    lengths = []
    try:
        a.save_session(turns[0].manifest, turns[0].blobs)
        for prev, s in itertools.pairwise(turns):
            a.save_session(s.manifest, s.blobs[len(prev.keys):])
            lengths.append(raw.llen(keys.turns(ns, "grown")))
            assert b.get_session(ns, "grown")[0] == a.get_session(ns, "grown")[0]
        assert loaded(b, ns, "grown") == (tuple(turns[-1].keys), turns[-1].manifest.tail,
                                          dict(enumerate(turns[-1].blobs)))
        assert max(lengths) >= 1  # turns were appended (and compacted: the list emptied at times)
        slots = {raw.keyslot(k) for k in (keys.generations(ns), keys.record(ns, "grown"), keys.turns(ns, "grown"),
                                          keys.changes(ns))}
        assert len(slots) == 1
    finally:
        raw.close()
