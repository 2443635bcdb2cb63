"""benchmarks/daemon/bench_default_load.py at 8K tokens of deepseek-v4.1-flash, one repeat: a real daemon
loads the session whole through ``load_session()`` (dropping and holding its answers) and
``load_session_into`` from the host and the ssd tier, byte for byte what was saved (the benchmark checks),
beside the raw floors. Asserts that every measurement and ratio is there and the report renders, not the
figures (a shared 2-core machine)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.daemon.bench_default_load import ROWS, TARGETS, BenchConfig, ratios, report, run_size


def test_one_small_run_measures_every_row(tmp_path: Path) -> None:
    cfg = BenchConfig(tokens=(8192,), repeats=1)
    r = run_size(8192, cfg, tmp_path)
    assert r.chunks == 32 and r.nbytes == 32 * 229_208
    for metric, _ in ROWS:
        assert len(r.seconds[metric]) == cfg.repeats and min(r.seconds[metric]) > 0, metric
    got = ratios(r)
    assert set(got) == set(TARGETS) and all(v["ratio"] and v["ratio"] > 0 for v in got.values())
    text = report([r], cfg, "bench", "git test")
    assert "## 8K tokens" in text and "host: load_session() / memcpy" in text
