"""Store operations per call, in process: turn saves, loads and deletes, and concurrent savers.

    python benchmarks/store/bench_store_ops.py [--repeats 15] [--savers 1 8]

deepseek-v4.1-flash layout, 256-token chunks, host -> ssd (LMDB, sync=True), write-through, zstd
at the default level. Sessions of ~1 MiB and ~16 MiB of chunk bytes. Every save is a new session
(distinct token ids, so distinct keys: nothing deduplicates), made cheaply by re-keying one set of
encoded chunks (new token ids, key and checksum; the entries are shared, which the store cannot
tell). Per operation: p50 latency, MB/s, and LMDB write transactions (each one commit and one
fsync) per call, read from LMDB's own transaction id. A turn save is ``save_session`` (chunks and
manifest in one call) where the store has it, else ``save_chunks`` then ``commit``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import machine, markdown_table
from benchmarks.store.bench_store import CHUNK_TOKENS, make_session
from kvstore.format import chunk
from kvstore.format.keys import ROOT, chunk_key_raw
from kvstore.format.layout import get_layout
from kvstore.store import Manifest, StoreConfig, open_store
from kvstore.tiers import HostTierConfig, SsdTierConfig

LAYOUT = get_layout("deepseek-v4.1-flash")
MB = 1e6
REPO = Path(__file__).resolve().parents[2]


def rekey(blob: bytes, ns: str, parent: bytes, ids: np.ndarray, keyed: bool = True) -> tuple[bytes, bytes]:
    """``blob`` with new token ids (and so a new key) and a fresh checksum: (key, blob)."""
    buf = bytearray(blob)
    h = chunk.read_header(buf)
    raw = ids.astype("<u4").tobytes()
    buf[h.tokens_offset : h.tokens_offset + len(raw)] = raw
    key = chunk_key_raw(LAYOUT.layout_id, ns, parent, raw) if keyed else bytes(16)
    buf[40:56] = key
    end = len(buf) - chunk.CHECKSUM_BYTES
    buf[end:] = int.to_bytes(__import__("xxhash").xxh3_64_intdigest(memoryview(buf)[:end]), 8, "little")
    return key, bytes(buf)


class Turns:
    """Distinct sessions of ``n`` chunks, made from one encoded set."""

    def __init__(self, n_chunks: int) -> None:
        keys, blobs, tail, _ = make_session(LAYOUT, n_chunks * CHUNK_TOKENS + 100)
        self.blobs, self.tail = blobs, tail
        self.rng = np.random.default_rng(1)
        self.lock = threading.Lock()
        self.bytes = sum(len(b) for b in blobs)

    def make(self, ns: str, sid: str) -> tuple[list[bytes], Manifest]:
        with self.lock:
            ids = self.rng.integers(0, 129_280, len(self.blobs) * CHUNK_TOKENS + 100, dtype=np.uint32)
        keys, blobs, parent = [], [], ROOT
        for i, b in enumerate(self.blobs):
            parent, nb = rekey(b, ns, parent, ids[i * CHUNK_TOKENS : (i + 1) * CHUNK_TOKENS])
            keys.append(parent)
            blobs.append(nb)
        _, tail = rekey(self.tail, ns, ROOT, ids[len(keys) * CHUNK_TOKENS :], keyed=False)
        m = Manifest(sid, ns, LAYOUT.layout_id, len(ids), CHUNK_TOKENS, tuple(keys), tail,
                     tuple(int(t) for t in ids[-128:]), time.time(), time.time())
        return blobs, m


def save_turn(ss: Any, blobs: list[bytes], m: Manifest) -> None:
    if hasattr(ss, "save_session"):
        ss.save_session(m.namespace, m.layout_id, ROOT, 0, blobs, m)
    else:
        ss.save_chunks(m.namespace, m.layout_id, ROOT, 0, blobs)
        ss.commit(m)


def load(ss: Any, keys: Any) -> list[bytes | None]:
    """A load of ``keys`` through the store's one read path, copied out (as a load's carrier copies them)."""
    with ss.read("ops", keys) as got:
        return [None if b is None else bytes(b) for b in got]


def txnid(ss: Any) -> int:
    return ss.store.tiers[-1]._env.info()["last_txnid"]


def config(root: Path, zstd_level: int) -> StoreConfig:
    return StoreConfig(tiers=(HostTierConfig(pin_memory=False), SsdTierConfig(path=str(root), zstd_level=zstd_level)),
                       chunk_tokens=CHUNK_TOKENS)


def single(root: Path, turns: Turns, repeats: int, zstd_level: int) -> dict[str, tuple[float, float, float]]:
    """op -> (p50 ms, MB/s at p50, txns per call) for save, hot load, cold load, delete."""
    ss = open_store(config(root, zstd_level))
    t: dict[str, list[float]] = {"save": [], "load (host tier)": [], "load (ssd tier)": [], "delete": []}
    tx: dict[str, list[int]] = {k: [] for k in t}
    try:
        for r in range(repeats + 1):
            blobs, m = turns.make("ops", f"s{r}")
            ops = {
                "save": lambda b=blobs, m=m: save_turn(ss, b, m),
                "load (host tier)": lambda m=m: load(ss, m.chunk_keys),
                "load (ssd tier)": lambda m=m: load(ss, m.chunk_keys),
                "delete": lambda m=m: ss.delete("ops", m.session_id),
            }
            for op, fn in ops.items():
                if op == "load (ssd tier)":  # drop the host copies: the next load reads LMDB
                    ss.store.tiers[0].delete_many(list(m.chunk_keys))
                t0, x0 = time.perf_counter(), txnid(ss)
                fn()
                if r:  # round 0 is a warm-up
                    t[op].append(time.perf_counter() - t0)
                    tx[op].append(txnid(ss) - x0)
    finally:
        ss.store.close()
    out = {}
    for op, ts in t.items():
        p50 = statistics.median(ts)
        out[op] = (p50 * 1e3, turns.bytes / MB / p50, statistics.mean(tx[op]))
    return out


def concurrent(root: Path, turns: Turns, savers: int, repeats: int, zstd_level: int) -> tuple[float, float, float]:
    """``savers`` threads each saving ``repeats`` new sessions: (aggregate MB/s, p50 ms, txns per save)."""
    ss = open_store(config(root, zstd_level))
    work = [[turns.make(f"c{w}", f"s{n}") for n in range(repeats)] for w in range(savers)]
    lat: list[float] = []
    start = threading.Barrier(savers + 1)

    def run(items: list[tuple[list[bytes], Manifest]]) -> None:
        start.wait()
        for blobs, m in items:
            t0 = time.perf_counter()
            save_turn(ss, blobs, m)
            lat.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=run, args=(w,)) for w in work]
    for th in threads:
        th.start()
    x0 = txnid(ss)
    start.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    txns = txnid(ss) - x0
    ss.store.close()
    n = savers * repeats
    return turns.bytes * n / MB / wall, statistics.median(lat) * 1e3, txns / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--savers", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--label", default="")
    ap.add_argument("--zstd", type=int, default=SsdTierConfig().zstd_level, help="the ssd tier's zstd level (0 = off)")
    args = ap.parse_args()
    small, large = Turns(5), Turns(73)  # ~1.1 MiB and ~16.7 MiB of chunk bytes
    rows, crows = [], []
    with tempfile.TemporaryDirectory(dir=REPO.parent, prefix="bench-ops-") as tmp:
        for turns, reps in ((small, args.repeats), (large, max(3, args.repeats // 3))):
            for op, (p50, rate, tx) in single(Path(tmp) / f"s{turns.bytes}", turns, reps, args.zstd).items():
                rows.append([f"{turns.bytes / MB:.1f}", op, f"{p50:.1f}", f"{rate:.0f}", f"{tx:.2f}"])
        for k in args.savers:
            rate, p50, tx = concurrent(Path(tmp) / f"c{k}", small, k, args.repeats, args.zstd)
            crows.append([str(k), f"{small.bytes / MB:.1f}", f"{rate:.0f}", f"{p50:.1f}", f"{tx:.2f}"])
    print(f"{args.label} zstd level {args.zstd}; {machine()}")
    print(markdown_table(["MB", "operation", "p50 ms", "MB/s at p50", "LMDB txns per call"], rows))
    print()
    print(markdown_table(["savers", "MB per save", "aggregate MB/s", "p50 ms per save", "LMDB txns per save"], crows))


if __name__ == "__main__":
    main()
