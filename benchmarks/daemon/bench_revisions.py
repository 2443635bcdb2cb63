"""Two revisions of the daemon side by side, in one run: did a change make saves and loads faster?

    python benchmarks/daemon/bench_revisions.py --base e3755c0 [--sizes-mib 1,16] [--clients 1,8] [--rounds 100]
    python benchmarks/daemon/bench_revisions.py --base ../base   # a checkout of the base, its extensions built

On a shared, noisy machine two runs of bench_daemon.py an hour apart differ by more than most
changes do. This starts one daemon from ``--base`` (a git worktree in a temp dir; or, given a
directory, that checkout as it is: a temp worktree has no C extensions built, so its daemon verifies
in Python) and one from the working tree, and times the same ops against both, alternating round
by round, so drift in the machine hits both alike: a durable turn save (then an untimed delete) and a load, over the
same-host path (arena + local socket, and into the caller's own buffer) and over gRPC, with 1
and N client processes (the client
code is the working tree's in both cases: only the daemon differs). A raw LMDB put+fsync of the
same bytes is timed in the same rounds, for scale. Writes results/revisions.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import common
from benchmarks.common import RESULTS, machine, markdown_table, write_result
from benchmarks.daemon import bench_daemon as bd
from benchmarks.daemon import ceilings
from kvstore.format import chunk
from kvstore.format.layout import get_layout
from kvstore.server.process import DaemonProcess

ROOT = Path(__file__).resolve().parents[2]


def start_daemon(tree: Path, data_dir: Path) -> DaemonProcess:
    """A daemon of the code in ``tree`` (its own ``cli`` and ``kvstore`` packages)."""
    return DaemonProcess(data_dir, ["--log-level", "WARNING"], cwd=tree,
                         env={**os.environ, "PYTHONPATH": str(tree)}).start()


def worker(idx: int, addresses: dict[str, str], template: Path, n_chunks: int, rounds: int, barrier: Barrier | None,
           conn: Connection) -> None:
    """One client process: per round, for each path and revision, a timed save and a timed load."""
    import lmdb

    try:
        torch.set_num_threads(1)
        ns = f"rev{idx}"
        blobs, keys, ids = bd.rekey(template.read_bytes(), ns)
        blobs, keys = blobs[:n_chunks], keys[:n_chunks]
        manifest = bd.manifest_for(ns, "s", keys, ids)
        out = bytearray(sum(len(b) for b in blobs))  # load_session_into's buffer, the caller's own
        clients = {(p.name, rev): bd.open_client(addr, p) for p in bd.KV_PATHS for rev, addr in addresses.items()}
        env = lmdb.open(str(template.parent / f"raw{idx}"), map_size=1 << 30)
        put, _, drop = ceilings.lmdb_ops(env, keys, blobs, lambda n: None)
        sync = barrier.wait if barrier is not None else (lambda: None)
        stamps: dict[str, list[tuple[float, float]]] = {}

        def timed(name: str, op: Any) -> None:
            sync()
            t = time.perf_counter()
            op()
            stamps.setdefault(name, []).append((t, time.perf_counter()))

        for r in range(rounds + 1):  # round 0 warms every channel and daemon, untimed
            for (path, rev), c in clients.items():
                p = next(k for k in bd.KV_PATHS if k.name == path)
                timed(f"save {path} {rev}", lambda c=c: bd.save_turn(c, ns, manifest, blobs))
                timed(f"load {path} {rev}", lambda c=c, p=p: bd.load_blobs(c, ns, "s", p))
                if p.same_host:  # and into the caller's memory (the daemon writes there itself)
                    timed(f"load into {rev}", lambda c=c: c.load_session_into(ns, "s", out))
                c.delete_session(ns, "s")
            timed("lmdb put+fsync", put)
            drop()
            if r == 0:
                stamps.clear()
        for c in clients.values():
            c.close()
        env.close()
        conn.send(("ok", stamps))
    except BaseException:
        import traceback

        conn.send(("error", traceback.format_exc()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git revision (or a checkout's directory) to compare the "
                                                  "working tree against")
    ap.add_argument("--sizes-mib", default="1,16")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    began = time.perf_counter()
    torch.set_num_threads(1)
    lay = get_layout(bd.LAYOUT)
    chunk_bytes = chunk.encoded_size(lay, bd.CHUNK_TOKENS)
    sizes = {m: max(1, round((m << 20) / chunk_bytes)) for m in map(int, args.sizes_mib.split(","))}
    clients = sorted(map(int, args.clients.split(",")))
    checkout = Path(args.base) if Path(args.base).is_dir() else None
    base_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD" if checkout else args.base], cwd=checkout or ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    head_rev = common.git_state()
    tmp = Path(tempfile.mkdtemp(prefix="bench-revs-"))
    tree = checkout.resolve() if checkout else tmp / "base"
    if checkout is None:
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), base_rev], cwd=ROOT, check=True)
    daemons: dict[str, DaemonProcess] = {}
    rows: list[dict[str, Any]] = []
    try:
        chunks = common.chunk_session(lay, "gen", max(sizes.values()), bd.CHUNK_TOKENS, seed=0)[0]
        (tmp / "session.bin").write_bytes(b"".join(chunks))
        daemons = {"base": start_daemon(tree, tmp / "d-base"), "head": start_daemon(ROOT, tmp / "d-head")}
        addresses = {rev: d.address for rev, d in daemons.items()}
        ctx = mp.get_context("spawn")
        for mib, n in sorted(sizes.items()):
            for nc in clients:
                rounds = args.rounds if mib * nc < 64 else max(5, args.rounds // 6)
                barrier = ctx.Barrier(nc) if nc > 1 else None
                procs = [common.start(ctx, worker, i, addresses, tmp / "session.bin", n, rounds, barrier)
                         for i in range(nc)]
                stamps = [common.answer(conn) for _, conn in procs]
                for p, _ in procs:
                    p.join()
                med = {k: statistics.median(common.walls([s[k] for s in stamps])) for k in stamps[0]}
                rows.append({"mib": mib, "bytes": n * chunk_bytes, "clients": nc, "rounds": rounds, "p50_s": med})
                print(f"{mib} MiB x {nc}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in med.items()), flush=True)
    finally:
        for d in daemons.values():
            d.stop()
        if checkout is None:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    table = []
    for r in rows:
        for op in ("save", "load"):
            for path in (p.name for p in bd.KV_PATHS):
                b, h = r["p50_s"][f"{op} {path} base"], r["p50_s"][f"{op} {path} head"]
                table.append([f"{r['bytes'] / 1e6:.1f}", r["clients"], r["rounds"], f"{op} {path}", f"{b * 1e3:.2f}",
                              f"{h * 1e3:.2f}", f"{b / h:.2f}x"])
        b, h = r["p50_s"]["load into base"], r["p50_s"]["load into head"]
        table.append([f"{r['bytes'] / 1e6:.1f}", r["clients"], r["rounds"], "load into caller memory", f"{b * 1e3:.2f}",
                      f"{h * 1e3:.2f}", f"{b / h:.2f}x"])
        table.append([f"{r['bytes'] / 1e6:.1f}", r["clients"], r["rounds"], "lmdb put+fsync (scale)",
                      f"{r['p50_s']['lmdb put+fsync'] * 1e3:.2f}", "", ""])
    command = "python benchmarks/daemon/bench_revisions.py " + " ".join(sys.argv[1:])
    text = f"""The daemon at {base_rev} (base) and at {head_rev} (head) side by side, alternating round by round
in one run (benchmarks/daemon/bench_revisions.py's docstring says how). Times are medians of the rounds,
wall time of the whole group of clients; "speed-up" = base / head.

Machine: {machine()}. Load average at the end: {" ".join(f"{v:.2f}" for v in os.getloadavg())}.
Command: `{command}` ({time.perf_counter() - began:.0f} s). Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.

{markdown_table(["MB", "clients", "rounds", "op", "base ms", "head ms", "speed-up"], table)}
"""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "revisions.json").write_text(json.dumps({"base": base_rev, "head": head_rev, "rows": rows}, indent=1))
    print(f"wrote {write_result('revisions.md', 'Two daemon revisions, one run', text.rstrip())}")


if __name__ == "__main__":
    main()
