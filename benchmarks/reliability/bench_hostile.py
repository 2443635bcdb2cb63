"""Hostile arenas against a real daemon while another tenant's same-host client loads without pause.

    python benchmarks/reliability/bench_hostile.py --rounds 10 --seconds 2    # the figure reliability.md quotes
    python benchmarks/reliability/bench_hostile.py --rounds 1 --seconds 0.5   # a quick look

Each round runs every case of ``benchmarks/reliability/hostile_client.py`` (a truncated arena file,
once and over and over under running loads and saves; hole-punched files and memfds; sparse files;
unsealed, sparse and hugetlbfs memfds; fds that are no memfd; NUL paths) in a process of its own; see
``benchmarks/reliability/hostile.py``. Prints the counts, writes ``benchmarks/results/hostile.json``;
exits 1 if the daemon died, any step got another answer than expected, or the victim saw an error.
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
from benchmarks.reliability.hostile import HostileConfig, HostileResult, run_hostile

RESULTS = results_dir(sys.argv, os.environ)  # benchmarks/results/ with --write, else benchmarks/out/


def table(r: HostileResult) -> str:
    codes = ", ".join(f"{n:,} {c}" for c, n in sorted(r.codes.items(), key=lambda x: -x[1]))
    return "\n".join([
        f"{r.cases_run} hostile client processes ({r.config.rounds} rounds, {r.cases_skipped} skipped), "
        f"{r.steps} steps, {r.calls:,} answers: {codes}",
        f"unexpected answers: {len(r.unexpected)}; daemon deaths: {r.daemon_deaths}; daemon exit: {r.daemon_exit}",
        f"victim (another tenant, same-host): {r.victim_loads:,} loads, {r.victim_bytes / 2**20:,.0f} MiB compared, "
        f"{len(r.victim_errors)} errors",
        f"daemon fds {r.fds_before} before -> {r.fds_after} after, arenas held {r.arenas_before} -> {r.arenas_after}: "
        f"{r.fds_kept} fds kept beyond the arenas'; {r.seconds:.0f} s; commit {r.commit}",
        *(f"  {u}" for u in r.unexpected[:20]), *(f"  victim: {e}" for e in r.victim_errors[:10])])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--seconds", type=float, default=2.0, help="how long each in-flight case truncates")
    p.add_argument("--out", type=Path, default=RESULTS / "hostile.json")
    args = p.parse_args(argv)
    config = HostileConfig(rounds=args.rounds, seconds=args.seconds)
    with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
        r = run_hostile(config, Path(tmp))
    print(table(r))
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(),
            "command": " ".join(["benchmarks/reliability/bench_hostile.py",
                                 *(argv if argv is not None else sys.argv[1:])])}
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps({**meta, **r.as_dict(), "fds_kept": r.fds_kept}, indent=1, default=str) + "\n")
    ok = not r.unexpected and not r.daemon_deaths and not r.victim_errors and r.fds_kept <= 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
