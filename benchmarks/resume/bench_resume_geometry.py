"""Resume at the real geometry (issue 21): an agent session of deepseek-v4.1-flash saved through the daemon
turn by turn, then loaded whole by a default ``Client``, beside the floors of the same bytes in the same run.

    python benchmarks/resume/bench_resume_geometry.py [--tokens 131072 1048576] [--repeats 5] [--cold-repeats 2]
                                                      [--api auto|load_session|load_session_into] [--quick] [--write]

Per session size (128K and 1M tokens: 512 and 4,096 chunks of 256 tokens, 117 and 939 MB), with a daemon of
default settings on a temp data dir (the benchmark's own file system, not tmpfs):
- turn saves: the session grown by 2,048-token turns (8 new chunks per ``save_session``, an append),
  p50 beside a raw LMDB put of the same 8 chunks with an fsync'd commit (geometry_raw.RawLmdb), shown
  for reference: what a turn costs at a length, and the targets, are bench_turn_saves.py's;
- host tier: the whole session loaded (every chunk in the daemon's host tier) beside a memcpy of the same
  bytes into a reused buffer;
- ssd tier, page cache warm: loaded after ``evict(.., "ssd")`` (before every repeat: a load promotes),
  beside raw LMDB reads of every chunk in one read transaction (``buffers=True``; also with a copy into
  a reused buffer);
- ssd tier, page cache dropped: the daemon restarted, the LMDB files' pages dropped (posix_fadvise
  DONTNEED; mincore says how much stayed: the pages the daemon's open touched, one per record), then
  the load, beside raw LMDB reads after the same drop, with the map's readahead off (as LMDB opens
  the tier's) and on (as the tier's batch reads turn it, ``tiers/ssd/readahead.py``).
Medians of ``--repeats`` (``--cold-repeats``), the ratios and the issue's targets, met or not. ``--api``:
``auto`` uses ``Client.load_session_into`` (into one reused buffer) when the client has it, else
``load_session`` (what a user calls today). ``--quick``: 8K and 16K tokens, 2 repeats (the test's mode).
Writes resume_geometry.md and .json (benchmarks/out, or benchmarks/results with --write).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import (
    drop_page_cache,
    git_state,
    machine,
    markdown_table,
    targets_table,
    write_json,
    write_result,
)
from benchmarks.resume.geometry_raw import RawLmdb, memcpy, resident_fraction
from benchmarks.resume.geometry_session import LAYOUT, TURN_TOKENS, Session, label, make_session, section_title
from kvstore.client import Client
from kvstore.server.process import DaemonProcess

NS, SID = "geometry", "agent"
COLD = 0.10  # a file counts as dropped from the page cache when less than this fraction stayed resident
#: ratio name -> (measured, floor, the issue's target: measured <= target x floor; None: shown, no target)
TARGETS: dict[str, tuple[str, str, float | None]] = {
           "host / memcpy": ("host", "memcpy", 2.0), "ssd warm / raw LMDB reads": ("ssd_warm", "raw_reads", 3.0),
           "ssd dropped / raw LMDB reads dropped (readahead on)": ("ssd_cold", "raw_reads_cold_readahead", 3.0),
           "ssd warm / raw LMDB reads + copy out": ("ssd_warm", "raw_reads_copy", None),
           "turn save p50 / raw put+fsync p50 (bench_turn_saves.py has the targets)": ("turn_save", "raw_put", None)}


@dataclass(frozen=True)
class GeometryConfig:
    tokens: tuple[int, ...] = (131_072, 1_048_576)
    repeats: int = 5
    cold_repeats: int = 2
    api: str = "auto"  # auto | load_session | load_session_into

    @classmethod
    def quick(cls, api: str = "auto") -> GeometryConfig:
        return cls(tokens=(8192, 16_384), repeats=2, cold_repeats=1, api=api)


@dataclass
class SizeResult:
    tokens: int
    chunks: int
    nbytes: int
    api: str
    seconds: dict[str, list[float]] = field(default_factory=dict)  # metric -> samples
    resident: dict[str, list[float]] = field(default_factory=dict)  # file -> page cache fraction after a drop
    notes: list[str] = field(default_factory=list)

    def median(self, metric: str) -> float | None:
        s = self.seconds.get(metric)
        return statistics.median(s) if s else None


def pick_api(client: Client, wanted: str) -> str:
    if wanted != "auto":
        return wanted
    return "load_session_into" if hasattr(client, "load_session_into") else "load_session"


def session_loader(client: Client, api: str, s: Session) -> Callable[[], tuple[int, int]]:
    """A whole-session load through ``api``: returns (chunks, bytes) received."""
    if api == "load_session_into":  # issue 21's caller-supplied destination, one buffer reused
        buf = np.zeros(s.nbytes, np.uint8)

        def into() -> tuple[int, int]:
            got = client.load_session_into(NS, SID, buf)  # type: ignore[attr-defined]  # (the issue-20 API)
            return _count_into(got, s)

        return into

    def load() -> tuple[int, int]:
        _, pairs = client.load_session(NS, SID)
        n = nbytes = 0
        for _, blob in pairs:
            n, nbytes = n + 1, nbytes + len(blob)
        return n, nbytes

    return load


def _count_into(got: Any, s: Session) -> tuple[int, int]:
    """(chunks, bytes) of what ``load_session_into`` returned: a sequence of per-chunk lengths or
    indices, or a (manifest, those) pair; the whole session when it says nothing more."""
    if isinstance(got, tuple) and len(got) == 2:
        got = got[1]
    try:
        n = len(got)
    except TypeError:
        return len(s.keys), s.nbytes
    return n, s.nbytes * n // len(s.keys)


def timed(fn: Callable[[], tuple[int, int]], s: Session) -> float:
    t = time.perf_counter()
    n, nbytes = fn()
    dt = time.perf_counter() - t
    if (n, nbytes) != (len(s.keys), s.nbytes):
        raise RuntimeError(f"a load returned {n} chunks / {nbytes} bytes of {len(s.keys)} / {s.nbytes}")
    return dt


def placement(client: Client) -> dict[str, int]:
    return dict(client.get_session(NS, SID)[1])


def run_size(tokens: int, cfg: GeometryConfig, work: Path) -> SizeResult:
    s = make_session(tokens, NS)
    packed = memoryview(b"".join(s.blobs))
    offsets = np.cumsum([0, *map(len, s.blobs)]).tolist()
    s = replace(s, blobs=[packed[a:b] for a, b in itertools.pairwise(offsets)])  # one copy of the bytes in memory
    dest = np.ones(s.nbytes, np.uint8)  # faulted in once: every copy into it is a copy, not page faults
    raw = RawLmdb(work / "raw")
    data = work / "daemon"
    d = DaemonProcess(data).start()
    try:
        client = Client(d.address)
        api = pick_api(client, cfg.api)
        r = SizeResult(tokens, len(s.keys), s.nbytes, api, notes=[f"data dirs on {fs_type(work)}"])
        per = TURN_TOKENS // s.chunk_tokens
        saves, puts = [], []
        for i, (m, new) in enumerate(s.turns(SID)):
            t = time.perf_counter()
            client.save_session(m, new)
            saves.append(time.perf_counter() - t)
            puts.append(raw.put_turn(list(zip(s.keys[i * per : (i + 1) * per], new))))
        r.seconds["turn_save"], r.seconds["raw_put"] = saves, puts
        load = session_loader(client, api, s)
        _check_bytes(client, s)
        load()  # warm-up: connections, arena, the daemon's code paths
        for _ in range(cfg.repeats):
            if set(placement(client)) != {"host"}:
                client.prefetch(NS, SID)
                client.wait_prefetched(NS, SID, timeout_s=120)
            r.seconds.setdefault("host", []).append(timed(load, s))
            r.seconds.setdefault("memcpy", []).append(memcpy(packed, dest))
            r.seconds.setdefault("raw_reads", []).append(raw.read_all(s.keys)[0])
            r.seconds.setdefault("raw_reads_copy", []).append(raw.read_all(s.keys, dest)[0])
            client.evict(NS, SID, "ssd")
            if placement(client) != {"ssd": len(s.keys)}:
                r.notes.append(f"after evict the chunks were in {placement(client)}")
            r.seconds.setdefault("ssd_warm", []).append(timed(load, s))
        client.close()
    finally:
        d.stop()
    for _ in range(cfg.cold_repeats):
        _cold_round(r, s, raw, data)
    raw.close()
    return r


def fs_type(path: Path) -> str:
    """The file system ``path`` is on (the longest mount point above it in /proc/mounts)."""
    best, kind = "", "an unknown file system"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fs = line.split()[:3]
            if str(path.resolve()).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, f"{fs} ({dev} on {mnt})"
    except OSError:
        pass
    return kind


def _check_bytes(client: Client, s: Session) -> None:
    _, pairs = client.load_session(NS, SID)
    got = dict(pairs)
    if len(got) != len(s.keys) or any(bytes(got[i]) != s.blobs[i] for i in range(len(s.keys))):
        raise RuntimeError("the daemon returned other bytes than were saved")


def _cold_round(r: SizeResult, s: Session, raw: RawLmdb, data: Path) -> None:
    """Raw reads after the LMDB file's pages were dropped from the cache (with the map's readahead off,
    as the ssd tier opens it, and on); then the daemon restarted and its file's pages dropped, and a load."""
    raw_file, tier_file = raw.path / "data.mdb", data / "ssd" / "data.mdb"
    for readahead, metric in ((False, "raw_reads_cold"), (True, "raw_reads_cold_readahead")):
        raw.close()
        why = drop_page_cache(raw_file)
        if why:
            r.notes.append(f"page cache not dropped: {why}")
            raw.reopen()
            return
        raw.reopen(readahead)
        r.resident.setdefault("raw LMDB file", []).append(resident_fraction(raw_file) or 0.0)
        r.seconds.setdefault(metric, []).append(raw.read_all(s.keys)[0])
    raw.reopen()
    d = DaemonProcess(data).start()  # restarted: nothing in its host tier, the manifest read at open
    try:
        client = Client(d.address)
        client.info()  # connected before the drop: the load is timed, not the start
        drop_page_cache(tier_file)
        left = resident_fraction(tier_file)
        r.resident.setdefault("ssd tier file", []).append(left or 0.0)
        # pages a process has mapped stay in the cache: the daemon's open maps its whole file (below)
        metric = "ssd_cold" if left is not None and left < COLD else "ssd_restart"
        r.seconds.setdefault(metric, []).append(timed(session_loader(client, r.api, s), s))
        client.close()
    finally:
        d.stop()
    if metric == "ssd_restart" and not any(n.startswith("ssd tier, cache dropped") for n in r.notes):
        r.notes.append(f"ssd tier, cache dropped: not possible here: after the daemon's start {left:.0%} of its "
                       f"LMDB file stayed in the page cache through posix_fadvise(DONTNEED); the load after the "
                       f"restart is reported instead")


# -- report ---------------------------------------------------------------------------------------
def ratios(r: SizeResult) -> dict[str, dict[str, Any]]:
    out = {}
    for name, (num, den, target) in TARGETS.items():
        a, b = r.median(num), r.median(den)
        ratio = a / b if a is not None and b else None
        met = None if target is None or ratio is None else ratio <= target
        out[name] = {"ratio": ratio, "target": target, "met": met}
    return out


ROWS = [("turn_save", "turn save (8 chunks, an append: new keys + tail + last ids), p50"),
        ("raw_put", "raw LMDB put + fsync'd commit, p50"),
        ("host", "load, host tier"), ("memcpy", "memcpy into a reused buffer"),
        ("ssd_warm", "load, ssd tier, cache warm"),
        ("raw_reads", "raw LMDB reads, one txn (views)"), ("raw_reads_copy", "raw LMDB reads + copy out"),
        ("ssd_cold", "load, ssd tier, cache dropped"), ("ssd_restart", "load, ssd tier, after a daemon restart"),
        ("raw_reads_cold", "raw LMDB reads, cache dropped, readahead off (LMDB's NORDAHEAD)"),
        ("raw_reads_cold_readahead", "raw LMDB reads, cache dropped, readahead on (as the tier's batch reads)")]


def report(results: list[SizeResult], cfg: GeometryConfig, command: str) -> str:
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [f"`{command}`", "", f"{machine()}; {git_state()}; load average {load} at the end (2 cores, shared); "
             f"layout {LAYOUT}, chunks of "
             f"{results[0].tokens // results[0].chunks} tokens; default daemon and client; load API "
             f"`{results[0].api}`; medians of {cfg.repeats} (cache dropped: {cfg.cold_repeats}).", ""]
    for r in results:
        rows = []
        for metric, what in ROWS:
            m = r.median(metric)
            if m is None:
                continue
            per_turn = metric in ("turn_save", "raw_put")
            nbytes = r.nbytes * TURN_TOKENS // r.tokens if per_turn else r.nbytes
            rows.append([what, f"{m * 1e3:.1f}", f"{nbytes / m / 1e9:.2f}"])
        lines += [section_title(r.tokens, r.chunks, r.nbytes), "",
                  markdown_table(["", "ms", "GB/s"], rows), ""]
        lines.append(targets_table("target", ratios(r)))
        res = [f"{k} {statistics.median(v):.0%}" for k, v in r.resident.items()]
        if res:
            lines += ["", "Page cache after the drop (mincore): " + ", ".join(res) + " of the file resident."]
        lines += [f"- {n}" for n in r.notes] + [""]
    return "\n".join(lines)


def run(cfg: GeometryConfig, work: Path) -> list[SizeResult]:
    out = []
    for tokens in cfg.tokens:
        sub = work / label(tokens)
        sub.mkdir(parents=True, exist_ok=True)
        out.append(run_size(tokens, cfg, sub))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=list(GeometryConfig.tokens))
    p.add_argument("--repeats", type=int, default=GeometryConfig.repeats)
    p.add_argument("--cold-repeats", type=int, default=GeometryConfig.cold_repeats)
    p.add_argument("--api", choices=["auto", "load_session", "load_session_into"], default="auto")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--work", type=Path, default=None, help="where the data dirs go (default: a temp dir)")
    args = p.parse_args(argv)
    cfg = (GeometryConfig.quick(args.api) if args.quick
           else GeometryConfig(tuple(args.tokens), args.repeats, args.cold_repeats, args.api))
    command = "python benchmarks/resume/bench_resume_geometry.py " + " ".join(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="resume-geometry-", dir=args.work) as tmp:
        results = run(cfg, Path(tmp))
    text = report(results, cfg, command.strip())
    print(text)
    path = write_result("resume_geometry.md", "Resume at the real geometry (issue 21)", text)
    write_json("resume_geometry.json", command.strip(), {"config": asdict(cfg), "sizes": [
        {**asdict(r), "medians": {k: r.median(k) for k in r.seconds}, "ratios": ratios(r)} for r in results]})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
