"""Resume at the real geometry into GPU memory (issue 21, the GPU row): a deepseek-v4.1-flash session
loaded from the daemon into CUDA tensors by a default ``Client``, beside the floors of the same bytes in one run.

    python benchmarks/resume/geometry_gpu.py [--tokens 131072 1048576] [--repeats 5] [--no-hbm] [--write]

Per session size (128K and 1M tokens: 117 and 939 MB), saved turn by turn (2,048 tokens a turn) into a
daemon of default settings (host tier + ssd, no HBM tier), on one CUDA device:
- (a) host tier -> CUDA tensors: ``Client.device_loader(device).load``, the loader's host path (the
  daemon has no HBM tier): ``load_session_into`` its page-locked buffer, then one upload;
  (a1) that first half alone, into a page-locked buffer of the benchmark's own (kvstore.cuda.pinned);
- (b) a memcpy of the same bytes into a reused, faulted-in buffer;
- (c) a pinned H2D of the same bytes: a ``pin_memory`` tensor into a reused device tensor, synchronized;
  (c1) the same from a buffer registered as the loader's is (``cudaHostRegister``);
- the issue's target: (a) <= 1.5 x ((b) + (c));
- (d) a second daemon, with an HBM tier holding the session: the load through the negotiated path (CUDA
  IPC, device to device, where the machine allows it) and through the host path (``DeviceLoader(ipc=False)``:
  the tier's batch read into pinned memory, into the loader's buffer, uploaded), beside (e) a device-to-
  device copy of the same bytes.
Every load is checked bit for bit once. Medians of ``--repeats``, the operations interleaved within a
repeat. Without CUDA it measures nothing and says so. Writes resume_geometry_gpu.md and .json
(benchmarks/out, or benchmarks/results with --write).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import RESULTS, git_state, machine, markdown_table, targets_table, write_result
from benchmarks.resume.geometry_raw import memcpy
from benchmarks.resume.geometry_session import LAYOUT, Session, label, make_session, section_title
from kvstore.client import Client
from kvstore.client.device_load import DeviceLoader
from kvstore.cuda.pinned import HostBuffer
from kvstore.errors import KvstoreError
from kvstore.server.process import DaemonProcess

NS, SID = "geometry", "agent"
TARGET = 1.5  # (a) <= TARGET x ((b) + (c))
NEEDS_CUDA = "geometry_gpu: a CUDA device is needed (torch.cuda.is_available() is False): nothing measured"

ROWS = [("device_host", "(a) host tier -> CUDA tensors: device_loader, host path"),
        ("into_pinned", "(a1) of which: load_session_into a page-locked buffer"),
        ("memcpy", "(b) memcpy into a reused buffer"),
        ("h2d_pinned", "(c) pinned H2D (pin_memory tensor -> reused device tensor)"),
        ("h2d_registered", "(c1) H2D from a cudaHostRegister'd buffer (as the loader's)"),
        ("hbm_negotiated", "(d) HBM tier -> CUDA tensors, negotiated path"),
        ("hbm_host", "(d) HBM tier -> CUDA tensors, host path"),
        ("d2d", "(e) device-to-device copy of the same bytes")]


@dataclass(frozen=True)
class GpuConfig:
    tokens: tuple[int, ...] = (131_072, 1_048_576)
    repeats: int = 5
    hbm: bool = True


@dataclass
class SizeResult:
    tokens: int
    chunks: int
    nbytes: int
    seconds: dict[str, list[float]] = field(default_factory=dict)  # metric -> samples
    paths: dict[str, str] = field(default_factory=dict)  # metric -> the loader's path (and why, for host)
    notes: list[str] = field(default_factory=list)

    def median(self, metric: str) -> float | None:
        s = self.seconds.get(metric)
        return statistics.median(s) if s else None


def sync_timed(fn: Callable[[], object], dev: torch.device) -> float:
    """Seconds of ``fn``, the device synchronized before and after."""
    torch.cuda.synchronize(dev)
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize(dev)
    return time.perf_counter() - t


class Mismatch(RuntimeError):
    """A load delivered other bytes than were saved: the run fails, whichever section it is in."""


def check_load(chunks: list[tuple[int, torch.Tensor]], expected: torch.Tensor, what: str) -> None:
    """The chunks, in order, are the session's bytes (``expected``, on the device)."""
    if [i for i, _ in chunks] != list(range(len(chunks))):
        raise Mismatch(f"{what}: the chunks came out of order or with gaps")
    got = torch.cat([t.reshape(-1) for _, t in chunks])
    if got.numel() != expected.numel() or not torch.equal(got, expected):
        raise Mismatch(f"{what}: the device holds other bytes than were saved")


def host_view(b: memoryview) -> torch.Tensor:
    """A uint8 CPU tensor over read-only bytes (read from only: torch's warning about that silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(b, dtype=torch.uint8)


def path_of(loader: DeviceLoader) -> str:
    return loader.path if not loader.reason else f"{loader.path} ({loader.reason})"


@contextlib.contextmanager
def saved(s: Session, data: Path, flags: list[str]) -> Iterator[tuple[DaemonProcess, Client]]:
    """A daemon started with ``flags`` holding the session, saved turn by turn, and a client of it."""
    d = DaemonProcess(data, flags).start()
    try:
        with Client(d.address) as client:
            for m, new in s.turns(SID):
                client.save_session(m, new)
            yield d, client
    finally:
        d.stop()


def placed_in(client: Client, tier: str, n: int, r: SizeResult) -> None:
    """Every chunk in ``tier`` (promoted there first if not; noted if still not)."""
    where = dict(client.get_session(NS, SID)[1])
    if where != {tier: n}:
        client.prefetch(NS, SID)
        client.wait_prefetched(NS, SID, timeout_s=120)
        where = dict(client.get_session(NS, SID)[1])
    if where != {tier: n}:
        r.notes.append(f"the chunks were in {where}, not all in the {tier} tier")


def pin_memory_probe(address: str, nbytes: int) -> str:
    """Whether the daemon can write into torch's own pinned memory (cudaHostAlloc), on a client of its
    own (a refusal is remembered by the client that met it)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    with Client(address) as c:
        try:
            c.load_session_into(NS, SID, buf)
            calls = c.stats().transport.caller_memory_calls
        except KvstoreError as e:
            return f"refused ({type(e).__name__}: {e})"
    return f"accepted (the daemon's caller-memory writes so far: {calls})"


def host_tier_round(s: Session, r: SizeResult, cfg: GpuConfig, data: Path, dev: torch.device,
                    packed: memoryview, expected: torch.Tensor) -> None:
    """(a), (a1), (b), (c), (c1), (e) against a default daemon (no HBM tier)."""
    n = s.nbytes
    dest = np.ones(n, np.uint8)  # faulted in once: every copy into it is a copy
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(host_view(packed))
    registered = HostBuffer(n, pin=True)
    registered.tensor[:n].copy_(pinned)
    on_device = torch.empty(n, dtype=torch.uint8, device=dev)
    d2d_dst = torch.empty(n, dtype=torch.uint8, device=dev)
    own = HostBuffer(n, pin=True)  # (a1)'s destination
    if not registered.pinned or not own.pinned:
        r.notes.append("cudaHostRegister failed: (a1)/(c1) ran from pageable memory")
    with saved(s, data, []) as (d, client):
        placed_in(client, "host", len(s.keys), r)
        loader = client.device_loader(dev)
        _, chunks = loader.load(NS, SID)  # warm-up: buffers sized and registered, connections made
        check_load(chunks, expected, "(a)")
        r.paths["device_host"] = path_of(loader)
        ops: dict[str, Callable[[], object]] = {
            "device_host": lambda: loader.load(NS, SID),
            "into_pinned": lambda: client.load_session_into(NS, SID, own.tensor),
            "memcpy": lambda: memcpy(packed, dest),
            "h2d_pinned": lambda: on_device.copy_(pinned, non_blocking=True),
            "h2d_registered": lambda: on_device.copy_(registered.tensor[:n], non_blocking=True),
            "d2d": lambda: d2d_dst.copy_(expected),
        }
        ops["into_pinned"]()
        if not torch.equal(own.tensor[:n], host_view(packed)):
            raise Mismatch("(a1): the host buffer holds other bytes than were saved")
        calls0 = client.stats().transport.caller_memory_calls
        for _ in range(cfg.repeats):
            for name, fn in ops.items():
                r.seconds.setdefault(name, []).append(sync_timed(fn, dev))
        writes = client.stats().transport.caller_memory_calls - calls0
        r.notes.append(f"caller-memory writes by the daemon in the timed loads (a) and (a1): {writes} of "
                       f"{2 * cfg.repeats}")
        if not torch.equal(on_device, expected):
            raise Mismatch("(c): the device holds other bytes than were uploaded")
        r.notes.append(f"load_session_into a pin_memory (cudaHostAlloc) tensor: {pin_memory_probe(d.address, n)}")
    registered.close()
    own.close()


def hbm_round(s: Session, r: SizeResult, cfg: GpuConfig, data: Path, dev: torch.device,
              expected: torch.Tensor) -> None:
    """(d): a daemon with an HBM tier on this device holding the session; both paths, interleaved."""
    capacity = max(1 << 30, 2 * s.nbytes)
    try:
        with saved(s, data, ["--hbm-capacity-bytes", str(capacity)]) as (_, client):
            placed_in(client, "hbm", len(s.keys), r)
            loaders = {"hbm_negotiated": client.device_loader(dev), "hbm_host": DeviceLoader(client, dev, ipc=False)}
            for name, loader in loaders.items():
                _, chunks = loader.load(NS, SID)
                check_load(chunks, expected, name)
                r.paths[name] = path_of(loader)
            for _ in range(cfg.repeats):
                for name, loader in loaders.items():
                    r.seconds.setdefault(name, []).append(sync_timed(functools.partial(loader.load, NS, SID), dev))
            loaders["hbm_host"].close()
    except Mismatch:
        raise
    except Exception as e:  # (d) is optional: a daemon that cannot start with an HBM tier is reported
        r.notes.append(f"(d) not measured: {type(e).__name__}: {e}")


def run_size(tokens: int, cfg: GpuConfig, work: Path, dev: torch.device) -> SizeResult:
    s = make_session(tokens, NS)
    packed = memoryview(b"".join(s.blobs))  # the session's bytes as a load places them: back to back, in order
    r = SizeResult(tokens, len(s.keys), s.nbytes)
    expected = host_view(packed).to(dev)
    host_tier_round(s, r, cfg, work / "default", dev, packed, expected)
    if cfg.hbm:
        hbm_round(s, r, cfg, work / "hbm", dev, expected)
    del expected
    torch.cuda.empty_cache()
    return r


# -- report ---------------------------------------------------------------------------------------
def ratios(r: SizeResult) -> dict[str, dict[str, Any]]:
    """(a) / ((b) + (c)) against the target, and the others shown beside it."""
    m = r.median

    def ratio(num: float | None, den: float | None) -> float | None:
        return num / den if num is not None and den else None

    b, c = m("memcpy"), m("h2d_pinned")
    floor = b + c if b is not None and c is not None else None
    out: dict[str, dict[str, Any]] = {}
    for name, num, den, target in [("(a) / ((b) + (c))", m("device_host"), floor, TARGET),
                                   ("(a1) / (b)", m("into_pinned"), b, None),
                                   ("(c1) / (c)", m("h2d_registered"), c, None),
                                   ("(d) host path / ((b) + (c))", m("hbm_host"), floor, None),
                                   ("(d) negotiated / (e)", m("hbm_negotiated"), m("d2d"), None)]:
        x = ratio(num, den)
        out[name] = {"ratio": x, "target": target, "met": None if target is None or x is None else x <= target}
    return out


def report(results: list[SizeResult], cfg: GpuConfig, command: str, device: str) -> str:
    lines = [f"`{command}`", "", f"{device}, torch {torch.__version__}, CUDA {torch.version.cuda}; {machine()}; "
             f"{git_state()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Layout {LAYOUT}, chunks of "
             f"{results[0].tokens // results[0].chunks} tokens, saved in turns of 2,048 tokens; default daemon "
             f"and client; medians of {cfg.repeats}, each operation synchronized, interleaved within a repeat.", ""]
    for r in results:
        rows = []
        for metric, what in ROWS:
            m = r.median(metric)
            if m is not None:
                rows.append([what, f"{m * 1e3:.1f}", f"{r.nbytes / m / 1e9:.1f}", r.paths.get(metric, "")])
        lines += [section_title(r.tokens, r.chunks, r.nbytes), "",
                  markdown_table(["", "ms", "GB/s", "path"], rows), ""]
        lines.append(targets_table("ratio", ratios(r)))
        lines += [""] + [f"- {n}" for n in r.notes] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=list(GpuConfig.tokens))
    p.add_argument("--repeats", type=int, default=GpuConfig.repeats)
    p.add_argument("--no-hbm", action="store_true", help="skip (d), the daemon with an HBM tier")
    p.add_argument("--work", type=Path, default=None, help="where the data dirs go (default: a temp dir)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(NEEDS_CUDA)
        return 0
    cfg = GpuConfig(tuple(args.tokens), args.repeats, not args.no_hbm)
    dev = torch.device("cuda", 0)  # the device the daemon's HBM tier takes by default
    command = "python benchmarks/resume/geometry_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="resume-geometry-gpu-", dir=args.work) as tmp:
        for tokens in cfg.tokens:
            t0 = time.perf_counter()
            work = Path(tmp) / label(tokens)
            work.mkdir(parents=True)
            results.append(run_size(tokens, cfg, work, dev))
            print(f"{label(tokens)}: {time.perf_counter() - t0:.0f} s", flush=True)
    text = report(results, cfg, command.strip(), torch.cuda.get_device_name(dev))
    print(text)
    path = write_result("resume_geometry_gpu.md", "Resume at the real geometry into GPU memory (issue 21)", text)
    (RESULTS / "resume_geometry_gpu.json").write_text(json.dumps(
        {"command": command.strip(), "git": git_state(), "device": torch.cuda.get_device_name(), "config": asdict(cfg),
         "sizes": [{**asdict(r), "medians": {k: r.median(k) for k in r.seconds}, "ratios": ratios(r)}
                   for r in results]}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
