"""benchmarks/resume/bench_turn_saves.py, quick mode (token and engine page sessions of 16K and 32K tokens
of deepseek-v4.1-flash, windows of 4 rounds, 1 and 0 ms apart): real daemons save both sessions of each
kind turn by turn, the measured rounds interleaved with raw LMDB puts of the same bytes, and the daemon's versions name
every chunk and page saved (the benchmark checks). Asserts that every measurement and ratio is there
and the report renders, not the figures (a shared 2-core machine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.resume.bench_turn_saves import TurnConfig, main, report, run


def test_quick_mode_measures_both_lengths_of_both_kinds(tmp_path: Path) -> None:
    cfg = TurnConfig.quick()
    results = run(cfg, tmp_path)
    assert [r.kind for r in results] == ["token", "page"]
    for r in results:
        assert set(r.seconds) == {f"{n}_{m}@{g:g}" for n in ("short", "long") for m in ("save", "raw")
                                  for g in cfg.gaps_ms}
        assert all(len(v) == cfg.window and min(v) > 0 for v in r.seconds.values())
        assert len(r.growth) == cfg.built(cfg.long)
        assert r.turn_bytes > 1_800_000  # a 2,048-token turn of V4.1: 8 chunks, or 16 pages
        ratios = r.ratios(cfg)
        assert len(ratios) == 3 * len(cfg.gaps_ms) and all(v["ratio"] > 0 for v in ratios.values())
    text = report(results, cfg, "bench --quick")
    assert "## Token sessions" in text and "## Page sessions" in text and "at 32K / at 16K" in text


def test_a_window_the_short_session_cannot_hold_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--short", "16384", "--long", "65536", "--window", "32"])
    assert "--short must exceed half the windows' tokens" in capsys.readouterr().err
