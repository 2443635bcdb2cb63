"""Agent workload at the real geometry and at tiny-16: kvstore's persistence vs a V4-Flash-style one.

    python benchmarks/agent/bench_agent_workload.py [--sessions 80] [--quick]

A seeded synthetic agent workload (benchmarks/agent/agent_workload_trace.py: a shared 2,000-token
system prompt, multi-turn growth with model and tool outputs, pauses with eviction to the ssd tier
and resumes, sessions deleted or expiring by TTL) is driven step by step into four real daemons at
once (``kvstore serve --port 0``, a small host tier so that evictions happen), one per
(geometry, policy); benchmarks/agent/agent_workload_store.py says what each policy saves. Every store
sees every event at the same wall-clock moment, so TTLs expire alike. Bytes at rest are sampled
along the way (``du`` of each data dir, and the daemon's Stats); at the end the script waits for
the daemons' maintenance pass (every 30 s) to reclaim the expired sessions, then reports.
Writes benchmarks/results/agent_workload.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.agent.agent_workload_chunks import mixed_codes_zstd
from benchmarks.agent.agent_workload_report import report
from benchmarks.agent.agent_workload_store import Store, StoreSpec, du_bytes
from benchmarks.agent.agent_workload_trace import TraceConfig, build_trace, token_ids
from benchmarks.common import RESULTS, git_state, machine
from kvstore.format.layout import get_layout

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
PREFETCH_PAUSE_S = 0.05
RECLAIM_WAIT_S = 35.0  # the daemon's maintenance pass runs every 30 s


def specs(host_mib_real: int, host_mib_tiny: int) -> list[StoreSpec]:
    real, v4, tiny = get_layout("deepseek-v4.1-flash"), get_layout("deepseek-v4-flash"), get_layout("tiny-16")
    return [
        StoreSpec("real / kvstore", "real", "kvstore", real, None, 0, host_mib_real * MIB),
        StoreSpec("real / V4-Flash-style", "real", "v4", v4, v4, v4.swa_state_bytes, host_mib_real * MIB),
        StoreSpec("tiny-16 / kvstore", "tiny-16", "kvstore", tiny, None, 0, host_mib_tiny * MIB),
        StoreSpec("tiny-16 / + SWA snapshots", "tiny-16", "v4", tiny, tiny, tiny.swa_state_bytes,
                  host_mib_tiny * MIB),
    ]


def sample(stores: list[Store], step: int, t0: float) -> dict:
    row: dict = {"step": step, "t": time.perf_counter() - t0}
    for st in stores:
        s = st.client.stats()
        b = s.bytes_per_token
        row[st.spec.name] = {"du": du_bytes(st.data_dir)[0], "stored": b.stored + b.lmdb_overhead}
    return row


def run(args: argparse.Namespace, root: Path) -> dict:
    cfg = TraceConfig(sessions=args.sessions, seed=args.seed)
    trace = build_trace(cfg)
    stores = [Store(sp, root / sp.name.replace(" / ", "-").replace(" ", "_")) for sp in
              specs(args.host_mib, args.host_mib // 4)]
    codes_zstd, codes_share = mixed_codes_zstd(stores[1].maker)
    prefetch = all(hasattr(st.client, "prefetch") for st in stores)
    ids: dict[int, np.ndarray] = {}
    series, resumes, t0 = [], 0, time.perf_counter()
    every = max(1, len(trace) // 40)
    ttl_refs = {st.spec.name: 0 for st in stores}
    try:
        for i, ev in enumerate(trace):
            if ev.kind in ("start", "grow"):
                prev = ids.get(ev.session, np.empty(0, np.uint32))
                ids[ev.session] = np.concatenate([prev, token_ids(cfg, ev.session, len(prev), ev.tokens)])
                for st in stores:
                    st.save_turn(ev.session, ids[ev.session], len(prev))
            elif ev.kind == "pause":
                for st in stores:
                    st.pause(ev.session)
            elif ev.kind == "resume":
                use = prefetch and resumes % 2 == 1
                resumes += 1
                for st in stores:
                    st.resume(ev.session, use, PREFETCH_PAUSE_S)
            elif ev.kind == "finish":
                for st in stores:
                    if ev.fate == "ttl":
                        ttl_refs[st.spec.name] += 1 + len(st.snapshots.get(ev.session, []))
                    st.finish(ev.session, ev.fate, cfg.ttl_s)
            if i % every == 0:
                series.append(sample(stores, i, t0))
        series.append(sample(stores, len(trace), t0))
        workload_s = time.perf_counter() - t0
        deadline = time.perf_counter() + (0 if args.quick else RECLAIM_WAIT_S)
        while (any(st.expired_reclaimed() < ttl_refs[st.spec.name] for st in stores)
               and time.perf_counter() < deadline):
            time.sleep(0.5)
        reclaimed = {st.spec.name: [st.expired_reclaimed(), ttl_refs[st.spec.name]] for st in stores}
        series.append(sample(stores, len(trace), t0))
        final = {}
        for st in stores:
            s = st.client.stats()
            alloc, apparent = du_bytes(st.data_dir)
            b = s.bytes_per_token
            final[st.spec.name] = {
                "spec": {k: v for k, v in asdict(st.spec).items() if k not in ("layout", "snapshot_layout")}
                | {"layout": st.spec.layout.name,
                   "snapshot_layout": st.spec.snapshot_layout.name if st.spec.snapshot_layout else None,
                   "snapshot_shape": list(st.snap_shape)},
                "du": alloc, "du_apparent": apparent,
                "bpt": {f: getattr(b, f) for f in ("tokens", "sessions", "unique_chunks", "formula", "payload",
                                                    "chunk_overhead", "manifests", "stored", "raw",
                                                    "lmdb_overhead", "measured")},
                "tiers": [{"name": t.name, "hits": t.hits, "items": t.items, "used_bytes": t.used_bytes,
                           "capacity_bytes": t.capacity_bytes, "evictions": t.evictions, "demotions": t.demotions,
                           "promotions": t.promotions} for t in s.tiers],
                "loaded_chunks": s.loaded_chunks, "missed_chunks": s.missed_chunks,
                "prefetch": {k: int(getattr(s.prefetch, k)) for k in ("requested", "completed", "chunks_promoted",
                                                                     "coalesced", "dropped", "chunks_skipped")}
                if prefetch else {},
                "live": st.live_bytes(), "sent": st.sent, "written": st.written, "resumes": st.resumes,
            }
    finally:
        for st in stores:
            st.close()
    kinds = {k: sum(1 for e in trace if e.kind == k) for k in ("start", "grow", "pause", "resume", "finish")}
    fates = {f: sum(1 for e in trace if e.fate == f) for f in ("keep", "delete", "ttl")}
    return {"config": asdict(cfg), "events": len(trace), "kinds": kinds, "fates": fates,
            "boundaries": kinds["start"] + kinds["grow"], "tokens_written": int(sum(len(v) for v in ids.values())),
            "codes_zstd": codes_zstd, "codes_share": codes_share,
            "workload_s": workload_s, "prefetch_available": prefetch, "prefetch_pause_s": PREFETCH_PAUSE_S,
            "reclaimed": reclaimed, "series": series, "final": final}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=None, help="default 80, --quick 5")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--host-mib", type=int, default=64, help="host tier of the real-geometry daemons (tiny: 1/4)")
    ap.add_argument("--quick", action="store_true", help="a smoke run (< 30 s), written to the temp dir")
    ap.add_argument("--out-dir", type=Path, default=None, help=f"where the results go (default {RESULTS})")
    args = ap.parse_args()
    args.sessions = args.sessions or (5 if args.quick else 80)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=REPO.parent, prefix="bench-agents-") as tmp:
        res = run(args, Path(tmp))
    res |= {"command": " ".join(["python", "benchmarks/agent/bench_agent_workload.py", *sys.argv[1:]]),
            "machine": machine(), "git": git_state(("kvstore", "benchmarks")),
            "runtime_s": time.perf_counter() - started}
    name = "agent_workload_quick" if args.quick else "agent_workload"
    out_dir = args.out_dir or (Path(tempfile.gettempdir()) if args.quick else RESULTS)
    md = report(res, out_dir / f"{name}.png")
    (out_dir / f"{name}.json").write_text(json.dumps(res, indent=1))
    (out_dir / f"{name}.md").write_text(md)
    print(md)
    print(f"wrote {out_dir / name}.{{md,json,png}} in {res['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
