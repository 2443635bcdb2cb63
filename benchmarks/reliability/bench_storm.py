"""SIGKILL storm against a real daemon: no acknowledged session lost, nothing half-visible.

    python benchmarks/reliability/bench_storm.py --kills 1000 --mode through      # or back, or both
    python benchmarks/reliability/bench_storm.py --kills 50 --mode both --launcher exec   # `kvstore serve` per start

Four writer threads (one Client each; 16 sessions in two namespaces) save, commit, delete, evict
and re-read sessions while the daemon is SIGKILLed at random moments (see
``benchmarks/reliability/storm.py`` for the kill points and the checks). Prints one table and
writes ``benchmarks/results/storm.json``; exits 1 if any acknowledged session was lost or any
corruption, half-visible session, daemon crash or live error was seen.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import results_dir
from benchmarks.reliability.provenance import git_commit
from benchmarks.reliability.storm import StormConfig, StormResult, run_storm

RESULTS = results_dir(sys.argv, os.environ)  # benchmarks/results/ with --write, else benchmarks/out/


def table(results: list[StormResult]) -> str:
    rows = [("write mode", "kill points", "of which in startup", "acked commits / deletes",
             "session checks", "acked checked", "chunks compared", "lost or corrupt", "start p50 s", "run s")]
    for r in results:
        rows.append((r.config.write_mode, str(r.kill_points), str(r.kills_by_kind.get("startup", 0)),
                     f"{r.acked_ops.get('commit', 0)} / {r.acked_ops.get('delete', 0)}", str(r.sessions_checked),
                     str(r.acked_sessions_checked), str(r.chunks_compared), str(r.lost_or_corrupt),
                     f"{r.start_s_p50:.3f}", f"{r.duration_s:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


@contextmanager
def redis_server(wanted: bool, workdir: Path) -> Iterator[str]:
    """A throwaway redis-server without persistence (its URL), or "" when not ``wanted``."""
    if not wanted:
        yield ""
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout.strip() != b"PONG":
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait()


def progress(r: StormResult) -> None:
    print(f"  {r.config.write_mode}: {r.kill_points} kill points, {r.acked_ops.get('commit', 0)} commits "
          f"acknowledged so far, {len(r.violations)} violations", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = StormConfig()
    p.add_argument("--kills", type=int, default=d.kills, help="kill points per write mode")
    p.add_argument("--mode", choices=["through", "back", "both"], default="both")
    p.add_argument("--writers", type=int, default=d.writers)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--launcher", choices=["fork", "exec"], default=d.launcher)
    p.add_argument("--fresh-clients", action="store_true", help="a new Client per daemon start (else kept)")
    p.add_argument("--redis", action="store_true", help="add a Redis tier (starts its own redis-server)")
    p.add_argument("--out", type=Path, default=RESULTS / "storm.json")
    args = p.parse_args(argv)
    modes = ["through", "back"] if args.mode == "both" else [args.mode]
    base = StormConfig(kills=args.kills, writers=args.writers, seed=args.seed, launcher=args.launcher,
                       reuse_clients=not args.fresh_clients)
    results = []
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix=f"storm-{mode}-") as tmp, redis_server(args.redis, Path(tmp)) as url:
            results.append(run_storm(replace(base, write_mode=mode, redis_url=url), Path(tmp), progress))
        print(f"{mode}: {results[-1].kill_points} kill points, {results[-1].lost_or_corrupt} violations", flush=True)
    print()
    print(table(results))
    for r in results:
        for v in r.violations[:20]:
            print("VIOLATION", v)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(["python", "benchmarks/reliability/bench_storm.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": git_commit(),
        "machine": f"{platform.machine()}, Python {platform.python_version()}",
        "results": [r.as_dict() for r in results]}, indent=1, default=str) + "\n")
    print(f"\nwrote {args.out}")
    return 1 if any(r.violations for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
