"""Long-mode fuzzing and isolation probes against a real daemon; the figures reliability.md quotes.

    .venv/bin/python benchmarks/reliability/bench_fuzz.py    # 2,000 examples per fuzz test, 20 isolation rounds
    .venv/bin/python benchmarks/reliability/bench_fuzz.py --examples 200 --rounds 2    # a quick look

Runs ``tests/reliability/test_fuzz.py`` (every RPC, over gRPC and over the local socket: random and malformed
messages, chunk bytes, ids, arena ids, shm paths, raw request bytes; the local socket's raw frames
and fds passed with calls; derandomized, so a rerun makes the same cases),
``tests/reliability/test_fuzz_surfaces.py`` (issue 27: RegisterLayout, LookupKeys, page saves and loads, page
sessions, loads into the caller's own memory at any address and size, a canary around the blobs) and
``tests/reliability/test_isolation.py`` (team-a's token against team-b's real keys, sessions, arena ids and
transfer files on every RPC and transfer path, each answer compared with the answer for a
made-up name) in their long modes, through pytest, with the tests' own assertions: no crash, no
INTERNAL/UNKNOWN, protected data byte-identical afterwards, every cross-tenant attempt refused
exactly like a miss. Prints one table (and the newer surfaces' calls by status) and writes
``benchmarks/results/fuzz.json`` and ``benchmarks/results/isolation.json``; exits 1 if any test failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from benchmarks.common import results_dir  # noqa: E402

RESULTS = results_dir(sys.argv, os.environ)  # benchmarks/results/ with --write, else benchmarks/out/


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=2000, help="hypothesis examples per fuzz test")
    ap.add_argument("--rounds", type=int, default=20, help="isolation probe rounds (fresh decoys each)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fuzz_report, iso_report = Path(tmp) / "fuzz.json", Path(tmp) / "isolation.json"
        surfaces_report = Path(tmp) / "surfaces.json"
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")},
               "KVSTORE_FUZZ_EXAMPLES": str(args.examples), "KVSTORE_FUZZ_REPORT": str(fuzz_report),
               "KVSTORE_FUZZ_SURFACES_REPORT": str(surfaces_report),
               "KVSTORE_ISOLATION_ROUNDS": str(args.rounds), "KVSTORE_ISOLATION_REPORT": str(iso_report)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/reliability/test_fuzz.py",
               "tests/reliability/test_fuzz_surfaces.py", "tests/reliability/test_isolation.py"]
        t0 = time.monotonic()
        rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
        seconds = time.monotonic() - t0
        fuzz = json.loads(fuzz_report.read_text()) if fuzz_report.exists() else {}
        iso = json.loads(iso_report.read_text()) if iso_report.exists() else {}
        surfaces = json.loads(surfaces_report.read_text()) if surfaces_report.exists() else {}
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(),
            "cpus": os.cpu_count(), "command": " ".join(["benchmarks/reliability/bench_fuzz.py", *sys.argv[1:]]),
            "pytest_exit_code": rc, "seconds": round(seconds, 1)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fuzz.json").write_text(json.dumps({**meta, **fuzz, "surfaces": surfaces, "failures": int(rc != 0)},
                                                  indent=1) + "\n")
    (RESULTS / "isolation.json").write_text(json.dumps({**meta, **iso, "failures": int(rc != 0)}, indent=1) + "\n")
    checks = {c: n for c, n in surfaces.get("cases", {}).items() if c.startswith("caller memory:")}
    rows = [("what", "count"), ("fuzz cases (RPC calls), every RPC", str(fuzz.get("total_cases", "?"))),
            ("fuzz cases (RPC calls), the newer surfaces (issue 27)",
             str(surfaces.get("total_cases", 0) - sum(checks.values())) if surfaces else "?"),
            *((f"  {c}", str(n)) for c, n in sorted(checks.items())),
            ("  of which INTERNAL/UNKNOWN", "0" if rc == 0 else "see the pytest output"),
            ("cross-tenant attempts refused", str(iso.get("refused", "?"))),
            ("pytest exit code", str(rc)), ("seconds", f"{seconds:.0f}")]
    width = max(len(r[0]) for r in rows)
    print("\n".join(f"{a:<{width}}  {b}" for a, b in rows))
    for case, codes in sorted(surfaces.get("by_case", {}).items()):
        print(f"  {case}: " + ", ".join(f"{n:,} {c}" for c, n in sorted(codes.items(), key=lambda x: -x[1])))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
