"""The SIGKILL storm, short mode: 50 kill points per write mode against a real daemon.

The harness lives in ``benchmarks/reliability/`` (the long mode, 1,000 kill points, is
``python benchmarks/reliability/bench_storm.py --kills 1000``). Daemons are forked from a helper process
that imported the daemon once (a ``Zygote``, benchmarks/reliability/zygote.py), so a restart costs ~0.1 s
instead of ~2 s. Each
writer keeps one ``Client`` across every restart, on the same port, as an agent would.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.reliability.launcher import daemon, make_spawner
from benchmarks.reliability.oracle import ABSENT, Oracle
from benchmarks.reliability.storm import StormConfig, run_storm
from benchmarks.reliability.workload import CHUNK_TOKENS
from kvstore.client import Client
from kvstore.format.keys import ROOT

SHORT_KILLS = 50


@pytest.mark.parametrize("write_mode", ["through", "back"])
def test_sigkill_storm_loses_no_acknowledged_session(tmp_path: Path, write_mode: str) -> None:
    config = StormConfig(kills=SHORT_KILLS, write_mode=write_mode)
    r = run_storm(config, tmp_path)
    summary = (f"seed {config.seed}, {write_mode}: {r.kill_points} kill points, {r.checks} checks, "
               f"acked {r.acked_ops}, errors after kills {r.error_kinds}")
    assert not r.violations, summary + "\n" + "\n".join(r.violations[:30])
    assert r.kill_points == SHORT_KILLS, summary
    # the storm did real work: sessions committed, deleted, checked while their state was known
    assert r.acked_ops["commit"] >= SHORT_KILLS and r.acked_ops["delete"] > 0, summary
    assert r.present_checked > 0 and r.acked_sessions_checked > r.sessions_checked // 2, summary
    assert r.kills_by_kind.get("startup", 0) > 0, summary


def test_the_checker_catches_a_lost_and_a_wrong_session(tmp_path: Path) -> None:
    """The oracle itself: an acknowledged version the daemon lacks, and a session that serves
    other content than its writer committed under that version, are both reported."""
    zygote = make_spawner("fork")
    d = daemon(zygote, tmp_path / "data", ["--chunk-tokens", str(CHUNK_TOKENS)], tmp_path / "log").spawn()
    try:
        assert d.wait_ready(60), d.log()
        lost, torn = ("ns-a", "lost"), ("ns-a", "torn")
        oracle = Oracle(7, [lost, torn])
        with Client(address=d.address) as client:
            v = oracle.version(torn, 0)
            client.save_chunks("ns-a", v.manifest.layout_id, ROOT, 0, list(v.blobs))
            client.commit(v.manifest)
            oracle.ack(torn, 0)
            assert not oracle.check(client).violations
            oracle.ack(lost, 3)  # acknowledged, never stored
            # what a mixed-up commit would serve: version 0's content under version 1's number
            oracle.ack(torn, 1)
            client.commit(replace(v.manifest, metadata={"v": "1"}))
            report = oracle.check(client)
        assert any("LOST" in m and "lost" in m for m in report.violations), report.violations
        assert any("torn" in m and "differs" in m for m in report.violations), report.violations
        assert oracle.allowed(lost) == {ABSENT}
    finally:
        d.kill()
        zygote.close()
