"""benchmarks/resume/bench_resume_geometry.py, quick mode (8K and 16K tokens of deepseek-v4.1-flash, 2
repeats): a real daemon saves the session turn by turn and loads it whole from the host and the ssd tier,
byte for byte what was saved (the benchmark checks), beside the raw floors. Asserts that every
measurement and ratio is there and the report renders, not the figures (a shared 2-core machine)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.resume.bench_resume_geometry import TARGETS, GeometryConfig, ratios, report, run


def test_quick_mode_measures_every_path(tmp_path: Path) -> None:
    cfg = GeometryConfig.quick()  # auto: load_session_into once the client has it, else load_session
    results = run(cfg, tmp_path)
    assert [r.tokens for r in results] == list(cfg.tokens)
    for r in results:
        assert r.chunks == r.tokens // 256 and r.nbytes == r.chunks * 229_208
        assert len(r.seconds["turn_save"]) == len(r.seconds["raw_put"]) == r.tokens // 2048
        for metric in ("host", "memcpy", "raw_reads", "raw_reads_copy", "ssd_warm"):
            assert len(r.seconds[metric]) == cfg.repeats and min(r.seconds[metric]) > 0, metric
        assert len(r.seconds["raw_reads_cold"]) == cfg.cold_repeats
        # the page cache of the daemon's file is dropped, or that it could not be is said
        assert "ssd_cold" in r.seconds or any("not possible" in n for n in r.notes)
        got = ratios(r)
        assert set(got) == set(TARGETS)
        assert all(v["ratio"] and v["ratio"] > 0 for k, v in got.items() if "dropped" not in k)
    text = report(results, cfg, "bench --quick")
    assert "## 8K tokens" in text and "## 16K tokens" in text and "host / memcpy" in text
