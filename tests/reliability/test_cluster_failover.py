"""Acknowledged saves across a master failover, on a real Redis Cluster of 3 masters with one
replica each, with the setting that loses nothing acknowledged: ``--redis-wait-replicas 1`` (every
write to Redis waits until the master's replica has it). A save that a replica cannot acknowledge
fails; an acknowledged save survives its master being SIGKILLed and its replica promoted."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator

import pytest

from kvstore.client import Client
from kvstore.errors import Unavailable
from kvstore.tiers.redis.keys import RedisKeys
from tests.helpers.cluster import RedisClusterProcess, cluster_flags, require_cluster, running_cluster
from tests.helpers.daemon import Daemon, make_session, two_daemons

require_cluster()

KEYS = RedisKeys("kvstore", tagged=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcess]:
    with running_cluster(tmp_path_factory.mktemp("cluster"), masters=3, replicas=1, appendonly=True) as c:
        yield c


@pytest.fixture(scope="module")
def daemons(cluster: RedisClusterProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    flags = cluster_flags(cluster.url, "--redis-wait-replicas", "1", "--redis-wait-timeout-ms", "300")
    with two_daemons(tmp_path_factory.mktemp("daemons"), *flags) as ab:
        yield ab


def client(d: Daemon) -> Client:
    return Client(address=d.address, shared_memory=False, timeout_s=30)


def test_a_save_no_replica_acknowledges_fails_and_its_retry_succeeds(cluster: RedisClusterProcess,
                                                                      daemons: tuple[Daemon, Daemon]) -> None:
    ns = f"t-{uuid.uuid4().hex[:10]}"
    s = make_session(namespace=ns, session_id="paused", tokens=1000, seed=40)
    replica = cluster.replica_of(cluster.master_of(KEYS.record(ns, "paused")))
    cluster.signal(replica, signal.SIGSTOP)  # the replica hangs: its master cannot be acknowledged
    try:
        with client(daemons[0]) as a, pytest.raises(Unavailable, match="replicas acknowledge the write"):
            a.save_session(s.manifest, s.blobs)
    finally:
        cluster.signal(replica, signal.SIGCONT)
    cluster.wait_healthy()
    with client(daemons[0]) as a, client(daemons[1]) as b:
        a.save_session(s.manifest, s.blobs)  # its own unacknowledged version does not block it
        m, chunks = b.load_session(ns, "paused")
        assert m.chunk_keys == tuple(s.keys) and {i: bytes(c) for i, c in chunks} == dict(enumerate(s.blobs))


def test_an_acknowledged_save_survives_its_master_failing_over(cluster: RedisClusterProcess,
                                                               daemons: tuple[Daemon, Daemon]) -> None:
    ns = f"t-{uuid.uuid4().hex[:10]}"
    s = make_session(namespace=ns, session_id="failover", tokens=2000, seed=41)
    master = cluster.master_of(KEYS.record(ns, "failover"))
    replica = cluster.replica_of(master)
    with client(daemons[0]) as a:
        a.save_session(s.manifest, s.blobs)
    cluster.signal(master, signal.SIGKILL)  # right after the acknowledgement
    cluster.wait_for_failover(replica)
    assert cluster.master_of(KEYS.record(ns, "failover")) == replica
    with client(daemons[1]) as b:
        assert [x.session_id for x in b.list_sessions(ns)] == ["failover"]
        m, chunks = b.load_session(ns, "failover")
        assert m.chunk_keys == tuple(s.keys) and m.tail == s.manifest.tail
        assert {i: bytes(c) for i, c in chunks} == dict(enumerate(s.blobs))
        # the promoted master has no replica yet: a save it would hold alone is refused, not risked
        s2 = make_session(namespace=ns, session_id="failover", tokens=2000, seed=42)
        with pytest.raises(Unavailable, match="0 of 1 replicas"):
            b.save_session(s2.manifest, s2.blobs)
