"""The obvious load against the fast ones (issue 28): ``Client.load_session()`` with its defaults beside
``load_session_into`` and the floors of the same bytes, at the real geometry, in one run.

    python benchmarks/daemon/bench_default_load.py [--tokens 131072 1048576] [--repeats 5] [--tree PATH] [--write]

Per session size (128K and 1M tokens of deepseek-v4.1-flash: 512 and 4,096 chunks, 117 and 939 MB), with a
daemon of default settings on a temp data dir, the session saved in large turns, then loaded whole:
- host tier (every chunk in the daemon's host tier, promoted by a prefetch, then one untimed load):
  ``load_session()`` with its defaults (its pairs iterated, dropped before the next load), the same
  by a second client whose caller holds each answer until its next one (so no buffer of the last
  answer can be reused: fresh memory every load),
  ``load_session_into`` one reused buffer, and a memcpy of the same bytes into a reused buffer;
- ssd tier, page cache warm (``evict(.., "ssd")`` before every load): the same three loads, beside raw
  LMDB reads of every chunk in one read transaction (views; and with a copy out).
Medians of ``--repeats``, interleaved per round; the ratios against the issue's targets (default load
within 3x memcpy on the host tier, 3x raw LMDB reads on the ssd tier). ``--tree``: the checkout whose
``kvstore`` (client and daemon) is measured, e.g. a base checkout beside this one; default: this one.
Writes default_load.md and .json (benchmarks/out, or benchmarks/results with --write).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE))
from benchmarks.common import RESULTS, git_state, machine, markdown_table, targets_table, write_result  # noqa: E402

NS, SID = "default-load", "agent"
TURN_CHUNKS = 64  # chunks per save: the session is stored quickly; how it was saved is not measured here
#: ratio name -> (measured, floor, target: measured <= target x floor; None: shown for reference)
TARGETS: dict[str, tuple[str, str, float | None]] = {
    "host: load_session() / memcpy": ("host_default", "memcpy", 3.0),
    "host: load_session(), result kept / memcpy": ("host_default_kept", "memcpy", None),
    "host: load_session_into / memcpy": ("host_into", "memcpy", None),
    "ssd: load_session() / raw LMDB reads": ("ssd_default", "raw_reads", 3.0),
    "ssd: load_session(), result kept / raw LMDB reads": ("ssd_default_kept", "raw_reads", None),
    "ssd: load_session_into / raw LMDB reads": ("ssd_into", "raw_reads", None),
    # the raw reads above hand out views and touch no byte; a load hands the bytes over: this is that cost
    "ssd: load_session() / raw LMDB reads + copy out": ("ssd_default", "raw_reads_copy", None),
}
ROWS = [("host_default", "load_session(), host tier"),
        ("host_default_kept", "load_session(), host tier, previous result held"),
        ("host_into", "load_session_into (reused buffer), host tier"),
        ("memcpy", "memcpy into a reused buffer"),
        ("ssd_default", "load_session(), ssd tier, cache warm"),
        ("ssd_default_kept", "load_session(), ssd tier, previous result held"),
        ("ssd_into", "load_session_into (reused buffer), ssd tier"),
        ("raw_reads", "raw LMDB reads, one txn (views)"),
        ("raw_reads_copy", "raw LMDB reads + copy out")]


@dataclass(frozen=True)
class BenchConfig:
    tokens: tuple[int, ...] = (131_072, 1_048_576)
    repeats: int = 5
    tree: Path = HERE


@dataclass
class SizeResult:
    tokens: int
    chunks: int
    nbytes: int
    seconds: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def median(self, metric: str) -> float | None:
        s = self.seconds.get(metric)
        return statistics.median(s) if s else None


def _use_tree(tree: Path) -> None:
    """Import ``kvstore`` (and the daemon's cli) from ``tree``: the benchmark's own modules are loaded."""
    if tree != HERE:
        sys.path.insert(0, str(tree))


def run_size(tokens: int, cfg: BenchConfig, work: Path) -> SizeResult:
    import numpy as np

    from benchmarks.resume.geometry_raw import RawLmdb, memcpy
    from benchmarks.resume.geometry_session import make_session, manifest
    from kvstore.client import Client
    from kvstore.server.process import DaemonProcess

    s = make_session(tokens, NS)
    packed = memoryview(b"".join(s.blobs))
    offsets = np.cumsum([0, *map(len, s.blobs)]).tolist()
    s = replace(s, blobs=[packed[a:b] for a, b in itertools.pairwise(offsets)])
    dest = np.ones(s.nbytes, np.uint8)  # faulted in once: a copy into it is a copy, not page faults
    into = np.ones(s.nbytes, np.uint8)
    raw = RawLmdb(work / "raw")
    raw.put_turn(list(zip(s.keys, s.blobs)))
    d = DaemonProcess(work / "daemon", cwd=cfg.tree).start()
    r = SizeResult(tokens, len(s.keys), s.nbytes)
    try:
        client = Client(d.address)
        for end in range(TURN_CHUNKS, len(s.keys) + TURN_CHUNKS, TURN_CHUNKS):
            end = min(end, len(s.keys))
            client.save_session(manifest(s, SID, end), s.blobs[max(0, end - TURN_CHUNKS) : end])
        kept: list[Any] = []

        def default() -> tuple[int, int]:
            _, pairs = client.load_session(NS, SID)
            got = list(pairs)
            return len(got), sum(len(b) for _, b in got)

        keeper = Client(d.address)  # a caller that keeps each answer until the next: its own client, its own buffers

        def default_kept() -> tuple[int, int]:
            _, pairs = keeper.load_session(NS, SID)
            got = list(pairs)
            kept[:] = [got]  # the previous answer dropped only now, after this one was made
            return len(got), sum(len(b) for _, b in got)

        def load_into() -> tuple[int, int]:
            _, placed = client.load_session_into(NS, SID, into)
            return len(placed), sum(len(b) for _, b in placed)

        loads: dict[str, Callable[[], tuple[int, int]]] = {"default": default, "default_kept": default_kept,
                                                            "into": load_into}
        _check(client.load_session(NS, SID)[1], s)
        for fn in loads.values():  # warm-up: connections, arena, buffers, the daemon's code paths
            fn()
        for _ in range(cfg.repeats):
            client.prefetch(NS, SID)
            client.wait_prefetched(NS, SID, timeout_s=300)
            load_into()  # untimed: the promotion's last writes settle before the timed loads
            for name, fn in loads.items():
                if set(placement(client)) != {"host"}:
                    r.notes.append(f"a host-tier load found the chunks in {placement(client)}")
                r.seconds.setdefault(f"host_{name}", []).append(timed(fn, s))
            kept.clear()
            r.seconds.setdefault("memcpy", []).append(memcpy(packed, dest))
            r.seconds.setdefault("raw_reads", []).append(raw.read_all(s.keys)[0])
            r.seconds.setdefault("raw_reads_copy", []).append(raw.read_all(s.keys, dest)[0])
            for name, fn in loads.items():
                client.evict(NS, SID, "ssd")
                if placement(client) != {"ssd": len(s.keys)}:
                    r.notes.append(f"after evict the chunks were in {placement(client)}")
                r.seconds.setdefault(f"ssd_{name}", []).append(timed(fn, s))
            kept.clear()
        kept.clear()
        keeper.close()
        client.close()
    finally:
        d.stop()
        raw.close()
    return r


def placement(client: Any) -> dict[str, int]:
    return dict(client.get_session(NS, SID)[1])


def _check(pairs: Any, s: Any) -> None:
    got = dict(pairs)
    if len(got) != len(s.keys) or any(bytes(got[i]) != s.blobs[i] for i in range(len(s.keys))):
        raise RuntimeError("the daemon returned other bytes than were saved")


def timed(fn: Callable[[], tuple[int, int]], s: Any) -> float:
    t = time.perf_counter()
    n, nbytes = fn()
    dt = time.perf_counter() - t
    if (n, nbytes) != (len(s.keys), s.nbytes):
        raise RuntimeError(f"a load returned {n} chunks / {nbytes} bytes of {len(s.keys)} / {s.nbytes}")
    return dt


def ratios(r: SizeResult) -> dict[str, dict[str, Any]]:
    out = {}
    for name, (num, den, target) in TARGETS.items():
        a, b = r.median(num), r.median(den)
        ratio = a / b if a is not None and b else None
        out[name] = {"ratio": ratio, "target": target,
                     "met": None if target is None or ratio is None else ratio <= target}
    return out


def report(results: list[SizeResult], cfg: BenchConfig, command: str, git: str) -> str:
    from benchmarks.resume.geometry_session import LAYOUT, section_title

    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [f"`{command}`", "", f"{machine()}; {git} ({cfg.tree}); load average {load} at the end "
             f"(2 cores, shared); layout {LAYOUT}; default daemon and client; medians of {cfg.repeats}.", ""]
    for r in results:
        rows = [[what, f"{m * 1e3:.1f}", f"{r.nbytes / m / 1e9:.2f}"]
                for metric, what in ROWS if (m := r.median(metric)) is not None]
        lines += [section_title(r.tokens, r.chunks, r.nbytes), "", markdown_table(["", "ms", "GB/s"], rows), "",
                  targets_table("target", ratios(r))]
        lines += [f"- {n}" for n in sorted(set(r.notes))] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=list(BenchConfig.tokens))
    p.add_argument("--repeats", type=int, default=BenchConfig.repeats)
    p.add_argument("--tree", type=Path, default=HERE, help="the checkout whose kvstore is measured")
    p.add_argument("--work", type=Path, default=None, help="where the data dirs go (default: a temp dir)")
    args = p.parse_args(argv)
    cfg = BenchConfig(tuple(args.tokens), args.repeats, args.tree.resolve())
    git = git_state()
    _use_tree(cfg.tree)
    if cfg.tree != HERE:
        import subprocess

        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cfg.tree, capture_output=True, text=True)
        git = f"kvstore of git {rev.stdout.strip()}"
    command = "python benchmarks/daemon/bench_default_load.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="default-load-", dir=args.work) as tmp:
        for tokens in cfg.tokens:
            sub = Path(tmp) / str(tokens)
            sub.mkdir()
            results.append(run_size(tokens, cfg, sub))
    text = report(results, cfg, command.strip(), git)
    print(text)
    name = "default_load" if cfg.tree == HERE else "default_load_base"
    path = write_result(f"{name}.md", "The default load_session() against the fast paths (issue 28)", text)
    (RESULTS / f"{name}.json").write_text(json.dumps(
        {"command": command.strip(), "git": git, "config": {**asdict(cfg), "tree": str(cfg.tree)},
         "sizes": [{**asdict(r), "medians": {k: r.median(k) for k in r.seconds}, "ratios": ratios(r)}
                   for r in results]}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
