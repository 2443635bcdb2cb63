"""Engine pages into an engine's slots, at the real geometry: one 128K-token DeepSeek-V4.1 session
(512 blocks of 227,840 B: vLLM's one prefix-cacheable group of the eight kv-source caches, its block
stride padded to 228,096 B) loaded from a real daemon's host tier into a shared-memory region, as
vLLM's CPU primary tier (``SharedOffloadRegion``: a /dev/shm file, mapped and prefaulted).

    .venv/bin/python benchmarks/vllm_tier/bench_page_loads.py [--blocks 512] [--repeats 9] [--write]

Side by side in one run, every path once per round (interleaved: drift hits all alike), medians:
- ``scatter``: ``Client.load_pages_into``: the daemon writes each verified page blob's payload into its
  slot of the region (process_vm_writev): one copy;
- ``blob by blob``: the tier's load before it (``KVStoreTier._load``): ``load_chunks`` through the
  client's 32 MiB arena a batch at a time, each blob checked again in the client (header, key,
  checksum) and its block copied into its slot;
- ``packed``: ``Client.load_chunks_into``: whole blobs back to back into one buffer, written by the
  daemon (issue 26's ~6 GB/s reference; no slots, so not what an engine can use);
- ``memcpy``: the same payload bytes copied into the same slots from one buffer in this process
  (numpy, one thread): what a copy costs here; and one contiguous copy of them all.
And stores, one durable turn save of the session's blocks from the slots: ``gather``
(``Client.save_pages``: the daemon reads each block from its slot into its host tier's buffer and
builds the blob) against the tier's store before it (encoded here, sent through the arena and stream).
GB/s counts the blocks' bytes (117 MB at 512 blocks), not the blobs' headers.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import git_state, markdown_table, write_result
from kvstore.client import Client
from kvstore.format import page
from kvstore.format.manifest import Kind, Manifest, Retention
from kvstore.format.page_layout import GroupSpec, PageLayout, PageSpec
from kvstore.server.process import DaemonProcess, clean_env

REPO = Path(__file__).resolve().parents[2]
STRIDE = 228096  # vLLM's block stride with the MXFP4 indexer: the pages, padded by 256 B
ARENA = 32 << 20  # the tier's arena per job thread (its default arena_bytes)


def v41_block() -> PageLayout:
    """vLLM's planner's block for V4.1 (nvfp4_ds_mla, MXFP4 indexer): one group, pages by spec: the
    ratio-2 main pages (layers 2, 8, 14), their indexer pages, then layer 20's main and indexer page."""
    pages, at = [], 0
    for name, states, data, scale, arrangement in (
            *[(f"main.L{n}", 128, 256, 32, "interleaved") for n in (2, 8, 14)],
            *[(f"index.L{n}", 128, 64, 4, "split") for n in (2, 8, 14)],
            ("main.L20", 256, 256, 32, "interleaved"), ("index.L20", 256, 64, 4, "split")):
        n = states * (data + scale)
        pages.append(PageSpec(name, at, states, data, scale, arrangement, n))
        at += n
    return PageLayout("deepseek-ai/DeepSeek-V4.1-Flash", "vllm", (("bench", "page_loads"),),
                      (GroupSpec(1, 256, at, tuple(pages)),))


class Region:
    """A region of slots in shared memory, mapped and prefaulted, as vLLM's SharedOffloadRegion."""

    def __init__(self, slots: int, stride: int) -> None:
        self.path = Path(tempfile.mkstemp(prefix="bench_page_loads_", dir="/dev/shm")[1])
        with open(self.path, "r+b") as f:
            f.truncate(slots * stride)
            self.map = mmap.mmap(f.fileno(), slots * stride)
        self.path.unlink()  # as vLLM does once every worker mapped it: nothing is left behind, however we exit
        self.array = np.frombuffer(self.map, np.uint8)
        self.array[:] = 0  # prefaulted

    def close(self) -> None:
        """Nothing to do: the file is gone, the mapping goes with the process (views may still be alive)."""


def save(c: Client, lay: PageLayout, ns: str, n: int, rng: np.random.Generator) -> tuple[list[bytes], np.ndarray]:
    """``n`` blocks saved as one page session, a turn per 128 blocks: their keys, and their bytes."""
    g = lay.groups[0]
    blocks = rng.integers(0, 256, (n, g.block_bytes), dtype=np.uint8)
    keys: list[bytes] = []
    c.register_layout(lay.definition())
    for start in range(0, n, 128):
        blobs = []
        for i in range(start, min(n, start + 128)):
            h = f"{ns}/{i}".encode()
            keys.append(page.page_key(lay.layout_id, ns, g.group, h))
            blobs.append(page.encode(lay, g.group, h, keys[-1], blocks[i]))
        c.save_session(Manifest("bench", ns, lay.layout_id, 256 * len(keys), 0, tuple(keys), b"", (),
                                retention=Retention(ttl_s=3600), kind=Kind.ENGINE_PAGES), blobs)
    return keys, blocks


def blob_by_blob(c: Client, lay: PageLayout, ns: str, keys: list[bytes], out: np.ndarray, offsets: list[int]) -> int:
    """The tier's load before the scatter (KVStoreTier._load): arena batches, each blob checked and copied."""
    g, loaded = lay.groups[0], 0
    per = max(1, ARENA // page.blob_bytes(g, 16))
    for b in range(0, len(keys), per):
        batch = keys[b : b + per]
        for j, blob in c.load_chunks(ns, batch, zero_copy=True):
            i = b + j
            page.check_known(blob, lay, keys[i])
            page.decode_into(blob, lay, out[offsets[i] : offsets[i] + g.block_bytes])
            loaded += 1
    return loaded


def timed(ops: dict[str, Callable[[], None]], warmup: int, repeats: int) -> dict[str, list[float]]:
    """Seconds of each op per round after ``warmup`` rounds, every op once per round (interleaved)."""
    times: dict[str, list[float]] = {k: [] for k in ops}
    for r in range(warmup + repeats):
        for name, fn in ops.items():
            t = time.perf_counter()
            fn()
            if r >= warmup:
                times[name].append(time.perf_counter() - t)
    return times


def table(times: dict[str, list[float]], nbytes: int) -> str:
    """Median, best, GB/s of the median, and time against the first row."""
    base = statistics.median(next(iter(times.values())))
    rows = [[name, f"{statistics.median(ts) * 1e3:.1f}", f"{min(ts) * 1e3:.1f}",
             f"{nbytes / statistics.median(ts) / 1e9:.2f}", f"{statistics.median(ts) / base:.2f}x"]
            for name, ts in times.items()]
    return markdown_table(["path", "median ms", "best ms", "GB/s (median)", "time vs first"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    lay = v41_block()
    g = lay.groups[0]
    n = args.blocks
    rng = np.random.default_rng(26)
    scratch = REPO / "benchmarks" / "out"  # ignored by git; on the checkout's disk, not tmpfs
    scratch.mkdir(exist_ok=True)
    data = Path(tempfile.mkdtemp(prefix="bench_page_loads_", dir=scratch))
    d = DaemonProcess(data / "data", ("--port", "0", "--host-capacity-bytes", str(4 * n * STRIDE)), env=clean_env(),
                      cwd=REPO, log_path=data / "daemon.log").start()
    region = Region(n + 8, STRIDE)
    try:
        ns = f"bench-{uuid.uuid4().hex[:8]}"
        c = Client(address=d.address, arena_bytes=ARENA)
        arena_client = Client(address=d.address, arena_bytes=ARENA)  # the tier's job thread: its own arena
        keys, blocks = save(c, lay, ns, n, rng)
        # the slots of a primary tier that has been in use: scattered, not in key order
        offsets = [int(s) * STRIDE for s in rng.permutation(n + 8)[:n]]
        packed = np.zeros(n * page.blob_bytes(g, 32), np.uint8)
        src = np.ascontiguousarray(blocks)
        flat = np.empty_like(src)
        out = region.array

        def scatter() -> None:
            assert len(c.load_pages_into(ns, keys, out, offsets, STRIDE)) == n

        def old() -> None:
            assert blob_by_blob(arena_client, lay, ns, keys, out, offsets) == n

        def whole() -> None:
            assert len(c.load_chunks_into(ns, keys, packed)) == n

        def copy_slots() -> None:
            for i, off in enumerate(offsets):
                out[off : off + g.block_bytes] = src[i]

        def copy_all() -> None:
            np.copyto(flat, src)

        loads = timed({"scatter (load_pages_into)": scatter, "blob by blob (the tier's _load before)": old,
                       "packed (load_chunks_into)": whole, "memcpy into the slots": copy_slots,
                       "one contiguous memcpy": copy_all}, args.warmup, args.repeats)
        scatter()
        for i, off in enumerate(offsets):  # the scatter's result: every slot its block
            assert (out[off : off + g.block_bytes] == blocks[i]).all()
        # stores: the session's blocks saved from the slots as one durable turn, under a fresh namespace each
        # time (new keys: every blob written, fsync'd), through the daemon's read or encoded and sent
        hashes = [f"h{i}".encode() for i in range(n)]
        groups = [g.group] * n

        def turn(store: Callable[[Manifest, str], object]) -> Callable[[], None]:
            def run() -> None:
                tenant = f"s-{uuid.uuid4().hex[:8]}"
                pkeys = [page.page_key(lay.layout_id, tenant, g.group, h) for h in hashes]
                store(Manifest("bench", tenant, lay.layout_id, 256 * n, 0, tuple(pkeys), b"", (),
                               retention=Retention(ttl_s=3600), kind=Kind.ENGINE_PAGES), tenant)
            return run

        def gather(m: Manifest, tenant: str) -> None:
            assert c.save_pages(m, lay, out, offsets, STRIDE, groups, hashes).written == n

        def encoded(m: Manifest, tenant: str) -> None:  # the tier's store before: encode, then the arena/stream
            blobs = [page.encode(lay, g.group, h, k, out[o : o + g.block_bytes])
                     for h, k, o in zip(hashes, m.chunk_keys, offsets)]
            assert arena_client.save_session(m, blobs).written == n

        stores = timed({"gather (save_pages: the daemon reads the slots)": turn(gather),
                        "encode + save_session (the tier's store before)": turn(encoded)},
                       1, max(3, args.repeats // 3))
        c.close()
        arena_client.close()
    finally:
        d.stop()
        region.close()
        shutil.rmtree(data, ignore_errors=True)
    nbytes = n * g.block_bytes
    body = (f"{n} blocks of {g.block_bytes:,} B (a {n * 256 // 1024}K-token V4.1 session, {nbytes / 1e6:.0f} MB of "
            f"block bytes), slots of {STRIDE:,} B scattered over a {len(out) / 1e6:.0f} MB shared-memory region, a "
            f"daemon with its host tier and ssd tier (LMDB) on {data.parent}; every path once per round, "
            f"interleaved.\n\n## Loads (warm: the host tier)\n\n{args.repeats} rounds after {args.warmup} of "
            f"warm-up.\n\n" + table(loads, nbytes) + "\n\nTarget: scatter >= 3 GB/s.\n\n## Stores (one durable turn "
            f"save of the session, new keys)\n\n{max(3, args.repeats // 3)} rounds after 1.\n\n"
            + table(stores, nbytes)
            + f"\n\n`{' '.join(['bench_page_loads.py', *sys.argv[1:]])}`, {os.cpu_count()} cores (shared with "
            f"other work: noisy, so medians and ratios measured side by side), {git_state()}.\n")
    print(body)
    print(write_result("page_loads.md", "Engine pages between an engine's slots and the daemon, at the real geometry",
                       body))


if __name__ == "__main__":
    main()
