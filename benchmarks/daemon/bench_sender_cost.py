"""What naming each request's sender costs on the local socket (issue 27, item 1): small calls against a
daemon of this tree and a daemon of a baseline tree (the code before the change), interleaved round by
round in one run.

    python benchmarks/daemon/bench_sender_cost.py --baseline /path/to/baseline/tree [--rounds 7] [--calls 2000]

Per call kind, the median over rounds of each round's p50 latency and of the daemon's CPU time per call
(its threads' schedstat; us), one client process of this tree:
``ListSessions`` (the smallest call: one read, one answer), ``LoadChunks`` of 4 chunks through the
arena, and ``LoadChunks`` of 4 chunks into the caller's memory (the path whose sender is checked).
Both daemons run at once with default settings on temp data dirs; seed 0; one warm-up round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE))

from kvstore.client import Client  # noqa: E402
from kvstore.server.process import DaemonProcess, clean_env  # noqa: E402
from tests.helpers.daemon import make_session, save_session  # noqa: E402


def cpu_ns(pid: int) -> int:
    """CPU time the daemon's threads have run so far (schedstat: ns, summed over its threads)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total


def measure(fn: Callable[[], object], calls: int, daemon_pid: int) -> tuple[float, float]:
    """p50 latency (us) and the daemon's CPU time per call (us): the latter is the cost itself, less
    moved by other work on a shared host than a latency is."""
    times = []
    cpu0 = cpu_ns(daemon_pid)
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, (cpu_ns(daemon_pid) - cpu0) / calls / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout of the code before the change")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    s = make_session(namespace="bench", tokens=4 * 256 + 10, seed=0)
    out = np.zeros(sum(map(len, s.blobs)), np.uint8)
    trees = {"baseline": args.baseline.resolve(), "this tree": HERE}
    results: dict[str, dict[str, list[tuple[float, float]]]] = {name: {} for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        daemons = {name: DaemonProcess(Path(tmp) / name.replace(" ", "-"), env=clean_env(), cwd=tree).start()
                   for name, tree in trees.items()}
        clients = {name: Client(address=d.address) for name, d in daemons.items()}
        try:
            for c in clients.values():
                save_session(c, s)
            kinds: dict[str, Callable[[Client], object]] = {
                "ListSessions": lambda c: c.list_sessions("bench"),
                "LoadChunks, 4 chunks, arena": lambda c: list(c.load_chunks("bench", s.keys)),
                "LoadChunks, 4 chunks, into caller memory": lambda c: c.load_chunks_into("bench", s.keys, out),
            }
            for r in range(args.rounds + 1):
                order = list(trees) if r % 2 else list(reversed(trees))
                for kind, fn in kinds.items():
                    for name in order:
                        c = clients[name]
                        us = measure(lambda c=c, fn=fn: fn(c), args.calls, daemons[name].pid)
                        if r:  # round 0 warms up
                            results[name].setdefault(kind, []).append(us)
        finally:
            for c in clients.values():
                c.close()
            for d in daemons.values():
                d.stop()
    print(f"median of {args.rounds} rounds x {args.calls} calls: p50 latency, and the daemon's CPU time per call (us)")
    print("| call | latency, baseline | latency, this tree | change | daemon CPU, baseline | daemon CPU, this tree "
          "| change |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in results["baseline"]:
        row = []
        for k in (0, 1):
            a = statistics.median(r[k] for r in results["baseline"][kind])
            b = statistics.median(r[k] for r in results["this tree"][kind])
            row.append(f"{a:.1f} | {b:.1f} | {b - a:+.1f} ({(b - a) / a:+.1%})")
        print(f"| {kind} | {' | '.join(row)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
