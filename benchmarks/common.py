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


def git_state(paths: Sequence[str] = ("kvstore",)) -> str:
    """The checkout's commit, and whether ``paths`` had uncommitted changes when a benchmark ran."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    run = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()  # noqa: E731
    dirty = run("status", "--porcelain", "--", *paths)
    note = f", with uncommitted changes in {', '.join(paths)}/" if dirty else ""
    return f"git {run('rev-parse', '--short', 'HEAD')}{note}"


Stamps = list[tuple[float, float]]  # (start, end) perf_counter of each timed repeat


def interleaved(ops: dict[str, tuple[Callable[[], object], Callable[[], object] | None]], sync: Callable[[], object],
                warmup: int, repeats: int) -> dict[str, Stamps]:
    """Run every op once per round (interleaved: drift in the machine's load hits them all alike),
    each started after ``sync`` (e.g. all client processes together) and followed by its untimed
    cleanup; the stamps of the rounds after ``warmup``."""
    out: dict[str, Stamps] = {k: [] for k in ops}
    for r in range(warmup + repeats):
        for name, (fn, cleanup) in ops.items():
            sync()
            t = time.perf_counter()
            fn()
            if r >= warmup:
                out[name].append((t, time.perf_counter()))
            if cleanup is not None:
                cleanup()
    return out


def walls(per_client: Sequence[Stamps]) -> list[float]:
    """Per repeat, over clients that ran together: the last one's end - the first one's start."""
    return [max(s[r][1] for s in per_client) - min(s[r][0] for s in per_client) for r in range(len(per_client[0]))]


def call_cost(nbytes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``seconds = fixed + nbytes / rate`` over sizes: (fixed seconds per call, marginal
    GB/s). Separates per-call overhead from per-byte cost."""
    import numpy as np

    slope, fixed = np.polyfit(np.asarray(nbytes, float), np.asarray(seconds, float), 1)
    return float(fixed), (1 / slope / 1e9 if slope > 0 else float("inf"))
