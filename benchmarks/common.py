"""Helpers every benchmark shares: median timing and writing the results table."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def median_time(fn: Callable[[], object], repeats: int = 7, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after ``warmup`` runs (seconds)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def machine() -> str:
    return (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def write_result(name: str, title: str, body: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(f"# {title}\n\n{body}\n")
    return path
