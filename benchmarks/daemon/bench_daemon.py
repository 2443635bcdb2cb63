"""Session save and load through the kvstore daemon, against the machine's ceilings on the same bytes.

    python benchmarks/daemon/bench_daemon.py [--quick] [--sizes-mib 1,4,16,64] [--clients 1,8] [--repeats 5]

One run starts a real daemon (port 0, temp data dir, default config), its own redis-server, the
trivial gRPC servers of ``benchmarks/daemon/ceilings.py`` and one process per client, and measures, per
session size and client count, interleaved round by round: kvstore save/load over every path in
``KV_PATHS``, the raw gRPC stream at every configuration, one unary round trip, memcpy, redis-py and
LMDB on the same chunk blobs; plus the disk's ``dd oflag=direct conv=fsync`` bandwidth. It states
each target of issue 10 as a ratio measured in this run and writes results/daemon.{md,json,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import common
from benchmarks.common import RESULTS, Stamps, machine, markdown_table, write_result
from benchmarks.daemon import ceilings
from benchmarks.daemon.ceilings import Combo, Op, Rows
from kvstore.client import Client
from kvstore.format import chunk
from kvstore.format.keys import chain_keys
from kvstore.format.layout import get_layout
from kvstore.format.manifest import Manifest

LAYOUT = "deepseek-v4.1-flash"
CHUNK_TOKENS = 256
ARENA_BYTES = 80 << 20
BIG_ROW_MIB = 128  # rows moving this much per op (size x clients) get 3 rounds, no warm-up round
WARM_BYTES = 16 << 20  # each channel (kvstore's and the ceilings') is warmed with 4 calls of this much


# -- the kvstore paths under test: edit this table when the client's API changes --------------------
@dataclass(frozen=True)
class KvPath:
    """One way a kvstore ``Client`` moves chunk data."""

    name: str
    same_host: bool  # judged against memcpy and redis; otherwise against the raw gRPC ceiling
    client: Mapping[str, Any]  # Client(address=..., **client)
    load: Mapping[str, Any]  # client.load_session(namespace, session_id, **load)


KV_PATHS = (
    KvPath("grpc", False, {"shared_memory": False}, {}),
    KvPath("arena", True, {"shared_memory": True, "arena_bytes": ARENA_BYTES}, {"zero_copy": True}),
)
LOAD_BASE = ("redis GET xN", "redis GET 1", "lmdb get")
SAVE_BASE = ("redis SET xN", "redis SET 1", "lmdb put+fsync")


def open_client(address: str, path: KvPath) -> Client:
    """A connected client for ``path``; raises when this client or daemon does not offer it."""
    c = Client(address=address, **path.client)
    c.info()
    if getattr(c, "uses_shared_memory", path.same_host) != path.same_host:
        c.close()
        raise RuntimeError("the daemon did not offer the same-host path")
    return c


def save_turn(c: Client, ns: str, manifest: Manifest, blobs: list[bytes]) -> None:
    """A durable turn save: the new chunks and the manifest, in one call (``base=0``: whatever is
    stored is replaced; the clients save and delete one session in turn, a race is not measured)."""
    if manifest.namespace != ns:
        raise RuntimeError(f"the manifest is under {manifest.namespace!r}, not {ns!r}")
    if c.save_session(manifest, blobs, base=0).written != len(blobs):
        raise RuntimeError("chunks were already stored: the save would not be measured")


def load_blobs(c: Client, ns: str, session_id: str, path: KvPath) -> list[Any]:
    """Every blob of a session (for arena loads: views, valid until the next call)."""
    _, it = c.load_session(ns, session_id, **path.load)
    return [b for _, b in it]


# -- data ---------------------------------------------------------------------------------------------
def rekey(template: bytes, namespace: str) -> tuple[list[bytes], list[bytes], np.ndarray]:
    """The template's chunks (made once by ``common.chunk_session``, seed 0) with keys chained under
    ``namespace`` (content-addressed keys would dedupe clients' saves): (blobs, keys, token ids)."""
    lay = get_layout(LAYOUT)
    size = chunk.encoded_size(lay, CHUNK_TOKENS)
    decoded = [chunk.decode(template[o:o + size], lay) for o in range(0, len(template), size)]
    ids = np.concatenate([c.token_ids for c in decoded])
    keys = chain_keys(lay.layout_id, namespace, ids, CHUNK_TOKENS)
    return [chunk.encode(lay, key=k, start=c.start, token_ids=c.token_ids, entries=c.entries)
            for k, c in zip(keys, decoded)], keys, ids


def manifest_for(ns: str, session_id: str, keys: list[bytes], ids: np.ndarray,
                 chunk_tokens: int = CHUNK_TOKENS) -> Manifest:
    """A manifest of exactly the given complete chunks (an empty trailing span)."""
    lay = get_layout(LAYOUT)
    tokens = len(keys) * chunk_tokens
    ents = {c.name: chunk.Entries(np.zeros((0, c.code_bytes), np.uint8), np.zeros((0, c.scale_bytes), np.uint8))
            for c in lay.caches}
    tail = chunk.encode(lay, key=bytes(16), start=tokens, token_ids=np.zeros(0, np.uint32), entries=ents)
    return Manifest(session_id, ns, lay.layout_id, tokens, chunk_tokens, tuple(keys), tail,
                    tuple(int(t) for t in ids[max(0, tokens - 128):tokens]))


# -- one client process ---------------------------------------------------------------------------------
class Worker:
    """One benchmark client: its own namespace, a kvstore Client per offered path, channels to the
    trivial gRPC servers, a redis connection and an LMDB environment."""

    def __init__(self, idx: int, template: Path, daemon: str, redis_port: int, ceiling_ports: dict[str, int],
                 tmp: Path) -> None:
        import lmdb
        import redis

        self.ns = f"bench{idx}"
        self.blobs, self.keys, self.ids = rekey(template.read_bytes(), self.ns)
        self.clients: dict[str, Client] = {}
        self.missing: dict[str, str] = {}  # path -> why it is n/a
        for p in KV_PATHS:
            try:
                self.clients[p.name] = open_client(daemon, p)
            except Exception as e:  # a path this client or daemon no longer offers is n/a, not a crash
                self.missing[p.name] = f"{type(e).__name__}: {e}"
        self.paths = [p for p in KV_PATHS if p.name in self.clients]
        self.redis = redis.Redis(host="127.0.0.1", port=redis_port)
        self.lmdb = lmdb.open(str(tmp / f"lmdb{idx}"), map_size=1 << 30)  # sync=True: commit fsyncs
        self.grpc = ceilings.GrpcCeiling(ceiling_ports, min(WARM_BYTES, sum(map(len, self.blobs))))
        n = max(1, min(len(self.blobs), WARM_BYTES // len(self.blobs[0])))
        warm = manifest_for(self.ns, "warm", self.keys[:n], self.ids)
        for p in self.paths:  # the same warm-up as the ceilings' channels get
            c = self.clients[p.name]
            save_turn(c, self.ns, warm, self.blobs[:n])
            for _ in range(4):
                load_blobs(c, self.ns, "warm", p)
            c.delete_session(self.ns, "warm")

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.grpc.close()
        self.redis.close()
        self.lmdb.close()

    def run(self, n: int, sync: Op, warmup: int, repeats: int, combos: list[Combo]) -> dict[str, Stamps]:
        """Stamps of every op on an n-chunk session: durable saves (each followed by an untimed
        delete), then loads, raw gRPC streams, memcpy and unary round trips, interleaved by round."""
        blobs, keys, c0 = self.blobs[:n], self.keys[:n], self.clients.get(self.paths[0].name) if self.paths else None
        nbytes = sum(map(len, blobs))

        def expect(got: int) -> None:
            if got != nbytes:
                raise RuntimeError(f"read {got} bytes, expected {nbytes}")

        manifest = manifest_for(self.ns, "s", keys, self.ids)
        red = ceilings.redis_ops(self.redis, keys, blobs, expect)
        put, get, drop = ceilings.lmdb_ops(self.lmdb, keys, blobs, expect)
        saves: dict[str, tuple[Op, Op | None]] = {
            **{f"save {p.name}": (lambda c=self.clients[p.name]: save_turn(c, self.ns, manifest, blobs),
                                  lambda c=self.clients[p.name]: c.delete_session(self.ns, "s")) for p in self.paths},
            **{k: (v, None) for k, v in red.items() if k.startswith("save")}, "save lmdb put+fsync": (put, drop)}
        loads: dict[str, Op] = {
            **{f"load {p.name}": lambda c=self.clients[p.name], p=p: expect(sum(map(len, load_blobs(c, self.ns, "s",
                                                                                                    p))))
               for p in self.paths},
            **{k: v for k, v in red.items() if k.startswith("load")}, "load lmdb get": get,
            "memcpy": ceilings.memcpy(b"".join(blobs)),
            **{f"ceil {cb.label}": lambda cb=cb: self.grpc.load(cb, nbytes) for cb in combos},
            **{f"unary {s}": self.grpc.unary(s) for s in ceilings.SERVERS}}
        if hasattr(c0, "health"):  # kvstore's own trivial round trip, where the client offers one
            loads["kvstore health"] = c0.health
        res = common.interleaved(saves, sync, warmup, repeats)
        put()  # what the loads read: LMDB's keys and kvstore's session (hot in the daemon's host tier)
        if c0 is not None:
            save_turn(c0, self.ns, manifest, blobs)
        for p in self.paths:
            if [bytes(b) for b in load_blobs(self.clients[p.name], self.ns, "s", p)] != blobs:
                raise RuntimeError(f"{p.name}: loaded bytes differ from the saved ones")
        res |= common.interleaved({k: (v, None) for k, v in loads.items()}, sync, warmup, repeats)
        drop()
        if c0 is not None:
            c0.delete_session(self.ns, "s")
        return res


def worker_main(idx: int, barriers: dict[int, Barrier], template: Path, daemon: str, redis_port: int,
                ceiling_ports: dict[str, int], tmp: Path, conn: Connection) -> None:
    torch.set_num_threads(1)
    try:
        w = Worker(idx, template, daemon, redis_port, ceiling_ports, tmp)
        conn.send(("ok", w.missing))
        while (msg := conn.recv()) is not None:
            n, clients, warmup, repeats, combos = msg
            sync = (lambda b=barriers[clients]: b.wait(300)) if clients > 1 else (lambda: None)
            conn.send(("ok", w.run(n, sync, warmup, repeats, combos)))
        w.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


# -- report ------------------------------------------------------------------------------------------
def report(run: dict[str, Any], with_plot: bool) -> list[Path]:
    nan, sizes = float("nan"), {int(m): b for m, b in run["sizes"].items()}
    mb = {m: b / 1e6 for m, b in sizes.items()}
    med: Rows = {(r["mib"], r["clients"]): {k: statistics.median(v) for k, v in r["walls_s"].items()}
                 for r in run["results"]}
    gbps: Rows = {(m, nc): {k: nc * sizes[m] / t / 1e9 for k, t in r.items()} for (m, nc), r in med.items()}
    lat_row = (min(sizes), min(run["clients"]))
    p50, dd = med[lat_row], statistics.median(run["dd_gbps"])
    tgts = ceilings.targets(gbps, p50, dd, [p.name for p in KV_PATHS if not p.same_host],
                            [p.name for p in KV_PATHS if p.same_host])
    kv = [p.name for p in KV_PATHS]
    cols = {"load": [*(f"load {k}" for k in kv), "gRPC ceiling", "memcpy", *(f"load {b}" for b in LOAD_BASE)],
            "save": [*(f"save {k}" for k in kv), *(f"save {b}" for b in SAVE_BASE)]}
    cell = lambda r, k: ceilings.best(r)[1] if k == "gRPC ceiling" else r.get(k, nan)  # noqa: E731
    rounds = {(r["mib"], r["clients"]): f"{len(r['walls_s']['memcpy'])}+{r['warmup']}" for r in run["results"]}
    tables = {op: markdown_table(["MB", "clients", "rounds", *(c.removeprefix(f"{op} ") for c in cs)],
                                 [[f"{mb[m]:.1f}", nc, rounds[(m, nc)], *(f"{cell(r, k):.2f}".replace("nan", "n/a")
                                                                         for k in cs)]
                                  for (m, nc), r in gbps.items()]) for op, cs in cols.items()}
    lat = run["results"][[(r["mib"], r["clients"]) for r in run["results"]].index(lat_row)]["walls_s"]
    best_small = "ceil " + ceilings.best(gbps[lat_row])[0]
    lat_rows = [[k, len(v), f"{statistics.median(v) * 1e3:.3f}", f"{np.percentile(v, 90) * 1e3:.3f}"]
                for k, v in lat.items() if not k.startswith("ceil ") or k == best_small]
    one = {m for m, nc in med if nc == 1}
    costs = ceilings.cost_table({m: sizes[m] for m in one}, {
        **{k: {m: med[(m, 1)][k] for m in one} for k in [*cols["load"], *cols["save"]] if k in med[lat_row]},
        "gRPC ceiling (best per size)": {m: med[(m, 1)]["ceil " + ceilings.best(gbps[(m, 1)])[0]] for m in one},
    }) if len(one) > 1 else "(needs 1 client at two sizes or more)"
    png = None
    if with_plot:
        ms = sorted(sizes)
        series = lambda nc, ks: {k: [cell(gbps[(m, nc)], k) for m in ms] for k in ks}  # noqa: E731
        role = lambda k: "kv " if k.split(" ", 1)[-1] in kv else "ceiling " if k in ("gRPC ceiling", "memcpy") else ""  # noqa: E731
        panels = {(op, nc): {role(k) + k: v for k, v in series(nc, cs).items()}
                  for op, cs in cols.items() for nc in run["clients"]}
        png = ceilings.plot(RESULTS / "daemon.png", [mb[m] for m in ms], panels,
                            {"save": {f"ceiling dd oflag=direct conv=fsync ({dd:.2f})": dd}},
                            "kvstore (solid) vs raw engines and ceilings (dashed), same bytes, same run")
    la, lb = run["load_before"], run["load_after"]
    kw = lambda d: "".join(f", {k}={v!r}" for k, v in d.items())  # noqa: E731
    paths = "; ".join(f"`{p.name}` = Client(address{kw(p.client)}), load_session(ns, id{kw(p.load)})" for p in KV_PATHS)
    health = p50.get("kvstore health", nan)
    text = f"""Session load and save through a real kvstore daemon, beside the machine's ceilings on the same
bytes in the same run: raw Python gRPC at its best configuration, memcpy, redis-py, LMDB and the
disk's fsync'd bandwidth. GB/s = session bytes (x clients) / wall seconds (GB = 1e9 B), median of
the timed rounds of a row (`rounds` = timed + untimed warm-up; interleaved, see Methodology).

Machine: {run["machine"]}; data dir on {" ".join(run["filesystem"])}.
Load average (1, 5, 15 min): {" ".join(f"{v:.2f}" for v in la)} at the start, {" ".join(f"{v:.2f}" for v in lb)}
at the end: the machine was shared with other work, so absolute numbers are noisy; ratios within this
run are what count. Code: {run["git"]}.
Command: `{run["command"]}` (whole run {run["elapsed_s"]:.0f} s). Date: {run["date"]} UTC.

## Targets (issue 10), as ratios measured in this run

{markdown_table(["target", "path", "measured ratio per case (clients)", "needed", "status"], [t.row() for t in tgts])}
{"".join(f"{chr(10)}- `{k}` is n/a: {why}" for k, why in run["n/a"].items())}
## Ceilings

{ceilings.grpc_table(gbps, mb)}

One trivial unary round trip (empty request and response) p50, {mb[lat_row[0]]:.1f} MB row: aio
{p50["unary aio"] * 1e6:.0f} us, sync {p50["unary sync"] * 1e6:.0f} us; kvstore's health check: {health * 1e6:.0f} us.
Disk: `dd if=/dev/zero bs=4M count=64 oflag=direct conv=fsync` in the data dir's filesystem,
median {dd:.2f} GB/s (runs: {", ".join(f"{v:.2f}" for v in run["dd_gbps"])}; 3 at the start, 2 at the end).

## Load, GB/s

{tables["load"]}

## Save (durable), GB/s

{tables["save"]}

## Latency, {lat_row[1]} client(s), {mb[lat_row[0]]:.1f} MB session, ms

{markdown_table(["op", "samples", "p50", "p90"], lat_rows)}

## Per call vs per byte

Median time per op at each size (1 client), fitted as `fixed + bytes / rate` (least squares on
relative residuals; a negative fixed part means the op slows down faster than linearly with size):

{costs}
{"" if png is None else chr(10) + "![load and save GB/s](daemon.png)" + chr(10)}
## Methodology

- Data: {LAYOUT} chunks of {CHUNK_TOKENS} tokens ({run["chunk_bytes"]:,} B each), Gaussian bf16 KV
  quantized with the real FP4 codecs, seed 0; sessions are prefixes of the same chunks
  ({", ".join(f"{m} MiB = {sizes[m] // run['chunk_bytes']} chunks" for m in sorted(sizes))}), keyed under each
  client's own namespace (content-addressed keys would dedupe clients' saves).
- Clients: one process each (no shared GIL), started together at a barrier before every timed
  op; aggregate GB/s = all clients' bytes / (last finish - first start). Every op of a row runs
  once per round, rounds interleaved, so drift in the machine's load hits all columns alike.
- Warm-up: every gRPC channel (kvstore's and the trivial servers') gets 4 calls of
  {WARM_BYTES >> 20} MiB before anything is timed (HTTP/2 flow-control windows grow over a fresh
  channel's first calls), then one untimed round per row, except in rows moving >= {BIG_ROW_MIB} MiB
  per op (size x clients), which run 3 timed rounds on the channels and daemon the rows before warmed.
- kvstore paths: {paths}.
  Save = `save_session` (chunks + the manifest's commit, one call), durable (LMDB tier fsynced),
  checked to write every chunk, each followed by an untimed delete. Load = LoadSession + every blob
  iterated, from the daemon's host-memory tier, checksums verified by the daemon; bytes checked
  equal once per row.
{ceilings.METHODOLOGY}"""
    run |= {"gbps": [{"mib": m, "clients": nc, **r} for (m, nc), r in gbps.items()],
            "targets": [{**t._asdict(), "status": t.status} for t in tgts]}
    (RESULTS / "daemon.json").write_text(json.dumps(run, indent=1) + "\n")
    return [write_result("daemon.md", "Daemon session load and save", text.rstrip()), RESULTS / "daemon.json",
            *([png] if png else [])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 client, 1 and 4 MiB, 3 repeats")
    ap.add_argument("--sizes-mib", default="1,4,16,64")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--latency-rounds", type=int, default=40, help="rounds of the smallest session, fewest clients")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--from-json", type=Path, help="rewrite the report from a run's daemon.json; measure nothing")
    args = ap.parse_args()
    if args.from_json:
        for path in report(json.loads(args.from_json.read_text()), with_plot=not args.no_plot):
            print(f"wrote {path}")
        return
    if args.quick:
        args.sizes_mib, args.clients, args.repeats, args.latency_rounds = "1,4", "1", 3, 15
    began, load_before = time.perf_counter(), os.getloadavg()
    torch.set_num_threads(1)
    chunk_bytes = chunk.encoded_size(get_layout(LAYOUT), CHUNK_TOKENS)
    size_chunks = {m: max(1, round((m << 20) / chunk_bytes)) for m in map(int, args.sizes_mib.split(","))}
    clients = sorted(map(int, args.clients.split(",")))
    # forkserver: the clients fork from a clean process that imported this module once (fast start),
    # and no grpc channel or OpenMP state of this process crosses into them
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["benchmarks.daemon.bench_daemon", "redis", "lmdb"])

    from kvstore.server.process import DaemonProcess

    tmp = Path(tempfile.mkdtemp(prefix="bench-daemon-"))
    redis_proc = daemon = None
    procs: list[tuple[Any, Connection]] = []  # trivial gRPC servers and client processes: all stop on None
    run: dict[str, Any] = {"sizes": {m: n * chunk_bytes for m, n in size_chunks.items()}, "clients": clients,
                           "chunk_bytes": chunk_bytes, "paths": [p.name for p in KV_PATHS], "results": []}
    try:
        chunks = common.chunk_session(get_layout(LAYOUT), "gen", max(size_chunks.values()), CHUNK_TOKENS, seed=0)[0]
        (tmp / "session.bin").write_bytes(b"".join(chunks))
        procs += [common.start(ctx, ceilings.serve, kind, tmp / "session.bin") for kind in ceilings.SERVERS]
        ports = {kind: conn.recv() for kind, (_, conn) in zip(ceilings.SERVERS, procs)}
        run["dd_gbps"] = ceilings.dd_fsync_gbps(tmp, runs=3)
        run["filesystem"] = subprocess.run(["df", "--output=source,fstype", str(tmp)], capture_output=True,
                                           text=True).stdout.split("\n")[1].split()
        redis_proc = ceilings.start_redis(redis_port := ceilings.free_port())
        daemon = DaemonProcess(tmp / "daemon", ["--log-level", "WARNING"]).start()
        barriers = {n: ctx.Barrier(n) for n in clients if n > 1}
        workers = [common.start(ctx, worker_main, i, barriers, tmp / "session.bin", daemon.address, redis_port, ports,
                                tmp) for i in range(max(clients))]
        procs += workers
        run["n/a"] = {k: v for _, conn in workers for k, v in common.answer(conn).items()}
        print(f"{len(workers)} clients ready, n/a: {run['n/a'] or 'none'} ({time.perf_counter() - began:.0f} s)")
        for mib, n in sorted(size_chunks.items()):
            for nc in clients:
                t, first = time.perf_counter(), (mib, nc) == (min(size_chunks), clients[0])
                combos = ceilings.combos(ceilings.ENCODINGS if nc == 1 else ("raw",))
                # rounds: many for the latency row; few for the heaviest rows (each op moves >= 128 MiB
                # there, so it is long and steady, and every channel is warm from the rows before)
                warmup, repeats = args.warmup, max(args.repeats, args.latency_rounds) if first else args.repeats
                if mib * nc >= BIG_ROW_MIB:
                    warmup, repeats = 0, min(3, args.repeats)
                for _, conn in workers[:nc]:
                    conn.send((n, nc, warmup, repeats, combos))
                stamps = [common.answer(conn) for _, conn in workers[:nc]]
                ops = {k: common.walls([s[k] for s in stamps]) for k in stamps[0]}
                run["results"].append({"mib": mib, "bytes": n * chunk_bytes, "clients": nc, "warmup": warmup,
                                       "walls_s": ops})
                gbps = {k: nc * n * chunk_bytes / statistics.median(v) / 1e9 for k, v in ops.items()}
                print(f"{mib} MiB x {nc} ({time.perf_counter() - t:.0f} s): " + ", ".join(
                    f"{k} {v:.2f}" for k, v in gbps.items() if k.startswith(("load", "save", "memcpy")))
                      + ", ceiling {} {:.2f}".format(*ceilings.best(gbps)), flush=True)
        run["dd_gbps"] += ceilings.dd_fsync_gbps(tmp, runs=2)  # again: the disk is shared too
    finally:
        for proc, conn in reversed(procs):  # clients first, then the servers they talk to
            with contextlib.suppress(OSError):
                conn.send(None)
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        if daemon is not None:
            daemon.stop()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    run |= {"load_before": load_before, "load_after": os.getloadavg(), "elapsed_s": time.perf_counter() - began,
            "command": " ".join(["python benchmarks/daemon/bench_daemon.py", *sys.argv[1:]]), "args": vars(args),
            "date": f"{datetime.now(UTC):%Y-%m-%d %H:%M}", "git": common.git_state(),
            "machine": f"{machine()}, {mp.cpu_count()} cores"}
    for path in report(run, with_plot=not args.no_plot):
        print(f"wrote {path}")
    print(f"run took {run['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
