"""What bench_vllm_tier.py drives through vLLM's offloading stack: realistic V4.1 page bytes, the two
workloads, the scheduler's side of stores and lookups, and the tiers' processes and directories.

Nothing here is a copy of vLLM: an engine is ``tests/vllm_tier/harness.py``'s ``Engine`` (vLLM 0.33's
TieringOffloadingSpec + TieringOffloadingManager, a real CPU primary tier in shared memory); this
module only decides which keys it stores and looks up, when, and with which bytes, and times it.

Page bytes (``PagePool``): every page of every group, at the offsets ``geometry.py`` derives
(``tier.layout.groups[i].pages``), written as the GPU copy would have: main pages are
``nvfp4_ds_mla`` records (256 B of FP4 E2M1 codes + 32 E4M3 scales, one per 16 channels, interleaved
per state) of 512-channel Gaussian rows; indexer pages are MXFP4 records (64 B of E2M1 codes, then
the 4 UE8M0 exponents per state: split). Rows are ``N(0, 1)`` times a per-layer per-channel
log-normal gain (sigma 0.5: KV latents have outlier channels) times a per-state log-normal gain
(sigma 0.2), quantized by ``kvstore.format.quant`` (bit-exact with ml_dtypes), so E4M3 scale rows vary as
real ones do and the UE8M0 indexer exponents fall in a narrow range. The bytes of a slot past its
group's pages (vLLM offloads a packed block whole for every group) are zeros.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
for _p in (REPO / "tests" / "vllm_tier", REPO / "tests", REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import daemon_helpers as DH  # noqa: E402
import harness as H  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402

from kvstore.format import quant  # noqa: E402
from kvstore.server.process import Exec  # noqa: E402

BLOCK_TOKENS = H.BLOCK_TOKENS
PROJECT_KVSTORE = REPO / ".venv" / "bin" / "kvstore"


# -- page bytes -----------------------------------------------------------------------------------
class PagePool:
    """``n`` distinct blocks of V4.1 page bytes per group (``data[group][i]``: the group's extent)."""

    def __init__(self, layout: Any, n: int, seed: int = 0, batch: int = 32) -> None:
        self.layout = layout
        self.n = n
        self.extent = {g.group: g.block_bytes for g in layout.groups}
        self.data = {g.group: np.zeros((n, g.block_bytes), dtype=np.uint8) for g in layout.groups}
        self.kinds: dict[str, int] = {}  # bytes of each kind in one block of every group
        gen = torch.Generator().manual_seed(seed)
        gains: dict[str, torch.Tensor] = {}
        for g in layout.groups:
            for p in g.pages:
                kind = p.name.split(".")[0]  # main / index
                layer = p.name.split(".")[1]
                channels = 2 * p.data  # FP4: two codes a byte
                block = channels // p.scale  # channels per scale
                if (kind, block) not in (("main", quant.MAIN_BLOCK), ("index", quant.INDEX_BLOCK)):
                    raise ValueError(f"page {p.name}: {p.data}+{p.scale} B records are not what "
                                     "kvstore.format.quant makes")
                gkey = f"{kind}.{layer}"
                if gkey not in gains:
                    gains[gkey] = torch.exp(0.5 * torch.randn(channels, generator=gen))
                self.kinds[f"{kind} codes"] = self.kinds.get(f"{kind} codes", 0) + p.data_bytes
                self.kinds[f"{kind} scales"] = self.kinds.get(f"{kind} scales", 0) + p.scale_bytes
                self.kinds["padding"] = self.kinds.get("padding", 0) + p.page_bytes - p.record_bytes
                for lo in range(0, n, batch):
                    hi = min(n, lo + batch)
                    x = torch.randn(hi - lo, p.states, channels, generator=gen)
                    x *= gains[gkey]
                    x *= torch.exp(0.2 * torch.randn(hi - lo, p.states, 1, generator=gen))
                    q = quant.quantize_main if kind == "main" else quant.quantize_indexer
                    codes, scales = (t.numpy() for t in q(x))
                    dst = self.data[g.group][lo:hi, p.offset : p.offset + p.page_bytes]
                    if p.arrangement == "interleaved":
                        rec = np.concatenate([codes, scales], axis=-1)
                        dst[:, : p.record_bytes] = rec.reshape(hi - lo, -1)
                    else:
                        dst[:, : p.data_bytes] = codes.reshape(hi - lo, -1)
                        dst[:, p.data_bytes : p.record_bytes] = scales.reshape(hi - lo, -1)
        # what the scale rows look like (for the report)
        self.scale_stats = self._scale_stats()

    def _scale_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for g in self.layout.groups:
            for p in g.pages:
                kind = p.name.split(".")[0]
                a = self.data[g.group][: min(self.n, 16), p.offset : p.offset + p.record_bytes]
                if p.arrangement == "interleaved":
                    s = a.reshape(a.shape[0], p.states, p.data + p.scale)[:, :, p.data :]
                else:
                    s = a[:, p.data_bytes :]
                vals, counts = np.unique(s, return_counts=True)
                d = out.setdefault(kind, {"distinct": set(), "n": 0})
                d["distinct"].update(int(v) for v in vals)
                d["n"] += int(counts.sum())
        for kind, d in out.items():
            vals = sorted(d.pop("distinct"))
            d["distinct_bytes"] = len(vals)
            if kind == "index":
                d["exponents"] = [v - 127 for v in vals]
            else:
                f = torch.tensor(vals, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
                d["e4m3_range"] = [float(f.min()), float(f.max())]
        return out

    def fill(self, content: int, group: int, slot: memoryview) -> None:
        e = self.extent[group]
        np.frombuffer(slot, dtype=np.uint8)[:e] = self.data[group][content]
        np.frombuffer(slot, dtype=np.uint8)[e:] = 0

    def matches(self, content: int, group: int, got: bytes | memoryview) -> bool:
        e = self.extent[group]
        return bytes(memoryview(got)[:e]) == self.data[group][content].tobytes()

    @property
    def block_bytes(self) -> int:
        """The bytes of one 256-token block that must round-trip (every group's pages)."""
        return sum(self.extent.values())


# -- workloads ------------------------------------------------------------------------------------
@dataclass
class Block:
    hash: bytes
    content: int  # index into the PagePool


@dataclass
class Turn:
    session: int
    blocks: list[Block]  # the new blocks of this turn (what the connector stores)
    context: list[Block]  # every block of the prompt after this turn
    params: dict[str, Any] | None = None  # the request's kv_transfer_params


@dataclass
class Workload:
    name: str
    title: str
    turns: list[Turn]  # in the order they are stored
    probes: list[list[Block]]  # what is looked up after the primary is dropped: one request each
    misses: list[list[Block]]  # per probe, the blocks after it that were never stored (a new turn)

    @property
    def unique(self) -> list[Block]:
        seen: dict[bytes, Block] = {}
        for t in self.turns:
            for b in t.blocks:
                seen.setdefault(b.hash, b)
        return list(seen.values())

    @property
    def tokens(self) -> int:
        return len(self.unique) * BLOCK_TOKENS


def chained(seed: str, parent: bytes, n: int, content0: int) -> list[Block]:
    out = []
    for i in range(n):
        parent = hashlib.sha256(parent + f"{seed}/{i}".encode()).digest()
        out.append(Block(parent, content0 + i))
    return out


def single_session(blocks: int = 512, tag: str = "") -> Workload:
    """One 128K-token session (512 blocks of 256 tokens, both groups): one prefill, stored in the
    steps of vLLM's chunked prefill."""
    bl = chained(f"single{tag}", b"\0" * 32, blocks + 1, 0)
    return Workload(
        "single",
        f"one {blocks * BLOCK_TOKENS // 1024}K-token session",
        [Turn(0, bl[:blocks], bl[:blocks])],
        [bl[:blocks]],
        [bl[blocks:]],
    )


def agent(
    sessions: int = 16,
    prefix_blocks: int = 8,
    final_blocks: tuple[int, int] = (32, 64),
    turns: int = 4,
    seed: int = 0,
    tag: str = "",
) -> Workload:
    """The agent workload's shape: ``sessions`` sessions sharing a ``prefix_blocks``-block system
    prompt, each growing in ``turns`` turns to ``final_blocks`` blocks (uniform); the turns of all
    sessions interleaved (turn 1 of every session, then turn 2...), each turn a request of its own
    naming its session (``kvstore_session``: kvstore keeps one growing page session per agent
    session). Looked up afterwards: every session's whole context plus one block of a next turn
    that was never stored (a miss)."""
    rng = np.random.default_rng(seed)
    prefix = chained(f"agent{tag}/prefix", b"\0" * 32, prefix_blocks, 0)
    content = prefix_blocks
    per_session: list[list[list[Block]]] = []
    probes, misses = [], []
    for s in range(sessions):
        final = int(rng.integers(final_blocks[0], final_blocks[1] + 1))
        body = chained(f"agent{tag}/s{s}", prefix[-1].hash, final - prefix_blocks + 1, content)
        content += final - prefix_blocks  # the never-stored block reuses the next session's first content
        cuts = sorted(rng.choice(np.arange(1, final - prefix_blocks), size=turns - 1, replace=False).tolist())
        bounds = [0, *cuts, final - prefix_blocks]
        chunks = [body[bounds[i] : bounds[i + 1]] for i in range(turns)]
        chunks[0] = prefix + chunks[0]
        per_session.append(chunks)
        probes.append(prefix + body[:-1])
        misses.append(body[-1:])
    out: list[Turn] = []
    seen: set[bytes] = set()
    for t in range(turns):
        for s in range(sessions):
            ctx = [b for c in per_session[s][: t + 1] for b in c]
            new = [b for b in per_session[s][t] if b.hash not in seen]
            seen.update(b.hash for b in new)
            out.append(Turn(s, new, ctx, {"kvstore_session": f"agent{tag}-s{s}"}))
    return Workload(
        "agent",
        f"agent: {sessions} sessions x {turns} turns, {final_blocks[0] * BLOCK_TOKENS // 1024}-"
        f"{final_blocks[1] * BLOCK_TOKENS // 1024}K tokens, shared {prefix_blocks * BLOCK_TOKENS // 1024}K prefix",
        out,
        probes,
        misses,
    )


def keys_of(blocks: Sequence[Block], group_ids: Sequence[int]) -> list[tuple[bytes, Block, int]]:
    """Every group's OffloadKey of each block, block-major: (key, block, group id)."""
    return [(make_offload_key(b.hash, g), b, g) for b in blocks for g in group_ids]


# -- the scheduler's side -------------------------------------------------------------------------
class JobLog:
    """Every job a tier finished (wraps the tier's ``get_finished_jobs``) and every ``tier.lookup``
    call's cost (wraps ``lookup``)."""

    def __init__(self, tier: Any, on_finished: Callable[[Any], None] | None = None) -> None:
        self.results: list[Any] = []
        self.lookup_s: list[float] = []
        self.submitted: dict[int, list[bytes]] = {}
        get_finished, lookup, submit = tier.get_finished_jobs, tier.lookup, tier.submit_store

        def finished() -> list[Any]:
            out = list(get_finished())
            self.results.extend(out)
            if on_finished is not None:
                for r in out:
                    on_finished(r)
            return out

        def timed_lookup(key: bytes, ctx: ReqContext) -> Any:
            t = time.perf_counter()
            r = lookup(key, ctx)
            self.lookup_s.append(time.perf_counter() - t)
            return r

        def submit_store(job: Any) -> None:
            self.submitted[job.job_id] = list(job.keys)
            submit(job)

        tier.get_finished_jobs = finished
        tier.lookup = timed_lookup
        tier.submit_store = submit_store

    def failures(self) -> int:
        return sum(1 for r in self.results if not r.success)


def wait_idle(eng: H.Engine, timeout_s: float = 300.0, pause_s: float = 0.0005) -> None:
    t0 = time.monotonic()
    while True:
        eng.step()
        with eng.manager.lock:
            if not eng.manager.has_pending_work():
                return
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError("offloading jobs did not finish")
        time.sleep(pause_s)


_req_counter = iter(range(1 << 62))


def new_request(eng: H.Engine, params: dict[str, Any] | None = None) -> ReqContext:
    return eng.request(f"req-{next(_req_counter)}", params)


def prepare_turns(
    eng: H.Engine, pool: PagePool, turns: Sequence[Turn], step_blocks: int
) -> list[tuple[ReqContext, list[bytes]]]:
    """What the GPU side does before ``complete_store``: each turn a request, its new blocks
    allocated in the primary in jobs of ``step_blocks`` blocks (one scheduler step of chunked
    prefill each) and written there. Returns the (request, keys) to complete."""
    out = []
    view, stride = eng.view(), eng.stride
    for t in turns:
        ctx = new_request(eng, t.params)
        pos = {b.hash: (i + 1) * BLOCK_TOKENS for i, b in enumerate(t.context)}
        for lo in range(0, len(t.blocks), step_blocks):
            ks = keys_of(t.blocks[lo : lo + step_blocks], eng.group_ids)
            keys = [k for k, _, _ in ks]
            by_key = {k: (b, g) for k, b, g in ks}
            with eng.manager.lock:
                for k, b, _ in ks:
                    ctx.set_offload_key_position(k, pos[b.hash])
                prep = eng.manager.prepare_store(keys, ctx)
                assert prep is not None, "primary tier full"
                for k, cid in zip(prep.keys_to_store, prep.store_spec.chunk_ids):
                    b, g = by_key[k]
                    pool.fill(b.content, g, view[int(cid) * stride : (int(cid) + 1) * stride])
            out.append((ctx, list(prep.keys_to_store)))
    return out


def complete_all(eng: H.Engine, jobs: Sequence[tuple[ReqContext, list[bytes]]]) -> float:
    """``complete_store`` of every job back to back (the cascade to the secondary tier starts),
    then until every job finished: the seconds it took."""
    t0 = time.perf_counter()
    for ctx, keys in jobs:
        with eng.manager.lock:
            eng.manager.complete_store(keys, ctx)
    wait_idle(eng)
    return time.perf_counter() - t0


@dataclass
class KeyTimes:
    first: float = 0.0
    verdict: float | None = None  # the first answer that is not RETRY: the tier said HIT (or MISS)
    final: float | None = None  # HIT (in the primary) or MISS
    result: Any = None


@dataclass
class LookupRun:
    seconds: float  # first lookup call -> every request's final answer
    keys: list[dict[bytes, KeyTimes]]  # per request
    passes: int
    hits: dict[bytes, tuple[Block, int]] = field(default_factory=dict)

    def per_key(self, what: str, result: Any = LookupResult.HIT) -> list[float]:
        out = []
        for req in self.keys:
            for kt in req.values():
                t = getattr(kt, what)
                if kt.result is result and t is not None:
                    out.append(t - kt.first)
        return out


def schedule_lookups(
    eng: H.Engine, probes: Sequence[Sequence[Block]], pause_s: float = 0.001, stop_at_miss: bool = True
) -> tuple[LookupRun, list[ReqContext]]:
    """What vLLM's OffloadingConnectorScheduler does for waiting requests (``_maximal_prefix_lookup``):
    every step, for each request, every group's keys in order, stopping a group at its first MISS
    (``stop_at_miss=False``: every key is asked, for the crash audits); a request is done when no
    key of it answered RETRY or HIT_PENDING. ``pause_s`` stands for the rest of a step. Times every
    key from its first call to its verdict and its final answer."""
    ctxs = [new_request(eng) for _ in probes]
    groups = eng.group_ids
    per_req = [[[make_offload_key(b.hash, g) for b in blocks] for g in groups] for blocks in probes]
    block_of = [{make_offload_key(b.hash, g): (b, g) for b in blocks for g in groups} for blocks in probes]
    times: list[dict[bytes, KeyTimes]] = [{} for _ in probes]
    active = list(range(len(probes)))
    passes = 0
    t0 = time.perf_counter()
    while active:
        passes += 1
        done = []
        with eng.manager.lock:
            for r in active:
                deferred = False
                for keys in per_req[r]:
                    for k in keys:
                        now = time.perf_counter()
                        res = eng.manager.lookup(k, ctxs[r])
                        after = time.perf_counter()
                        kt = times[r].get(k)
                        if kt is None:
                            kt = times[r][k] = KeyTimes(first=now)
                        if kt.verdict is None and res is not LookupResult.RETRY:
                            kt.verdict = after
                        if kt.final is None and res in (LookupResult.HIT, LookupResult.MISS):
                            kt.final, kt.result = after, res
                        if res is LookupResult.MISS and stop_at_miss:
                            break
                        if res in (LookupResult.RETRY, LookupResult.HIT_PENDING):
                            deferred = True
                if not deferred:
                    done.append(r)
        active = [r for r in active if r not in done]
        eng.step()
        if active:
            time.sleep(pause_s)
        if time.perf_counter() - t0 > 300:
            raise TimeoutError("lookups did not settle")
    seconds = max(kt.final for req in times for kt in req.values() if kt.final is not None) - t0
    run = LookupRun(seconds, times, passes)
    for r, req in enumerate(times):
        for k, kt in req.items():
            if kt.result is LookupResult.HIT:
                run.hits[k] = block_of[r][k]
    return run, ctxs


def verify(eng: H.Engine, pool: PagePool, ctxs: Sequence[ReqContext], run: LookupRun) -> tuple[int, int]:
    """Read every HIT back from the primary (as the CPU->GPU copy would: ``prepare_load``, the
    slot's bytes, ``complete_load``) and compare it with what was stored: (bit-exact, wrong)."""
    ok = wrong = 0
    for ctx, req in zip(ctxs, run.keys):
        keys = [k for k, kt in req.items() if kt.result is LookupResult.HIT]
        if not keys:
            continue
        with eng.manager.lock:
            spec = eng.manager.prepare_load(keys, ctx)
            flat = np.frombuffer(eng.view(), dtype=np.uint8)
            stride = eng.stride
            for k, cid in zip(keys, spec.chunk_ids):
                b, g = run.hits[k]
                e = pool.extent[g]
                lo = int(cid) * stride
                if np.array_equal(flat[lo : lo + e], pool.data[g][b.content]):
                    ok += 1
                else:
                    wrong += 1
            eng.manager.complete_load(keys, ctx)
    return ok, wrong


# -- tiers, daemons, directories ------------------------------------------------------------------
def daemon_command() -> list[str]:
    """How daemons are run: from the project's own venv (``.venv/bin/kvstore``) when it is there."""
    return [str(PROJECT_KVSTORE)] if PROJECT_KVSTORE.exists() else DH.kvstore_command()


def du(path: Path) -> tuple[int, int]:
    """(apparent bytes ``du -sb``, allocated bytes ``du -s --block-size=1``)."""
    a = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout.split()[0]
    b = subprocess.run(
        ["du", "-s", "--block-size=1", str(path)], capture_output=True, text=True, check=True
    ).stdout.split()[0]
    return int(a), int(b)


def cached_fraction(path: Path) -> float | None:
    """How much of ``path``'s bytes the page cache holds (util-linux ``fincore``), None if unknown."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    if not files:
        return None
    try:
        out = subprocess.run(
            ["fincore", "-b", "-n", "-o", "RES,SIZE", *files], capture_output=True, text=True, timeout=30
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    res = sum(int(x) for x in out[0::2])
    size = sum(int(x) for x in out[1::2])
    return res / size if size else None


@dataclass
class Side:
    """One secondary tier under test."""

    name: str
    kind: str  # "fs" or "kvstore"
    flags: tuple[str, ...] = ()  # the daemon's
    fsync: bool = False
    tier_extra: dict[str, Any] = field(default_factory=dict)  # KVStoreTier's settings

    @property
    def label(self) -> str:
        return self.name


@dataclass
class Running:
    side: Side
    at_rest: Path  # the fs root, or the daemon's data dir
    engine: H.Engine | None = None
    daemon: DH.Daemon | None = None
    log: JobLog | None = None

    def tier_cfg(self) -> dict[str, Any]:
        if self.side.kind == "fs":
            return H.fs_tier(str(self.at_rest))
        assert self.daemon is not None
        return H.kvstore_tier(self.daemon.address, **self.side.tier_extra)

    def start_daemon(self) -> float:
        t = time.perf_counter()
        self.daemon = DH.start_daemon(self.at_rest, *self.side.flags, spawner=Exec(daemon_command()))
        return time.perf_counter() - t

    def start_engine(self, cpu_bytes: int, **kw: Any) -> H.Engine:
        self.engine = H.Engine.start([self.tier_cfg()], cpu_bytes=cpu_bytes, **kw)
        tier = self.engine.tiers[0]
        assert tier.bp_detector is None, "a backpressure detector would drop stores"
        self.log = JobLog(tier)
        return self.engine

    def stop_engine(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
            self.log = None

    def stop(self) -> None:
        self.stop_engine()
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None


def start(side: Side, root: Path, cpu_bytes: int) -> Running:
    run = Running(side, root)
    root.mkdir(parents=True, exist_ok=True)
    if side.kind == "kvstore":
        run.start_daemon()
    run.start_engine(cpu_bytes)
    return run


def cpu_bytes_for(blocks: int, stride: int) -> int:
    return int((blocks * 2 + 64) * stride * 1.1)


# -- crash children -------------------------------------------------------------------------------
def child_store(args: dict[str, Any]) -> None:
    """A child process: an engine that stores a workload into one tier, printing SUBMIT/ACK lines
    (each job's id and keys, each finished job's id and success) until it is killed or done."""
    pool_data = {int(g): np.load(p, mmap_mode="r") for g, p in args["pool"].items()}
    extent = {g: a.shape[1] for g, a in pool_data.items()}
    eng = H.Engine.start([args["tier"]], cpu_bytes=args["cpu_bytes"], engine_id=args["engine_id"])
    tier = eng.tiers[0]
    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    log = JobLog(tier, on_finished=lambda r: say(f"ACK {r.job_id} {int(bool(r.success))}"))
    submit = tier.submit_store

    def submit_store(job: Any) -> None:
        say(f"SUBMIT {job.job_id} " + " ".join(k.hex() for k in job.keys))
        submit(job)

    tier.submit_store = submit_store
    blocks = [Block(bytes.fromhex(h), c) for h, c in args["blocks"]]

    class _Pool:
        def fill(self, content: int, group: int, slot: memoryview) -> None:
            e = extent[group]
            np.frombuffer(slot, dtype=np.uint8)[:e] = pool_data[group][content]
            np.frombuffer(slot, dtype=np.uint8)[e:] = 0

    jobs = prepare_turns(eng, _Pool(), [Turn(0, blocks, blocks)], args["step_blocks"])  # type: ignore[arg-type]
    say("READY")
    complete_all(eng, jobs)
    say(f"DONE {log.failures()}")
    eng.shutdown()


@contextlib.contextmanager
def loop_fs(image: Path, mount: Path, size_bytes: int) -> Iterator[Path | None]:
    """A small ext4 file system of ``size_bytes`` mounted at ``mount`` (loop device; needs root),
    or None if it cannot be made here."""
    made = False
    try:
        mount.mkdir(parents=True, exist_ok=True)
        with open(image, "wb") as f:
            f.truncate(size_bytes)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True, capture_output=True)
        made = True
    except (OSError, subprocess.CalledProcessError):
        made = False
    try:
        yield mount if made else None
    finally:
        if made:
            subprocess.run(["umount", str(mount)], capture_output=True)
        with contextlib.suppress(OSError):
            image.unlink()


def kill(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
