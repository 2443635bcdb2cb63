"""What verifying a whole-session load costs (issue 21, "no per-chunk Python on the hot path"): a 128K-token
deepseek-v4.1-flash session (512 chunks, 117 MB), today's per-chunk checks beside the batch checks of
kvstore.format.chunk_batch and a memcpy of the same bytes, in one process, interleaved round by round.

    python benchmarks/resume/bench_chunk_checks.py [--tokens 131072] [--repeats 9] [--write]

In memory (the blobs as a tier holds them, each a bytes object):
- memcpy: the session's bytes, one copy into a reused buffer (the floor: a load copies at least once);
- per chunk (today): ``chunk_matches`` for each chunk (header, checksum, claims, key from its token ids:
  what SessionStore.load applied through TieredStore.get before issue 28), then, as a load does, a copy of each out;
- batch: ``chunk_batch.check`` of all 512, with and without a copy into the buffer (C kernel: 1 and 2
  threads; without the key recomputed; the Python reference); ``check_packed`` of the copied buffer in
  place (what a client would run on a buffer a daemon loaded into); the keys alone (512 chained xxh3-128).
From the ssd tier (a real SsdTier, page cache warm; default codec: the scales tail zstd-compressed, and
raw: ``--zstd-level 0``): today's ``get_many`` + per-chunk checks + copy; ``read_views`` + ``check`` with the
copy (one pass over the map); raw LMDB reads of every chunk beside.
Writes resume_checks.md and .json (benchmarks/out, or benchmarks/results with --write).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import RESULTS, git_state, interleaved, machine, markdown_table, write_result
from benchmarks.resume.geometry_session import LAYOUT, Session, make_session
from kvstore.format import chunk_batch
from kvstore.format.chunk import compressible_offset
from kvstore.format.chunk_batch import Expected
from kvstore.format.keys import ROOT, chunk_key_raw
from kvstore.store.sessions.chunk_index import ChunkInfo
from kvstore.tiers.config import SsdTierConfig
from kvstore.tiers.ssd.tier import SsdTier
from tests.helpers.store import chunk_matches

NS = "checks"
Op = Callable[[], object]


def in_memory_ops(s: Session, dest: np.ndarray) -> dict[str, Op]:
    blobs, keys, ct = s.blobs, s.keys, s.chunk_tokens
    infos = [ChunkInfo(NS, s.layout.layout_id, keys[i - 1] if i else ROOT, i) for i in range(len(keys))]
    expected = Expected.chain(keys, s.layout.layout_id, NS, ct)
    offsets = np.cumsum([0, *map(len, blobs)])[:-1]
    lengths = [len(b) for b in blobs]
    packed = memoryview(b"".join(blobs))
    out = memoryview(dest.data)
    no_key = Expected(keys, s.layout.layout_id, expected.starts, ct)
    ids = [memoryview(b)[len(b) - 8 - 4 * ct : len(b) - 8] for b in blobs]  # token ids: just before the checksum

    def per_chunk() -> None:
        assert all(chunk_matches(k, i, ct, b) for k, i, b in zip(keys, infos, blobs))

    def per_chunk_copy() -> None:
        for k, i, b, o in zip(keys, infos, blobs, offsets.tolist()):
            assert chunk_matches(k, i, ct, b)
            out[o : o + len(b)] = b

    def ok(r: chunk_batch.BatchResult) -> None:
        assert r.all_valid

    return {
        "memcpy": lambda: dest.__setitem__(slice(0, len(packed)), np.frombuffer(packed, np.uint8)),
        "per chunk (today)": per_chunk,
        "per chunk (today) + copy": per_chunk_copy,
        "batch": lambda: ok(chunk_batch.check(blobs, expected)),
        "batch + copy": lambda: ok(chunk_batch.check(blobs, expected, dest=out, dest_offsets=offsets)),
        "batch + copy, 2 threads": lambda: ok(chunk_batch.check(blobs, expected, dest=out, dest_offsets=offsets,
                                                                threads=2)),
        "batch + copy, no key": lambda: ok(chunk_batch.check(blobs, no_key, dest=out, dest_offsets=offsets)),
        "batch + copy, Python reference": lambda: ok(chunk_batch.check_reference(blobs, expected, dest=out,
                                                                                 dest_offsets=offsets)),
        "check_packed in place": lambda: ok(chunk_batch.check_packed(out, offsets, lengths, expected)),
        "keys alone, Python": lambda: [chunk_key_raw(s.layout.layout_id, NS, p, r)
                                       for p, r in zip(expected.parents or [], ids)],
    }


def ssd_ops(s: Session, dest: np.ndarray, tier: SsdTier, codec: str) -> dict[str, Op]:
    keys, ct = s.keys, s.chunk_tokens
    infos = [ChunkInfo(NS, s.layout.layout_id, keys[i - 1] if i else ROOT, i) for i in range(len(keys))]
    expected = Expected.chain(keys, s.layout.layout_id, NS, ct)
    offsets = np.cumsum([0, *map(len, s.blobs)])[:-1]
    out = memoryview(dest.data)
    env, db = tier._env, tier._db  # the tier's own environment: raw reads of its records, same pages

    def today() -> None:
        for k, i, b, o in zip(keys, infos, tier.get_many(keys), offsets.tolist()):
            assert b is not None and chunk_matches(k, i, ct, b)
            out[o : o + len(b)] = b

    def views() -> None:
        with tier.read_views(keys) as v:
            assert chunk_batch.check(v.values, expected, dest=out, dest_offsets=offsets).all_valid

    def raw_reads() -> None:
        with env.begin(db=db, buffers=True) as txn:
            assert all(txn.get(k) is not None for k in keys)

    return {f"ssd {codec}: get_many + per chunk + copy (today)": today,
            f"ssd {codec}: read_views + batch + copy": views,
            f"ssd {codec}: raw LMDB reads (views)": raw_reads}


def run(tokens: int, repeats: int, work: Path) -> tuple[dict[str, list[float]], int]:
    """Seconds of every op per round, and the session's bytes."""
    s = make_session(tokens, NS)
    dest = np.ones(s.nbytes, np.uint8)  # faulted in once, reused
    ops = in_memory_ops(s, dest)
    tiers = []
    for codec, level in (("default", SsdTierConfig.zstd_level), ("raw", 0)):
        tier = SsdTier(SsdTierConfig(path=str(work / codec), zstd_level=level, sync=False),
                       compressible_from=compressible_offset)
        tier.put_many(zip(s.keys, s.blobs))
        tiers.append(tier)
        ops.update(ssd_ops(s, dest, tier, codec))
    try:
        stamps = interleaved({k: (fn, None) for k, fn in ops.items()}, sync=lambda: None, warmup=2, repeats=repeats)
    finally:
        for t in tiers:
            t.close()
    return {k: [b - a for a, b in v] for k, v in stamps.items()}, s.nbytes


def report(seconds: dict[str, list[float]], tokens: int, nbytes: int, command: str) -> str:
    med = {k: statistics.median(v) for k, v in seconds.items()}
    memcpy = med["memcpy"]
    rows = [[k, f"{m * 1e3:.2f}", f"{nbytes / m / 1e9:.1f}" if "keys" not in k else "", f"{m / memcpy:.2f}x"]
            for k, m in med.items()]
    return "\n".join([f"`{command}`", "", f"{machine()}; {git_state()}; C kernel: {chunk_batch.NATIVE}; layout "
                      f"{LAYOUT}, {tokens:,} tokens, {nbytes / 1e6:.0f} MB; medians of {len(seconds['memcpy'])} "
                      f"interleaved rounds.", "", markdown_table(["", "ms", "GB/s", "/ memcpy"], rows), ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=131_072)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    command = ("python benchmarks/resume/bench_chunk_checks.py " + " ".join(sys.argv[1:] if argv is None else argv))
    with tempfile.TemporaryDirectory(prefix="resume-checks-") as tmp:
        seconds, nbytes = run(args.tokens, args.repeats, Path(tmp))
    text = report(seconds, args.tokens, nbytes, command.strip())
    print(text)
    write_result("resume_checks.md", "Checking a whole-session load: per chunk vs batch (issue 21)", text)
    record = {"command": command.strip(), "git": git_state(), "tokens": args.tokens, "seconds": seconds}
    (RESULTS / "resume_checks.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
