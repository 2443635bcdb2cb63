"""Helpers every benchmark shares: median timing and writing the results table.

Where results go, one rule for every benchmark that writes through ``RESULTS`` / ``write_result``:
``benchmarks/out/`` (untracked: it ignores itself) unless asked, with ``--write`` anywhere on the
benchmark's command line (or ``KVSTORE_BENCH_WRITE=1``), for ``benchmarks/results/``, the committed
record the README cites. A run never rewrites tracked files by accident.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

COMMITTED = Path(__file__).resolve().parent / "results"  # tracked: what the README's tables cite
SCRATCH = Path(__file__).resolve().parent / "out"  # untracked: where a run writes unless asked


def results_dir(argv: list[str], env: MutableMapping[str, str]) -> Path:
    """``COMMITTED`` when ``--write`` is in ``argv`` (removed there, before the benchmark's own argument
    parser sees it, and passed on to child processes through ``KVSTORE_BENCH_WRITE=1``) or
    ``KVSTORE_BENCH_WRITE=1`` is set; else ``SCRATCH``, made and ignoring itself."""
    if "--write" in argv[1:]:
        argv.remove("--write")
        env["KVSTORE_BENCH_WRITE"] = "1"
    if env.get("KVSTORE_BENCH_WRITE") == "1":
        return COMMITTED
    SCRATCH.mkdir(exist_ok=True)
    (SCRATCH / ".gitignore").write_text("# benchmark results of runs without --write (benchmarks/common.py)\n*\n")
    return SCRATCH


RESULTS = results_dir(sys.argv, os.environ)


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
    import torch

    return (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def targets_table(first: str, ratios: Mapping[str, Mapping[str, Any]]) -> str:
    """Ratios against their targets: per name, ``ratio`` (None: not measured), ``target`` (None: shown
    for reference) and ``met``; a column headed ``first``, then ratio, at most, met."""
    rows = [[k, "n/a" if v["ratio"] is None else f"{v['ratio']:.2f}x",
             "-" if v["target"] is None else f"{v['target']}x",
             "-" if v["target"] is None else "n/a" if v["met"] is None else "yes" if v["met"] else "**no**"]
            for k, v in ratios.items()]
    return markdown_table([first, "ratio" if first != "ratio" else "measured", "at most", "met"], rows)


def write_result(name: str, title: str, body: str) -> Path:
    """``RESULTS / name`` (see the module's docstring for where that is), written; its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(f"# {title}\n\n{body}\n")
    return path


def write_json(name: str, command: str, payload: Mapping[str, Any]) -> Path:
    """``RESULTS / name``: the run's command and commit, then ``payload``, as indented JSON (the numbers
    behind a ``write_result`` table); its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps({"command": command, "git": git_state(), **payload}, indent=1) + "\n")
    return path


def git_state(paths: Sequence[str] = ("kvstore",)) -> str:
    """The checkout's commit, and whether ``paths`` had uncommitted changes when a benchmark ran."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    if os.environ.get("KVSTORE_GIT_REV"):  # a copy of a working tree (the device machine): the caller says which
        return f"git {os.environ['KVSTORE_GIT_REV']}"
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
    """Least-squares ``seconds = fixed + nbytes / rate`` over sizes, on relative residuals (so the
    small sizes pin the fixed part and the large ones the rate): (fixed seconds per call, marginal
    GB/s). Separates per-call overhead from per-byte cost; a negative fixed part means the cost
    grows faster than linearly with size."""
    import numpy as np

    t = np.asarray(seconds, float)
    slope, fixed = np.polyfit(np.asarray(nbytes, float), t, 1, w=1 / t)
    return float(fixed), (1 / slope / 1e9 if slope > 0 else float("inf"))


def start(ctx: Any, target: Callable[..., None], *args: Any) -> tuple[Any, Any]:
    """A child process of multiprocessing context ``ctx`` running ``target(*args, conn)``: (the
    process, our end of ``conn``)."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    return proc, parent


def answer(conn: Any) -> Any:
    """The next ``("ok", value)`` from a child; a child's ``("error", traceback)`` is raised here."""
    kind, value = conn.recv()
    if kind == "error":
        raise RuntimeError(f"benchmark child process failed:\n{value}")
    return value


def chunk_session(layout: Any, namespace: str, n_chunks: int, chunk_tokens: int, seed: int = 0
                  ) -> tuple[list[bytes], list[bytes], Any]:
    """(blobs, keys, token ids) of ``n_chunks`` chunks of ``layout``: Gaussian bf16 KV through the
    real FP4 codecs and random token ids, the same for every caller with the same seed; keys
    chained under ``namespace``."""
    import numpy as np
    import torch

    from kvstore.format import chunk, quant
    from kvstore.format.keys import chain_keys

    g = torch.Generator().manual_seed(seed)
    ids = np.random.default_rng(seed).integers(0, 129_280, n_chunks * chunk_tokens)
    per_cache = {}
    for c in layout.caches:
        n = c.entries_for(chunk_tokens)
        x = torch.randn(n_chunks * n, c.channels, generator=g).to(torch.bfloat16)
        codes, scales = (quant.quantize_main if c.fmt.block == 16 else quant.quantize_indexer)(x)
        per_cache[c.name] = (codes.numpy().reshape(n_chunks, n, -1), scales.numpy().reshape(n_chunks, n, -1))
    keys = chain_keys(layout.layout_id, namespace, ids, chunk_tokens)
    blobs = [chunk.encode(layout, key=k, start=i * chunk_tokens, token_ids=ids[i * chunk_tokens:(i + 1) * chunk_tokens],
                          entries={name: chunk.Entries(cs[0][i], cs[1][i]) for name, cs in per_cache.items()})
             for i, k in enumerate(keys)]
    return blobs, keys, ids


def drop_page_cache(path: Path) -> str:
    """Ask the kernel to drop the clean pages of ``path`` (a file, or every file under a directory):
    fsync, then posix_fadvise DONTNEED, these files only, not the machine's whole cache. Pages a
    process has mapped and touched stay. Returns "" or why it could not be asked."""
    if not hasattr(os, "posix_fadvise"):
        return "posix_fadvise is not available on this platform"
    files = [path] if path.is_file() else [Path(r) / f for r, _, fs in os.walk(path) for f in fs]
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError as e:
            return f"posix_fadvise failed: {e}"
    return ""
