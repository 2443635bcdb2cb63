"""benchmarks/resume/geometry_gpu.py: without CUDA it measures nothing and says so; its ratios and report
from given figures; on a CUDA machine, one small size end to end (every row measured, every load
checked bit for bit by the benchmark itself)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.resume import geometry_gpu as g


def test_without_cuda_it_says_so_and_measures_nothing(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(g, "run_size", lambda *a: pytest.fail("measured without CUDA"))
    assert g.main(["--tokens", "8192"]) == 0
    assert capsys.readouterr().out.strip() == g.NEEDS_CUDA


def test_ratios_against_the_target_and_the_report() -> None:
    r = g.SizeResult(131_072, 512, 117_354_496)
    r.seconds = {"device_host": [0.030, 0.020, 0.025], "memcpy": [0.010], "h2d_pinned": [0.004, 0.002, 0.003],
                 "into_pinned": [0.015], "h2d_registered": [0.003], "d2d": [0.0001]}
    r.paths["device_host"] = "host (the daemon has no HBM tier)"
    got = g.ratios(r)
    assert got["(a) / ((b) + (c))"] == {"ratio": pytest.approx(0.025 / 0.013), "target": 1.5, "met": False}
    assert got["(a1) / (b)"]["ratio"] == pytest.approx(1.5) and got["(a1) / (b)"]["met"] is None
    assert got["(d) host path / ((b) + (c))"]["ratio"] is None  # not measured: shown as n/a
    r.seconds["device_host"] = [0.019]
    assert g.ratios(r)["(a) / ((b) + (c))"]["met"] is True
    text = g.report([r], g.GpuConfig(tokens=(131_072,)), "geometry_gpu.py --tokens 131072", "a GPU")
    assert "## 128K tokens: 512 chunks, 117 MB" in text and "| (a) / ((b) + (c)) | 1.46x | 1.5x | yes |" in text
    assert "(d) HBM tier" not in text and "host (the daemon has no HBM tier)" in text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU resume benchmark needs CUDA")
def test_one_small_size_on_the_gpu(tmp_path: Path) -> None:
    cfg = g.GpuConfig(tokens=(8192,), repeats=1)
    r = g.run_size(8192, cfg, tmp_path, torch.device("cuda", 0))
    assert r.chunks == 32 and r.nbytes == 32 * 229_208
    for metric, _ in g.ROWS:
        assert len(r.seconds.get(metric, [])) == 1 and min(r.seconds[metric]) > 0, (metric, r.notes)
    assert r.paths["device_host"].startswith("host") and r.paths["hbm_host"].startswith("host")
    assert all(v["ratio"] for v in g.ratios(r).values())
