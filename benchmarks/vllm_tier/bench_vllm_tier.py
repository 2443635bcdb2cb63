"""kvstore as vLLM's secondary tier vs vLLM's own file-system tier, through vLLM's own serving stack.

    .venv-vllm/bin/python benchmarks/vllm_tier/bench_vllm_tier.py [--tokens 131072] [--reps 3] [--write]

An engine is ``tests/engines/vllm_tier/harness.py``'s: the README's command line through ``EngineArgs``,
vLLM's planner, its ``Scheduler`` with the OffloadingConnector in both roles, only the GPU copy
engine and the forward emulated. Per record family (Blackwell: ``nvfp4_ds_mla`` + MXFP4 indexer;
Hopper: ``fp8_ds_mla``, 584-B records, fp8 indexer) and per side (``fs``: vLLM's
``FileSystemTierManager``; ``kvstore``: ``KVStoreTier`` and a real ``kvstore serve`` from the
project's venv, default fsync), each on a fresh directory of the same file system:

1. an engine serves one prompt of ``--tokens`` tokens: the store is timed in the tier, from its first
   ``submit_store`` to its last job finished (``store GB/s``: the blocks' stride bytes per second);
2. the engine restarts (empty GPU and CPU caches; the tier's directory or daemon stays, warm) and serves
   the same prompt: ``lookup -> final HIT`` per block (the tier's first ``lookup`` of a key to the call
   that answers HIT, promotion included) and the load's GB/s (first ``submit_load`` to last load job);
   every block vLLM took as cached is compared with what the forward wrote (``bit-exact``);
3. bytes at rest per token (``du``), the tier's opaque blocks.

Writes vllm_tier.{md,json} to benchmarks/results/ with --write, else to benchmarks/out/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "engines" / "vllm_tier")]

from harness import BLOCK_TOKENS, FAMILIES, Engine, fs_tier, kvstore_tier, prompt  # noqa: E402

from benchmarks.common import results_dir  # noqa: E402
from tests.helpers.daemon import free_port, start_daemon  # noqa: E402


class Timed:
    """A tier's calls, timed: its store and load jobs' span, and each key's first lookup to its HIT."""

    def __init__(self, tier: Any) -> None:
        self.submitted: dict[str, float] = {}
        self.finished: dict[str, float] = {}
        self.asked: dict[Any, float] = {}
        self.hit: dict[Any, float] = {}
        self.jobs: dict[int, str] = {}
        self._wrap(tier)

    def _wrap(self, tier: Any) -> None:
        store, load, lookup, done = tier.submit_store, tier.submit_load, tier.lookup, tier.get_finished_jobs

        def submit(kind: str, fn: Callable[[Any], None]) -> Callable[[Any], None]:
            def call(job: Any) -> None:
                self.submitted.setdefault(kind, time.perf_counter())
                self.jobs[job.job_id] = kind
                fn(job)
            return call

        def timed_lookup(key: Any, ctx: Any) -> Any:
            self.asked.setdefault(key, time.perf_counter())
            r = lookup(key, ctx)
            if r.name == "HIT":
                self.hit.setdefault(key, time.perf_counter())
            return r

        def finished() -> Any:
            out = list(done())
            for r in out:
                self.finished[self.jobs.get(r.job_id, "?")] = time.perf_counter()
            return out

        tier.submit_store, tier.submit_load = submit("store", store), submit("load", load)
        tier.lookup, tier.get_finished_jobs = timed_lookup, finished

    def span(self, kind: str) -> float | None:
        if kind not in self.submitted or kind not in self.finished:
            return None
        return self.finished[kind] - self.submitted[kind]

    def hit_ms(self) -> list[float]:
        return [(self.hit[k] - self.asked[k]) * 1e3 for k in self.hit if k in self.asked]


@contextmanager
def side(name: str, root: Path) -> Iterator[dict[str, Any]]:
    """The tier config of one side, on a fresh directory under ``root``."""
    where = root / name
    if name == "fs":
        yield {"tier": fs_tier(str(where)), "dir": where}
        return
    d = start_daemon(where, "--port", str(free_port()))
    try:
        yield {"tier": kvstore_tier(d.address), "dir": where}
    finally:
        d.stop()


def du(path: Path) -> int:
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def run_one(family: str, name: str, tokens: int, work: Path, rep: int) -> dict[str, Any]:
    blocks = tokens // BLOCK_TOKENS
    ids = prompt(f"bench-{rep}", blocks)
    sizes = engine_sizes(tokens)
    with side(name, work / f"{family}-{rep}") as s:
        eng = Engine(FAMILIES[family], [s["tier"]], **sizes)
        try:
            t = Timed(eng.tiers[0])
            eng.serve("store", ids, timeout_s=600)
            stride, extent = eng.stride, eng.extent
            opaque = getattr(eng.tiers[0], "stats", None)
        finally:
            eng.shutdown()
        store_s = t.span("store")
        eng = Engine(FAMILIES[family], [s["tier"]], **sizes)
        try:
            t2 = Timed(eng.tiers[0])
            t0 = time.perf_counter()
            sent = eng.serve("load", ids, timeout_s=600)
            first_token_s = time.perf_counter() - t0
            hit = eng.hit_tokens(sent)
        finally:
            eng.shutdown()
        load_s = t2.span("load")
        at_rest = du(s["dir"])
    n = hit // BLOCK_TOKENS
    return {"family": family, "side": name, "rep": rep, "tokens": tokens, "blocks": blocks, "stride": stride,
            "pages": extent, "store_s": store_s, "store_gbps": blocks * stride / store_s / 1e9 if store_s else None,
            "load_s": load_s, "load_gbps": n * stride / load_s / 1e9 if load_s else None,
            "hit_tokens": hit, "request_s": first_token_s,
            "hit_ms_p50": statistics.median(t2.hit_ms()) if t2.hit_ms() else None,
            "hit_ms_p99": sorted(t2.hit_ms())[int(0.99 * (len(t2.hit_ms()) - 1))] if t2.hit_ms() else None,
            "bit_exact": sum(sent.loaded), "wrong": len(sent.loaded) - sum(sent.loaded),
            "bytes_per_token": at_rest / (blocks * BLOCK_TOKENS),
            "opaque_blocks": opaque.opaque_blocks if opaque is not None else None}


def engine_sizes(tokens: int) -> dict[str, int]:
    """vLLM's KV cache (allocated on the CPU here) just large enough for the prompt (the planner wants room
    for max_model_len in every group, the SWA ones included: ~30 KB a token), and a CPU tier for all its blocks."""
    blocks = tokens // BLOCK_TOKENS + 8
    return {"max_model_len": tokens + 2 * BLOCK_TOKENS, "kv_bytes": max(768 << 20, tokens * 32_000),
            "cpu_bytes": blocks * 512_000}


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    keys = ("store_gbps", "load_gbps", "hit_ms_p50", "hit_ms_p99", "request_s", "bytes_per_token")
    for r in rows:
        out.setdefault(r["family"], {}).setdefault(r["side"], {"runs": []})["runs"].append(r)
    for fam in out.values():
        for s in fam.values():
            for k in keys:
                xs = [r[k] for r in s["runs"] if r[k] is not None]
                s[k] = statistics.median(xs) if xs else None
            s["bit_exact"] = sum(r["bit_exact"] for r in s["runs"])
            s["wrong"] = sum(r["wrong"] for r in s["runs"])
            s["opaque_blocks"] = sum(r["opaque_blocks"] or 0 for r in s["runs"])
    return out


def f(x: Any, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def report(summary: dict[str, Any], args: argparse.Namespace, info: dict[str, Any]) -> str:
    lines = ["# kvstore as vLLM's secondary tier vs vLLM's file-system tier, through vLLM's own stack", "",
             "```", f".venv-vllm/bin/python benchmarks/vllm_tier/bench_vllm_tier.py --tokens {args.tokens} "
             f"--reps {args.reps}", "```", "", *[f"- {k}: {v}" for k, v in info.items()], ""]
    rows = [("store GB/s (in the tier)", "store_gbps", 2), ("load GB/s (warm, in the tier)", "load_gbps", 2),
            ("lookup -> final HIT p50 ms", "hit_ms_p50", 1), ("lookup -> final HIT p99 ms", "hit_ms_p99", 1),
            ("restarted engine: request -> done s", "request_s", 2),
            ("bytes at rest / token (du -sb)", "bytes_per_token", 1)]
    for fam, sides in summary.items():
        fs, kv = sides.get("fs", {}), sides.get("kvstore", {})
        lines += [f"### {fam}: {args.tokens} tokens, stride {fs.get('runs', kv.get('runs'))[0]['stride']} B, "
                  f"pages {kv.get('runs', fs.get('runs'))[0]['pages']} B", "", "|  | fs | kvstore | kvstore / fs |",
                  "|---|---|---|---|"]
        for label, k, nd in rows:
            a, b = fs.get(k), kv.get(k)
            lines.append(f"| {label} | {f(a, nd)} | {f(b, nd)} | {f(b / a if a and b else None)} |")
        lines.append(f"| blocks read back bit-exact / wrong | {fs.get('bit_exact')} / {fs.get('wrong')} | "
                     f"{kv.get('bit_exact')} / {kv.get('wrong')} | |")
        lines += [f"| opaque blocks | - | {kv.get('opaque_blocks')} | |", ""]
    lines += ["## Targets (issue 26)", "", "| family | target | measured | status |", "|---|---|---|---|"]
    for fam, sides in summary.items():
        fs, kv = sides.get("fs", {}), sides.get("kvstore", {})
        checks = [("warm load >= 3 GB/s", kv.get("load_gbps"), lambda x: x >= 3.0),
                  ("warm load >= 5x fs", ratio(kv.get("load_gbps"), fs.get("load_gbps")), lambda x: x >= 5.0),
                  ("lookup -> final HIT p50 <= 50 ms", kv.get("hit_ms_p50"), lambda x: x <= 50.0),
                  ("durable store >= 1.0x fs", ratio(kv.get("store_gbps"), fs.get("store_gbps")), lambda x: x >= 1.0),
                  ("bytes at rest below fs", ratio(kv.get("bytes_per_token"), fs.get("bytes_per_token")),
                   lambda x: x < 1.0),
                  ("0 opaque blocks", kv.get("opaque_blocks"), lambda x: x == 0)]
        for label, x, ok in checks:
            lines.append(f"| {fam} | {label} | {f(x)} | {'-' if x is None else 'met' if ok(x) else '**not met**'} |")
    lines += ["", "Read with: vLLM's C helper `vllm.fs_io_C` does not import here, so the fs tier ran its pure-Python "
              "path; that flatters kvstore's store and load ratios (the fs side is slower than on a GPU host with the "
              "helper), not bytes at rest or lookups. Store and load are timed inside the tier (first job submitted to "
              "last job finished), so vLLM's own CPU-tier copies are not in them; a 2-core machine shared with other "
              "work moves single runs by 2x: compare ratios within one run."]
    return "\n".join(lines) + "\n"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main() -> int:
    out_dir = results_dir(sys.argv, os.environ)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--families", default="blackwell,hopper")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_vllm_tier.", dir="/work" if Path("/work").is_dir() else None))
    t0 = time.time()
    rows: list[dict[str, Any]] = []
    try:
        for rep in range(args.reps):
            for family in args.families.split(","):
                order = ("fs", "kvstore") if rep % 2 == 0 else ("kvstore", "fs")
                for name in order:
                    rows.append(run_one(family, name, args.tokens, work, rep))
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "runs"}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    import vllm

    try:
        import vllm.fs_io_C
        fs_io = "importable"
    except Exception as e:
        fs_io = f"not importable here ({type(e).__name__}): vLLM's fs tier ran its pure-Python path"
    info = {"machine": f"{os.cpu_count()} cores, {platform.platform()}, load {os.getloadavg()[0]:.2f} at the end",
            "versions": f"vLLM {vllm.__version__}, Python {platform.python_version()}",
            "vllm.fs_io_C": fs_io,
            "run": f"{args.reps} repetitions, sides in alternating order, {time.time() - t0:.0f} s; medians"}
    summary = summarize(rows)
    (out_dir / "vllm_tier.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    (out_dir / "vllm_tier.md").write_text(report(summary, args, info))
    print(report(summary, args, info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
