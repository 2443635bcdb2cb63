"""HBM tier and same-GPU handoff on a CUDA machine, each figure beside its ceiling from the same run.

- ceilings: pinned H2D / D2H and pageable H2D of the same bytes, timed here, just before the tier;
- HBM tier put_many from host bytes and get_many to host bytes, for 280 deepseek-v4.1-flash
  chunks (229,376 B: 64 MiB) and for 1,120 (256 MiB); ratio vs pinned, target >= 0.8;
  the per-key get the daemon's load path makes today, and a sweep of copy lanes x staging size;
- the same-GPU handoff: a 64 MiB session loaded into device memory by a client process through
  CUDA IPC (device to device from the daemon's HBM tier) vs the host path (load, then upload).

``run() -> (markdown section, JSON-able dict)``; the orchestrator is benchmarks/gpu/bench_gpu.py.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run standalone, too
from benchmarks.common import markdown_table, median_time

CHUNK = 229_376  # one deepseek-v4.1-flash chunk of 256 tokens
SETS = (280, 1120)  # 64 MiB and 256 MiB
TARGET = 0.8
REPO = Path(__file__).resolve().parents[2]


_T0 = time.perf_counter()


def _progress(what: str, value: object) -> None:
    """One line per figure as it is measured (to stderr): a run cut short still leaves its numbers."""
    print(f"[hbm {time.perf_counter() - _T0:6.1f}s] {what}: {value}", file=sys.stderr, flush=True)


def _sync_time(fn: Callable[[], object], repeats: int = 9) -> float:
    def once() -> None:
        fn()
        torch.cuda.synchronize()

    return median_time(once, repeats, warmup=2)


def ceilings(nbytes: int) -> dict[str, float]:
    """GB/s of one copy of ``nbytes``: pinned H2D, pinned D2H, pageable H2D."""
    pinned = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).pin_memory()
    pageable = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    gb = nbytes / 1e9
    return {"pinned_h2d": gb / _sync_time(lambda: dev.copy_(pinned, non_blocking=True)),
            "pinned_d2h": gb / _sync_time(lambda: pinned.copy_(dev, non_blocking=True)),
            "pageable_h2d": gb / _sync_time(lambda: dev.copy_(pageable))}


def _blobs(n: int, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, n * CHUNK, dtype=np.uint8).tobytes()
    return [data[i * CHUNK:(i + 1) * CHUNK] for i in range(n)], [i.to_bytes(16, "big") for i in range(n)]


def tier_put_get(n: int, data: tuple[list[bytes], list[bytes]] | None = None, **config: int) -> dict[str, float]:
    """GB/s of put_many (each repeat into an emptied tier) and get_many / per-key get of ``n`` chunks."""
    from kvstore.tiers import HbmTierConfig, make_tier

    blobs, keys = data or _blobs(n)
    gb = n * CHUNK / 1e9
    tier: Any = make_tier(HbmTierConfig(capacity_bytes=1 << 30, **config))
    try:
        puts = []
        for _ in range(7):
            tier.delete_many(keys)
            t = time.perf_counter()
            tier.put_many(zip(keys, blobs))
            puts.append(time.perf_counter() - t)
        put = sorted(puts[1:])[len(puts[1:]) // 2]
        got = tier.get_many(keys)
        exact = all(bytes(g) == b for g, b in zip(got, blobs))
        del got
        get = median_time(lambda: tier.get_many(keys), 7, warmup=1)

        def per_key_gets() -> None:
            for k in keys:
                tier.get_many([k])[0]

        per_key = median_time(per_key_gets, 1, warmup=1)
    finally:
        tier.close()
    out = {"put": gb / put, "get": gb / get, "get_per_key": gb / per_key, "bit_exact": float(exact)}
    _progress(f"tier {n} chunks {config or 'defaults'}", {k: round(v, 2) for k, v in out.items()})
    return out


def sweep() -> list[dict[str, float]]:
    """put/get of 64 MiB across copy lanes x staging buffer sizes (what the defaults were chosen from)."""
    rows = []
    data = _blobs(SETS[0])
    for lanes, mib in ((1, 2), (4, 2), (8, 1), (8, 4), (12, 2), (16, 2)):
        if time.perf_counter() - _T0 > 75:
            break  # the main figures come first; the sweep only where time is left
        r = tier_put_get(SETS[0], data, copy_lanes=lanes, staging_bytes=mib << 20)
        rows.append({"lanes": lanes, "staging_mib": mib, "put": r["put"], "get": r["get"]})
    return rows


@contextmanager
def _daemon(data_dir: Path, hbm_bytes: int) -> Iterator[str]:
    """A daemon of this tree with an HBM tier of ``hbm_bytes``; its log beside ``data_dir``."""
    from kvstore.server.process import DaemonProcess

    data_dir.mkdir(parents=True, exist_ok=True)
    with DaemonProcess(data_dir, ["--hbm-capacity-bytes", str(hbm_bytes)], cwd=REPO, log_format=None,
                       log_path=data_dir.with_suffix(".log")) as d:
        yield d.address


def _random_chunks(lay: Any, n: int, tokens: int = 256) -> tuple[list[bytes], list[bytes], np.ndarray]:
    """Valid chunks of ``lay`` with random codes and scales (the codec's output is not the point
    here, the bytes moved are; quantizing 280 chunks would cost the run more than the copies)."""
    from kvstore.format import chunk
    from kvstore.format.keys import chain_keys

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 129_280, n * tokens).astype(np.uint32)
    keys = chain_keys(lay.layout_id, "bench", ids, tokens)
    blobs = []
    for i, k in enumerate(keys):
        ents = {c.name: chunk.Entries(rng.integers(0, 256, (c.entries_for(tokens), c.code_bytes), dtype=np.uint8),
                                      rng.integers(0, 256, (c.entries_for(tokens), c.scale_bytes), dtype=np.uint8))
                for c in lay.caches}
        blobs.append(chunk.encode(lay, key=k, start=i * tokens, token_ids=ids[i * tokens:(i + 1) * tokens],
                                  entries=ents))
    return blobs, keys, ids


def handoff(n: int = SETS[0]) -> dict[str, Any]:
    """A session of ``n`` chunks loaded into this process's GPU memory: IPC vs the host path."""
    from kvstore.client import Client
    from kvstore.client.device_load import HOST, DeviceLoader
    from kvstore.format import chunk
    from kvstore.format.layout import get_layout
    from kvstore.format.manifest import Manifest

    lay = get_layout("deepseek-v4.1-flash")
    blobs, keys, ids = _random_chunks(lay, n)
    _progress("handoff: chunks made", n)
    ents = {c.name: chunk.Entries(np.zeros((0, c.code_bytes), np.uint8), np.zeros((0, c.scale_bytes), np.uint8))
            for c in lay.caches}
    tail = chunk.encode(lay, key=bytes(16), start=n * 256, token_ids=np.zeros(0, np.uint32), entries=ents)
    m = Manifest("s", "bench", lay.layout_id, n * 256, 256, tuple(keys), tail, tuple(int(t) for t in ids[-128:]))
    dev = torch.device("cuda", torch.cuda.current_device())
    gb = sum(len(b) for b in blobs) / 1e9
    with tempfile.TemporaryDirectory() as tmp, _daemon(Path(tmp) / "data", 1 << 30) as address, \
            Client(address=address) as c:
        c.save_session(m, blobs)
        _progress("handoff: session saved", address)
        loader = c.device_loader(dev)
        _, chunks = loader.load("bench", "s")
        _progress("handoff: negotiated", f"{loader.path} {loader.reason}")
        exact = all(t.cpu().numpy().tobytes() == b for (_, t), b in zip(chunks, blobs))
        del chunks
        out: dict[str, Any] = {"path": loader.path, "reason": loader.reason, "bit_exact": exact, "gb": gb}
        out["device_load_s"] = _sync_time(lambda: loader.load("bench", "s"), 7)
        host = DeviceLoader(c, dev)
        host.path = HOST
        out["host_path_s"] = _sync_time(lambda: host.load("bench", "s"), 5)
        out["host_bytes_s"] = median_time(lambda: [b for _, b in c.load_session("bench", "s")[1]], 5)
    _progress("handoff", out)
    return out


def run() -> tuple[str, dict[str, Any]]:
    if not torch.cuda.is_available():
        return "## HBM tier and same-GPU handoff\n\nNo CUDA device: not measured.\n", {"skipped": "no CUDA"}
    data: dict[str, Any] = {"chunk_bytes": CHUNK, "target": TARGET, "sets": {}}
    data["one_lane"] = tier_put_get(SETS[0], copy_lanes=1)  # no copy threads: the plainest pipeline
    rows = []
    for n in SETS:
        ceil = ceilings(n * CHUNK)
        _progress(f"ceilings {n * CHUNK >> 20} MiB", {k: round(v, 1) for k, v in ceil.items()})
        tier = tier_put_get(n)
        put_ratio, get_ratio = tier["put"] / ceil["pinned_h2d"], tier["get"] / ceil["pinned_d2h"]
        data["sets"][str(n)] = {**ceil, **tier, "put_ratio": put_ratio, "get_ratio": get_ratio}
        met = "met" if min(put_ratio, get_ratio) >= TARGET else "NOT met"
        rows.append([f"{n} x {CHUNK:,} B ({n * CHUNK >> 20} MiB)", f"{ceil['pageable_h2d']:.1f}",
                     f"{tier['put']:.1f} / {ceil['pinned_h2d']:.1f} = {put_ratio:.2f}",
                     f"{tier['get']:.1f} / {ceil['pinned_d2h']:.1f} = {get_ratio:.2f}",
                     f"{tier['get_per_key']:.1f}", "yes" if tier["bit_exact"] else "NO", met])
    try:
        data["handoff"] = handoff()
    except Exception as e:  # the tier figures stand on their own; say what failed
        data["handoff"] = {"error": f"{type(e).__name__}: {e}"}
    data["sweep"] = sweep()
    md = ["## HBM tier (host bytes) vs pinned copies, same run", "",
          markdown_table(["set", "pageable H2D GB/s", "put_many GB/s / pinned H2D = ratio",
                          "get_many GB/s / pinned D2H = ratio", "per-key get GB/s", "bit-exact",
                          f"target >= {TARGET}"], rows), "",
          "Sweep, 64 MiB (copy lanes x staging buffer): " + ", ".join(
              f"{r['lanes']}x{r['staging_mib']} MiB put {r['put']:.1f} get {r['get']:.1f}" for r in data["sweep"]),
          "", "## Same-GPU handoff: a 64 MiB session into the client's GPU memory", ""]
    h = data["handoff"]
    if "error" in h:
        md.append(f"Not measured: {h['error']}")
    else:
        md.append(markdown_table(
            ["path", "ms", "GB/s"],
            [[f"negotiated: {h['path']}" + (f" ({h['reason']})" if h["reason"] else ""),
              f"{h['device_load_s'] * 1e3:.1f}", f"{h['gb'] / h['device_load_s']:.1f}"],
             ["host path (load_session + one pinned upload)", f"{h['host_path_s'] * 1e3:.1f}",
              f"{h['gb'] / h['host_path_s']:.1f}"],
             ["load_session to host bytes only", f"{h['host_bytes_s'] * 1e3:.1f}",
              f"{h['gb'] / h['host_bytes_s']:.1f}"]]))
        md.append(f"\nBit-exact on the device: {'yes' if h['bit_exact'] else 'NO'}.")
    return "\n".join(md) + "\n", data


if __name__ == "__main__":
    import json

    text, result = run()
    print(text)
    print(json.dumps(result, indent=1, default=str))
