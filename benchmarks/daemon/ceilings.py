"""What the machine and the raw engines reach on a session's bytes: the ceilings bench_daemon compares
kvstore against, each measured on the same bytes in the same run.

- raw Python gRPC: a trivial servicer in its own process (``grpc.aio`` or sync ``grpc.server`` with
  a thread pool) streams the session's bytes as messages of 256 KiB to 4 MiB, either as raw
  ``bytes`` (no serializer) or as a protobuf ``BytesValue``; one sync client per client process;
- one trivial unary round trip (empty request and response) against the same servers;
- memcpy (``np.copyto`` into a preallocated, pre-faulted destination);
- redis-py GET/SET and LMDB get / put+fsync of the chunk blobs;
- the disk's fsync'd bandwidth: ``dd ... oflag=direct conv=fsync`` beside the daemon's data.
Client-side functions return callables; bench_daemon times them in its client processes. The last
part judges: issue 10's targets as ratios to these ceilings, their tables and the plot.
"""

from __future__ import annotations

import asyncio
import re
import socket
import struct
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

MSG_SIZES = (256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20)
SERVERS = ("aio", "sync")
ENCODINGS = ("raw", "proto")
MAX_MESSAGE = 16 << 20  # channel limits, far above any message sent here
OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
SERVICE = "bench.Ceiling"
_REQUEST = struct.Struct("<QQ")  # (session bytes, message bytes)
Op = Callable[[], object]


class Combo(NamedTuple):
    """One configuration of the raw gRPC stream."""

    server: str  # "aio" | "sync"
    encoding: str  # "raw" | "proto"
    msg_bytes: int

    @property
    def label(self) -> str:
        return f"grpc {self.server} {self.encoding} {fmt_bytes(self.msg_bytes)}"


def fmt_bytes(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def combos(encodings: Sequence[str] = ENCODINGS) -> list[Combo]:
    return [Combo(s, e, m) for e in encodings for s in SERVERS for m in MSG_SIZES]


# -- the trivial servers (one process each) ------------------------------------------------------------
class _Payload:
    """The session's bytes cut into messages, cut once per (session bytes, message bytes)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._cuts: dict[tuple[int, int], list[bytes]] = {}

    def messages(self, request: bytes) -> list[bytes]:
        total, msg = _REQUEST.unpack(request)
        if (total, msg) not in self._cuts:
            self._cuts[(total, msg)] = [self.data[o:min(o + msg, total)] for o in range(0, total, msg)]
        return self._cuts[(total, msg)]


def serve(kind: str, data_path: Path, conn: Connection) -> None:
    """Run a trivial servicer of ``kind`` ("aio" or "sync") on a free loopback port; send the port
    through ``conn``, stop when ``conn`` receives anything. Streams slices of ``data_path``'s bytes."""
    import grpc
    from google.protobuf.wrappers_pb2 import BytesValue

    payload = _Payload(data_path.read_bytes())

    def stream_sync(request: bytes, context: Any) -> Iterator[bytes]:
        yield from payload.messages(request)

    def proto_sync(request: bytes, context: Any) -> Iterator[BytesValue]:
        for m in payload.messages(request):
            yield BytesValue(value=m)

    async def stream_aio(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for m in payload.messages(request):
            yield m

    async def proto_aio(request: bytes, context: Any) -> AsyncIterator[BytesValue]:
        for m in payload.messages(request):
            yield BytesValue(value=m)

    def unary_sync(request: bytes, context: Any) -> bytes:
        return b""

    async def unary_aio(request: bytes, context: Any) -> bytes:
        return b""

    aio = kind == "aio"
    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "raw": grpc.unary_stream_rpc_method_handler(stream_aio if aio else stream_sync),
        # what a servicer that speaks protobuf does per message: build it (copy in), serialize it
        "proto": grpc.unary_stream_rpc_method_handler(proto_aio if aio else proto_sync,
                                                      response_serializer=BytesValue.SerializeToString),
        "unary": grpc.unary_unary_rpc_method_handler(unary_aio if aio else unary_sync),
    })
    if aio:
        async def main() -> None:
            server = grpc.aio.server(options=OPTIONS)
            server.add_generic_rpc_handlers((handler,))
            conn.send(server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            await asyncio.to_thread(conn.recv)
            await server.stop(0)

        asyncio.run(main())
    else:
        server = grpc.server(ThreadPoolExecutor(max_workers=16), options=OPTIONS)
        server.add_generic_rpc_handlers((handler,))
        conn.send(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        conn.recv()
        server.stop(0)


# -- client side (runs in a client process) ---------------------------------------------------------------
class GrpcCeiling:
    """Sync channels to the trivial servers: one per server, warmed up at creation."""

    def __init__(self, ports: dict[str, int], warm_bytes: int = 16 << 20, warm_calls: int = 4) -> None:
        import grpc
        from google.protobuf.wrappers_pb2 import BytesValue

        self.channels = {k: grpc.insecure_channel(f"127.0.0.1:{p}", OPTIONS) for k, p in ports.items()}
        parse = {"raw": None, "proto": BytesValue.FromString}
        self._stream = {(k, enc): ch.unary_stream(f"/{SERVICE}/{enc}", response_deserializer=parse[enc])
                        for k, ch in self.channels.items() for enc in ENCODINGS}
        self._unary = {k: ch.unary_unary(f"/{SERVICE}/unary") for k, ch in self.channels.items()}
        # a fresh channel's HTTP/2 flow-control window grows over its first calls: warm each one well
        for server in self.channels:
            for _ in range(warm_calls):
                self.load(Combo(server, "raw", 1 << 20), warm_bytes)

    def load(self, c: Combo, nbytes: int) -> int:
        """Receive ``nbytes`` streamed as ``c`` describes; the bytes received."""
        it = self._stream[(c.server, c.encoding)](_REQUEST.pack(nbytes, c.msg_bytes))
        got = sum(len(m) for m in it) if c.encoding == "raw" else sum(len(m.value) for m in it)
        if got != nbytes:
            raise RuntimeError(f"{c.label}: received {got} bytes, expected {nbytes}")
        return got

    def unary(self, server: str) -> Op:
        call = self._unary[server]
        return lambda: call(b"")

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()


def memcpy(src: bytes) -> Op:
    """``np.copyto`` of ``src`` into a destination allocated and written (every page faulted) once."""
    s = np.frombuffer(src, np.uint8)
    d = np.ones_like(s)
    return lambda: np.copyto(d, s)


def redis_ops(r: Any, keys: Sequence[bytes], blobs: Sequence[bytes], expect: Callable[[int], None]
              ) -> dict[str, Op]:
    """redis-py on the same blobs: one command per chunk in one non-transactional pipeline (xN),
    and the session as one value (1)."""
    rkeys, big_key, big = [b"c:" + k for k in keys], b"session:" + keys[0], b"".join(blobs)

    def pipelined(cmd: str) -> list[Any]:
        p = r.pipeline(transaction=False)
        for k, b in zip(rkeys, blobs):
            p.set(k, b) if cmd == "set" else p.get(k)
        return p.execute()

    return {"save redis SET xN": lambda: pipelined("set"),
            "save redis SET 1": lambda: r.set(big_key, big),
            "load redis GET xN": lambda: expect(sum(map(len, pipelined("get")))),
            "load redis GET 1": lambda: expect(len(r.get(big_key)))}


def lmdb_ops(env: Any, keys: Sequence[bytes], blobs: Sequence[bytes], expect: Callable[[int], None]
             ) -> tuple[Op, Op, Op]:
    """(put: one write txn, fsync on commit; get: one read txn, every value copied out as bytes;
    drop: delete the keys, so each put writes them afresh as a kvstore save does)."""
    def put() -> None:
        with env.begin(write=True) as txn:
            for k, b in zip(keys, blobs):
                txn.put(k, b)

    def get() -> None:
        with env.begin() as txn:
            expect(sum(len(txn.get(k)) for k in keys))

    def drop() -> None:
        with env.begin(write=True) as txn:
            for k in keys:
                txn.delete(k)

    return put, get, drop


# -- servers this run owns, and the disk -----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port: int) -> subprocess.Popen[bytes]:
    """A private redis-server without persistence on ``port``, ready."""
    import redis

    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = redis.Redis(host="127.0.0.1", port=port)
    for _ in range(100):
        try:
            r.ping()
            return proc
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


DD_RATE = re.compile(r"^(\d+) bytes .* copied, ([\d.e+-]+) s", re.M)


def dd_fsync_gbps(directory: Path, mib: int = 256, runs: int = 3) -> list[float]:
    """GB/s of ``dd if=/dev/zero of=<directory>/dd.bin bs=4M count=mib/4 oflag=direct conv=fsync``
    as dd itself reports it (its time includes the final fsync), one value per run; a fresh file
    each run."""
    path, out = directory / "dd-fsync.bin", []
    for _ in range(runs):
        r = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={mib // 4}", "oflag=direct",
                            "conv=fsync"], capture_output=True, text=True, check=True)
        path.unlink()
        m = DD_RATE.search(r.stderr)
        if m is None:
            raise RuntimeError(f"cannot parse dd's output: {r.stderr!r}")
        out.append(int(m[1]) / float(m[2]) / 1e9)
    return out


# -- judging: kvstore's numbers against the ceilings of the same run --------------------------------------
Rows = dict[tuple[int, int], dict[str, float]]  # (session MiB, clients) -> op -> value


class Target(NamedTuple):
    """One goal, judged on ratios measured in one run: met when every case is at least (or at
    most) ``need``; n/a when a path was not measured."""

    goal: str
    path: str
    cases: list[tuple[str, float]]  # (where, measured ratio)
    need: float
    at_least: bool = True  # else: at most
    strict: bool = False  # more (or less) than ``need``, not equal

    @property
    def status(self) -> str:
        vals = [v for _, v in self.cases]
        if not vals or any(v != v for v in vals):  # NaN: not measured
            return "n/a"
        lo, hi = (self.need, float("inf")) if self.at_least else (float("-inf"), self.need)
        ok = all((lo < v < hi) if self.strict else (lo <= v <= hi) for v in vals)
        return "met" if ok else "NOT met"

    def row(self) -> list[str]:
        cases = ", ".join(f"{w} {'n/a' if v != v else f'{v:.2f}x'}" for w, v in self.cases)
        op = (">" if self.at_least else "<") + ("" if self.strict else "=")
        return [self.goal, self.path, cases, f"{op} {self.need:g}x", f"**{self.status}**"]


def targets(gbps: Rows, p50: dict[str, float], dd: float, stream: list[str], local: list[str]) -> list[Target]:
    """Issue 10's targets in its order, each a ratio of two numbers of one run, per path and case:
    ``gbps`` per (MiB, clients) row and op, ``p50`` seconds per op of the latency row, ``dd`` GB/s;
    ``stream`` / ``local`` name the kvstore paths judged as gRPC / same-host paths."""
    nan, big, small = float("nan"), max(m for m, _ in gbps), min(m for m, _ in gbps)
    unary = min(p50[f"unary {s}"] for s in SERVERS)

    def cases(k: str, ref: Callable[[dict[str, float]], float], only: int | None = None) -> list[tuple[str, float]]:
        return [(f"{m} MiB x{nc}", r.get(k, nan) / ref(r)) for (m, nc), r in gbps.items() if only in (None, m)]

    return [
        *(Target("gRPC load >= 0.9x the best raw gRPC ceiling, every size", k,
                 cases(f"load {k}", lambda r: best(r)[1]), 0.9) for k in stream),
        *(Target(f"same-host load of {big} MiB >= 0.6x memcpy", k, cases(f"load {k}", lambda r: r["memcpy"], big), 0.6)
          for k in local),
        *(Target(f"{small} MiB load p50 <= 1.5x one trivial unary round trip", k,
                 [("x1", p50.get(f"load {k}", nan) / unary)], 1.5, at_least=False) for k in stream + local),
        *(Target(f"durable {small} MiB turn save p50 <= 2x raw LMDB put+fsync", k,
                 [("x1", p50.get(f"save {k}", nan) / p50["save lmdb put+fsync"])], 2.0, at_least=False)
          for k in stream + local),
        *(Target("durable save GB/s >= 0.6x dd oflag=direct conv=fsync", k,
                 cases(f"save {k}", lambda r: dd, big), 0.6) for k in stream + local),
        *(Target("same-host load faster than raw redis-py GET (the faster of xN and 1), every size", k,
                 cases(f"load {k}", lambda r: max(r["load redis GET xN"], r["load redis GET 1"])), 1.0, strict=True)
          for k in local)]


def plot(path: Path, sizes_mb: list[float], panels: dict[tuple[str, int], dict[str, list[float]]],
         hlines: dict[str, dict[str, float]], title: str) -> Path:
    """GB/s vs session size, one panel per (op, clients), rows in ``panels``' order: series named
    ``"kv ..."`` solid, ``"ceiling ..."`` black dashed, the rest (raw engines) dashed in colour;
    ``hlines[op]`` are size-independent ceilings (black dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(op for op, _ in panels))
    ncs = sorted({nc for _, nc in panels})
    fig, axes = plt.subplots(len(ops), len(ncs), figsize=(5.5 * len(ncs) + 2, 4 * len(ops)), squeeze=False,
                             sharey="row")
    for row, op in enumerate(ops):
        vals = [v for (o, _), ser in panels.items() if o == op for ys in ser.values() for v in ys if v == v and v > 0]
        vals += list(hlines.get(op, {}).values())
        lo, hi = min(vals) / 1.3, max(vals) * 1.3
        for col, nc in enumerate(ncs):
            ax = axes[row][col]
            greys = iter(("black", "dimgray", "darkgray"))
            for i, (name, ys) in enumerate(panels[(op, nc)].items()):
                kind, label = name.split(" ", 1) if name.startswith(("kv ", "ceiling ")) else ("", name)
                ax.plot(sizes_mb, ys, marker={"kv": "o", "ceiling": "s"}.get(kind, "."), label=label,
                        linestyle="-" if kind == "kv" else "--", linewidth=2.5 if kind == "ceiling" else 1.5,
                        color=next(greys) if kind == "ceiling" else f"C{i}")
            for name, y in hlines.get(op, {}).items():
                ax.axhline(y, color="black", linewidth=1.5, linestyle=":", label=name.removeprefix("ceiling "))
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks(sizes_mb, [f"{s:.1f}" for s in sizes_mb])
            ticks = [t for t in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100) if lo <= t <= hi]
            ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
            ax.set_ylim(lo, hi)
            ax.minorticks_off()
            ax.grid(True, which="major", alpha=0.3)
            ax.set_title(f"{op}, {nc} client{'s' if nc > 1 else ''}")
            ax.set_xlabel("session size (MB)")
            ax.set_ylabel("GB/s (all clients)")
            if col == len(ncs) - 1:
                ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def best(gbps: dict[str, float]) -> tuple[str, float]:
    """The fastest raw gRPC configuration among ``"ceil ..."`` results: (label, GB/s)."""
    name = max((k for k in gbps if k.startswith("ceil ")), key=gbps.__getitem__)
    return name.removeprefix("ceil "), gbps[name]


def grpc_table(res: dict[tuple[int, int], dict[str, float]], sizes_mb: dict[int, float]) -> str:
    """Every raw gRPC configuration (rows) at every session size x clients (columns), the best in
    bold, under a caption that says what was measured."""
    from benchmarks.common import markdown_table

    cols = list(res)
    rows = []
    for c in combos():
        cells = []
        for col in cols:
            v = res[col].get(f"ceil {c.label}")
            cells.append("-" if v is None else f"**{v:.2f}**" if best(res[col])[0] == c.label else f"{v:.2f}")
        rows.append([c.label.removeprefix("grpc "), *cells])
    return CAPTION + markdown_table(["server, encoding, message", *(f"{sizes_mb[m]:.1f} MB x{nc}" for m, nc in cols)],
                                    rows)


CAPTION = """Raw Python gRPC stream, GB/s: a trivial servicer in its own process (grpc.aio, or sync
`grpc.server` with 16 threads) streams the session's bytes to one sync client per client process,
as raw `bytes` messages (no serializer) or as protobuf `BytesValue` (1 client only). "The ceiling"
of a column is its best cell (bold), chosen per column: the best of 10-20 noisy medians, so if
anything a little generous.

"""
METHODOLOGY = """- memcpy = `np.copyto` of the session's bytes into a preallocated, pre-faulted array. redis-py:
  private `redis-server --save "" --appendonly no`, hiredis; xN = one command per chunk in one
  pipeline, 1 = the session as one value. LMDB: one env per client beside the daemon's data dir;
  put = one write txn, fsync on commit, keys deleted (untimed) after each; get = one read txn,
  values copied out as bytes. dd: a fresh file each run, its own reported rate (which includes
  the final fsync).
"""


def cost_table(nbytes: dict[int, int], seconds: dict[str, dict[int, float]]) -> str:
    """Per op, the least-squares split of its median time over sizes into a fixed cost per call and
    a marginal rate, beside its time at the smallest and largest size."""
    from benchmarks.common import call_cost, markdown_table

    lo, hi = min(nbytes), max(nbytes)
    rows = []
    for name, by_size in seconds.items():
        ms = sorted(by_size)
        fixed, rate = call_cost([nbytes[m] for m in ms], [by_size[m] for m in ms])
        rows.append([name, f"{by_size[lo] * 1e3:.2f}", f"{by_size[hi] * 1e3:.1f}", f"{fixed * 1e3:.2f}",
                     f"{rate:.2f}", f"{min(1.0, max(0.0, fixed / by_size[lo])):.0%}"])
    return markdown_table(["op (1 client)", f"ms at {nbytes[lo] / 1e6:.1f} MB", f"ms at {nbytes[hi] / 1e6:.1f} MB",
                           "fixed ms per call", "marginal GB/s", f"fixed share at {nbytes[lo] / 1e6:.1f} MB"], rows)
