"""Health per part (grpc.health.v1, kvstore/server/health.py) with a Redis the daemon cannot reach: a
real daemon pointed at a closed port. A cache tier down leaves the daemon SERVING and its tier
NOT_SERVING; with --redis-share-sessions every save needs Redis, so the daemon is NOT_SERVING; the
start warns either way, `kvstore health` names the part and exits 1, and a Redis that comes up is
noticed without a restart."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import Client
from kvstore.errors import Unavailable
from tests.helpers.daemon import REPO, Daemon, clean_env, free_port, kvstore_command, make_session, running_daemon

PROBE = {"KVSTORE_HEALTH_INTERVAL_S": "0.2"}  # the recovery test waits for a probe, not for the default 5 s


def statuses(d: Daemon, names: tuple[str, ...]) -> dict[str, str]:
    with grpc.insecure_channel(d.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {n: health_pb2.HealthCheckResponse.ServingStatus.Name(
            stub.Check(health_pb2.HealthCheckRequest(service=n), timeout=10).status) for n in names}


def health_cli(d: Daemon) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*kvstore_command(), "health", "--address", d.address], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=60)


PARTS = ("", "kvstore.v1.KVStore", "kvstore.tier.host", "kvstore.tier.ssd", "kvstore.tier.redis")


def test_a_healthy_daemon_is_serving_in_every_part(tmp_path: Path) -> None:
    with running_daemon(tmp_path / "data") as d:
        assert statuses(d, PARTS[:4]) == dict.fromkeys(PARTS[:4], "SERVING")
        r = health_cli(d)
        assert (r.returncode, r.stdout, r.stderr) == (0, "SERVING\n", "")


def test_an_unreachable_cache_tier_is_named_and_saves_go_on(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with running_daemon(tmp_path / "data", "--redis-url", url) as d:
        assert statuses(d, PARTS) == {"": "SERVING", "kvstore.v1.KVStore": "SERVING", "kvstore.tier.host": "SERVING",
                                      "kvstore.tier.ssd": "SERVING", "kvstore.tier.redis": "NOT_SERVING"}
        warning = [line for line in d.log().splitlines() if '"WARNING"' in line and "tier redis" in line]
        assert len(warning) == 1 and "is unreachable" in warning[0] and "Connection refused" in warning[0], d.log()
        assert "Saves go on without it" in warning[0]
        r = health_cli(d)
        lines = r.stdout.splitlines()
        assert r.returncode == 1 and r.stderr == "", r
        assert lines[0] == "SERVING, degraded: 1 of 3 tiers not serving (saves still succeed)"
        assert len(lines) == 2 and lines[1].startswith("  kvstore.tier.redis NOT_SERVING: redis tier (") and \
            "Connection refused" in lines[1], r.stdout
        with Client(address=d.address, shared_memory=False) as c:
            s = make_session(namespace="h", session_id="s")
            c.save_session(s.manifest, s.blobs)
            assert c.get_session("h", "s")[1] == {"host": 3}


def test_with_shared_sessions_an_unreachable_redis_makes_the_daemon_not_serving(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with running_daemon(tmp_path / "data", "--redis-url", url, "--redis-share-sessions") as d:
        got = statuses(d, PARTS)
        assert got == {"": "NOT_SERVING", "kvstore.v1.KVStore": "NOT_SERVING", "kvstore.tier.host": "SERVING",
                       "kvstore.tier.ssd": "SERVING", "kvstore.tier.redis": "NOT_SERVING"}
        warning = [line for line in d.log().splitlines() if '"WARNING"' in line and "tier redis" in line]
        assert len(warning) == 1 and "--redis-share-sessions" in warning[0] and "every save fails" in warning[0]
        r = health_cli(d)
        lines = r.stdout.splitlines()
        assert r.returncode == 1 and lines[:2] == ["NOT_SERVING: saves cannot succeed",
                                                   "  kvstore.v1.KVStore NOT_SERVING"], r
        assert lines[2].startswith("  kvstore.tier.redis NOT_SERVING: redis tier (") and len(lines) == 3, r.stdout
        with Client(address=d.address, shared_memory=False, retries=0) as c, \
                pytest.raises(Unavailable, match="not published"):
            s = make_session(namespace="h", session_id="s")
            c.save_session(s.manifest, s.blobs)


def test_a_redis_that_comes_up_is_noticed_without_a_restart(tmp_path: Path) -> None:
    from tests.conftest import RedisServer, _require_redis_server

    _require_redis_server()
    redis = RedisServer(tmp_path / "redis-dir")  # its port is free: closed until start()
    (tmp_path / "redis-dir").mkdir()
    flags = ("--redis-url", redis.url, "--redis-share-sessions")
    with running_daemon(tmp_path / "data", *flags, env=clean_env(**PROBE)) as d:
        assert statuses(d, ("",)) == {"": "NOT_SERVING"}
        redis.start()
        try:
            deadline = time.monotonic() + 60
            while statuses(d, ("",))[""] != "SERVING":
                assert time.monotonic() < deadline, d.log()
                time.sleep(0.1)
            assert statuses(d, PARTS) == dict.fromkeys(PARTS, "SERVING")
            assert "tier redis is reachable again" in d.log()
            with Client(address=d.address, shared_memory=False) as c:
                s = make_session(namespace="h", session_id="s")
                c.save_session(s.manifest, s.blobs)
            r = health_cli(d)
            assert (r.returncode, r.stdout) == (0, "SERVING\n")
        finally:
            redis.stop()
