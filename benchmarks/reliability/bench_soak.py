"""Load and soak: 64 concurrent clients mixing save, load, lookup and stats against one daemon.

    python benchmarks/reliability/bench_soak.py --minutes 10            # the published figure
    python benchmarks/reliability/bench_soak.py --minutes 0.5 --warmup-s 8

4 worker processes x 16 client threads (one ``Client`` each; 1% of operations replace a client by a
new one) against one real ``kvstore serve`` (write-through, host + ssd tiers); see
``benchmarks/reliability/soak.py``. Prints p50/p99 per RPC, errors, and the daemon's RSS from the
end of the warm-up to the end; writes ``benchmarks/results/soak.json``; exits 1 on any error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import results_dir
from benchmarks.reliability.provenance import git_commit
from benchmarks.reliability.soak import SoakConfig, SoakResult, run_soak

RESULTS = results_dir(sys.argv, os.environ)  # benchmarks/results/ with --write, else benchmarks/out/


def table(r: SoakResult) -> str:
    rows = [("RPC", "calls", "p50 ms", "p99 ms", "max ms")]
    rows += [(name, str(x.calls), f"{x.p50_ms:.1f}", f"{x.p99_ms:.1f}", f"{x.max_ms:.1f}")
             for name, x in r.rpcs.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines += ["", f"{r.config.clients} clients, {r.measured_s:.0f} s measured after {r.config.warmup_s:.0f} s warm-up: "
              f"{r.ops} operations ({r.ops / max(r.measured_s, 1e-9):.0f}/s), {r.errors} errors, "
              f"{r.bytes_verified / 2**20:.0f} MiB loaded and verified",
              f"daemon RSS {r.rss_warm_mib:.1f} MiB after warm-up -> {r.rss_end_mib:.1f} MiB at the end "
              f"({r.rss_growth_mib:+.1f} MiB, {r.rss_growth_pct:+.1f}%; max {r.rss_max_mib:.1f}; "
              f"slope {r.rss_slope_mib_per_min:+.2f} MiB/min); fds {r.fds_warm} -> {r.fds_end}; "
              f"once every client closed: {r.rss_after_mib:.1f} MiB, {r.fds_after} fds; "
              f"daemon CPU {r.daemon_cpu_pct:.0f}% of a core; daemon exit: {r.daemon_exit}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SoakConfig()
    p.add_argument("--minutes", type=float, default=10.0, help="whole run, warm-up included")
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--processes", type=int, default=d.processes)
    p.add_argument("--threads", type=int, default=d.threads, help="clients per process")
    p.add_argument("--churn", type=float, default=d.churn)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = p.parse_args(argv)
    config = SoakConfig(duration_s=args.minutes * 60, warmup_s=min(args.warmup_s, args.minutes * 30),
                        processes=args.processes, threads=args.threads, churn=args.churn, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        r = run_soak(config, Path(tmp))
    print(table(r))
    for kind, n in r.error_kinds.items():
        print(f"ERRORS {n} x {kind}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(["python", "benchmarks/reliability/bench_soak.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": git_commit(),
        "machine": f"{platform.machine()}, Python {platform.python_version()}",
        "result": r.as_dict()}, indent=1, default=str) + "\n")
    print(f"\nwrote {args.out}")
    return 1 if r.errors or r.daemon_exit != "exit code 0" else 0


if __name__ == "__main__":
    sys.exit(main())
