"""Does another tenant's cache show in a load's timing? Tenant B's LoadChunks of tenant A's cached keys
against the same call for made-up keys, over gRPC, interleaved (issue 27, item 2).

    python benchmarks/reliability/bench_timing_oracle.py --label after --write   # the figures timing_oracle.md quotes
    python benchmarks/reliability/bench_timing_oracle.py --rounds 300            # a quick look

A real daemon with a tokens file (team-a, team-b, an admin). Tenant A saves sessions of token-chain
chunks and engine page blobs (a registered page layout) and loads them, so that every one sits in
the memory tier. Then, in each round, in a random order: B asks ``LoadChunks(namespace="team-b")``
for one of A's keys (A's namespace name and a guessed prompt are enough to compute it) and for a
made-up key of the same shape; both must answer the same (no chunk). Over gRPC, and over the local
socket (which has no quick path). A null pair (made-up against made-up) shows what "no difference"
looks like on this box.

Per pair: the median of each side, the difference of medians, and a two-sided Mann-Whitney U test
(normal approximation, tie-corrected). Indistinguishable: p well above 0.05 and a difference of
medians within the noise of this shared 2-core box. Prints one table; with ``--write`` merges the
run, under ``--label``, into ``benchmarks/results/timing_oracle.json`` and renders ``timing_oracle.md``
from every label there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import grpc
import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from benchmarks.common import markdown_table, results_dir  # noqa: E402
from benchmarks.reliability.workload import CHUNK_TOKENS, version  # noqa: E402
from kvstore.client import Client  # noqa: E402
from kvstore.engines.vllm.geometry import page_layout, v41_groups  # noqa: E402
from kvstore.format import page  # noqa: E402
from kvstore.format.manifest import Kind, Manifest, Retention  # noqa: E402
from kvstore.server.process import DaemonProcess, clean_env  # noqa: E402
from kvstore.transport import local_channel  # noqa: E402
from kvstore.v1 import kvstore_pb2 as pb  # noqa: E402
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc  # noqa: E402

RESULTS = results_dir(sys.argv, os.environ)  # benchmarks/results/ with --write, else benchmarks/out/
TOKENS = '[tokens]\n"tok-a" = ["team-a"]\n"tok-b" = ["team-b"]\n"tok-admin" = ["*"]\n'
A, B = "team-a", "team-b"
PAGES = page_layout("bench/timing-oracle", "nvfp4_ds_mla", "mxfp4", v41_groups(), 4096, 1, {})


def mann_whitney_p(x: Sequence[float], y: Sequence[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test (normal approximation with tie correction: both
    samples here hold hundreds of values)."""
    n1, n2 = len(x), len(y)
    ranked = sorted([(v, 0) for v in x] + [(v, 1) for v in y])
    ranks = [0.0] * len(ranked)
    ties = 0.0
    i = 0
    while i < len(ranked):
        j = i
        while j + 1 < len(ranked) and ranked[j + 1][0] == ranked[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        t = j - i + 1
        ties += t ** 3 - t
        i = j + 1
    r1 = sum(r for r, (_, side) in zip(ranks, ranked) if side == 0)
    u = r1 - n1 * (n1 + 1) / 2
    n = n1 + n2
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))))
    if sigma == 0:
        return 1.0
    z = (abs(u - n1 * n2 / 2) - 0.5) / sigma
    return math.erfc(max(z, 0.0) / math.sqrt(2))


def page_blobs(n: int) -> list[tuple[bytes, bytes]]:
    rng = np.random.default_rng(27)
    out = []
    for i in range(n):
        g = PAGES.groups[i % len(PAGES.groups)]
        h = i.to_bytes(32, "little")
        key = page.page_key(PAGES.layout_id, A, g.group, h)
        out.append((key, page.encode(PAGES, g.group, h, key, rng.integers(0, 256, g.block_bytes, dtype=np.uint8))))
    return out


def commit_hash() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def measure(rounds: int, sessions: int, data_dir: Path) -> dict[str, dict[str, float]]:
    tokens = data_dir.parent / "tokens.toml"
    tokens.write_text(TOKENS)
    d = DaemonProcess(data_dir, ["--chunk-tokens", str(CHUNK_TOKENS), "--tokens-file", str(tokens)],
                      env=clean_env(), cwd=REPO).start()
    try:
        chunk_keys: list[bytes] = []
        with Client(address=d.address, token="tok-a", shared_memory=False) as a:
            for s in range(sessions):
                v = version(s, A, f"s{s}", 2)
                a.save_session(v.manifest, list(v.blobs))
                chunk_keys += v.keys
            a.register_layout(PAGES.definition())
            items = page_blobs(2 * sessions)
            page_keys = [k for k, _ in items]
            a.save_session(Manifest("pages", A, PAGES.layout_id, len(items) * 16, 0, tuple(page_keys), b"", (),
                                    retention=Retention(ttl_s=3600), kind=Kind.ENGINE_PAGES),
                           [b for _, b in items])
            for keys in (chunk_keys, page_keys):
                assert len(list(a.load_chunks(A, keys))) == len(keys)
                where = a.lookup_keys(A, keys)
                assert set(where) == {"host"}, f"not all in the memory tier: {set(where)}"
        with grpc.insecure_channel(d.address) as channel:
            stub = pb_grpc.KVStoreStub(channel)
            local = local_channel.LocalChannel(stub.GetServerInfo(pb.GetServerInfoRequest()).local_socket)
            same_host = pb_grpc.KVStoreStub(local)

            def load(key: bytes, over: pb_grpc.KVStoreStub = stub) -> Callable[[], list[pb.ChunkData]]:
                req = pb.LoadChunksRequest(namespace=B, keys=[key])
                md = (("authorization", "Bearer tok-b"),)
                return lambda: list(over.LoadChunks(req, metadata=md, timeout=30))

            pairs: dict[str, tuple[Callable[[bytes], Callable[[], object]], list[bytes]]] = {
                "B: A's chunk key vs made-up": (load, chunk_keys),
                "B: A's page key vs made-up": (load, page_keys),
                "B, local socket: A's chunk key vs made-up": (lambda k: load(k, same_host), chunk_keys),
                "null: B, made-up vs made-up": (load, []),
            }
            rng = random.Random(27)
            times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in pairs}
            for r in range(rounds + rounds // 10):  # the first tenth: warm-up, not recorded
                for name in rng.sample(list(pairs), len(pairs)):
                    make, keys = pairs[name]
                    real, fake = make(keys[r % len(keys)] if keys else rng.randbytes(16)), make(rng.randbytes(16))
                    answers: dict[str, object] = {}
                    for side in rng.sample(["real", "fake"], 2):
                        fn = real if side == "real" else fake
                        t0 = time.perf_counter_ns()
                        answers[side] = fn()
                        dt = (time.perf_counter_ns() - t0) / 1e3
                        if r >= rounds // 10:
                            times[name][side == "fake"].append(dt)
                    if name.startswith("B"):
                        assert answers["real"] == answers["fake"] == [], answers
            local.close()
    finally:
        d.stop()
    out = {}
    for name, (real, fake) in times.items():
        out[name] = {"real_median_us": statistics.median(real), "fake_median_us": statistics.median(fake),
                     "difference_us": statistics.median(real) - statistics.median(fake),
                     "p_value": mann_whitney_p(real, fake), "samples": len(real)}
    return out


def render(runs: dict[str, dict]) -> str:
    lines = ["# Timing oracle: another tenant's cache in a load's timing (issue 27, item 2)", "",
             "Tenant B's `LoadChunks` (its own namespace; over gRPC, and once over the local socket) of tenant A's "
             "keys, which A holds in the memory tier, against the same call for made-up keys; interleaved rounds, "
             "random order within each "
             "round. Medians in microseconds (client wall time of the whole call); p: two-sided Mann-Whitney U. "
             "The null row (made-up against made-up) shows what no difference looks like on this box. Rerun: "
             "`python benchmarks/reliability/bench_timing_oracle.py --label <label> --write`.", ""]
    for label, run in runs.items():
        lines += [f"## {label}", "", f"`{run['command']}` on commit `{run['commit']}`, {run['date']}, "
                  f"{run['cpus']} CPUs shared with other work; {run['rounds']} rounds.", ""]
        rows = [(name, f"{r['samples']}", f"{r['real_median_us']:.0f}", f"{r['fake_median_us']:.0f}",
                 f"{r['difference_us']:+.0f}", f"{r['p_value']:.3g}") for name, r in run["pairs"].items()]
        lines += [markdown_table(("pair", "calls each", "real key us", "made-up key us", "difference us", "p"),
                                 rows), ""]
        if run.get("note"):
            lines += [run["note"], ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2000, help="interleaved rounds (each: every pair, both sides)")
    ap.add_argument("--sessions", type=int, default=8, help="A's sessions (3 chunks each; twice as many page blobs)")
    ap.add_argument("--label", default="run", help="the name of this run in timing_oracle.json / .md")
    ap.add_argument("--note", default="", help="a sentence printed under this run's table")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="timing-oracle-") as tmp:
        pairs = measure(args.rounds, args.sessions, Path(tmp) / "data")
    rows = [(n, f"{r['real_median_us']:.0f}", f"{r['fake_median_us']:.0f}", f"{r['difference_us']:+.0f}",
             f"{r['p_value']:.3g}") for n, r in pairs.items()]
    print(markdown_table(("pair", "real key us", "made-up key us", "difference us", "p"), rows))
    run = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(), "cpus": os.cpu_count(),
           "commit": commit_hash(), "rounds": args.rounds, "note": args.note,
           "command": " ".join(["benchmarks/reliability/bench_timing_oracle.py", *sys.argv[1:]]), "pairs": pairs}
    path = RESULTS / "timing_oracle.json"
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[args.label] = run
    path.write_text(json.dumps(runs, indent=1) + "\n")
    (RESULTS / "timing_oracle.md").write_text(render(runs) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
