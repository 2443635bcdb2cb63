"""Where a small session load's time goes: end-to-end calls through a real daemon, beside the parts
of the load measured alone in this process.

    python benchmarks/daemon/profile_load.py [--mib 1] [--rounds 200] [--py-spy PATH] [--against DIR]

Against a daemon (port 0, temp data dir, default config), interleaved round by round, p50 of each:
one trivial unary call (GetServerInfo), the health check, a LoadSession of a session with no chunks,
and the session loaded over the arena and over the stream (time to the first message and to the
last blob). In this process, on a store opened with the daemon's default config: the store's read
(``SessionStore.read``: host-tier hits, verified), the copy into an arena, the stream's framing and
protobuf building, one ``asyncio.to_thread`` hop, and the client's parsing of the answer.
``--py-spy PATH``: also record the daemon with py-spy (a flame graph SVG at PATH; collapsed stacks
for a ``.txt`` PATH).
``--against DIR``: a second daemon run from another checkout (e.g. ``git worktree add DIR HEAD~1``),
measured interleaved with this one, call for call: a before/after under the same machine load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import common
from benchmarks.daemon.bench_daemon import CHUNK_TOKENS, LAYOUT, manifest_for
from kvstore.client import Client
from kvstore.format import chunk
from kvstore.format.layout import get_layout
from kvstore.store import SessionStore
from kvstore.transport import convert, shm
from kvstore.transport.carrier import ArenaCarrier, StreamCarrier
from kvstore.v1 import kvstore_pb2 as pb

NS = "prof"


def p50_us(fn: Callable[[], object], rounds: int) -> float:
    fn()
    t: list[int] = []
    for _ in range(rounds):
        a = time.perf_counter_ns()
        fn()
        t.append(time.perf_counter_ns() - a)
    return statistics.median(t) / 1e3


def _read(sessions: SessionStore, keys: list[bytes]) -> None:
    """A load of ``keys`` through the store's one read path (verified, the views dropped unused)."""
    with sessions.read(NS, keys):
        pass


def daemon_ops(address: str, blobs: list[bytes], keys: list[bytes], ids: object
               ) -> tuple[dict[str, Callable[[], object]], list[Client]]:
    """The calls to time against one daemon, and the clients to close after."""
    arena = Client(address=address, shared_memory=True, arena_bytes=80 << 20)
    stream = Client(address=address, shared_memory=False)
    arena.save_session(manifest_for(NS, "s", keys, ids), blobs)  # type: ignore[arg-type]
    arena.save_session(manifest_for(NS, "empty", [], ids), [])  # type: ignore[arg-type]
    assert arena.uses_shared_memory and not stream.uses_shared_memory

    def load(c: Client, sid: str) -> None:
        _, it = c.load_session(NS, sid, zero_copy=True)
        for _ in it:
            pass

    def first(c: Client) -> None:  # the call up to its first message (the manifest and first chunks)
        next(c._stub.LoadSession(pb.LoadSessionRequest(namespace=NS, session_id="s", arena_id=c.carrier.arena_id),
                                 metadata=c._metadata))

    ops: dict[str, Callable[[], object]] = {
        "unary GetServerInfo": lambda: stream._stub.GetServerInfo(pb.GetServerInfoRequest()),
        "health": stream.health,
        "LoadSession, no chunks": lambda: load(stream, "empty"),
        "arena load": lambda: load(arena, "s"),
        "arena load, first message": lambda: first(arena),
        "stream load": lambda: load(stream, "s"),
        "stream load, first message": lambda: first(stream),
    }
    return ops, [arena, stream]


def end_to_end(addresses: dict[str, str], blobs: list[bytes], keys: list[bytes], ids: object, rounds: int
               ) -> dict[str, float]:
    """p50 (us) of each call through each daemon, interleaved so machine drift hits them alike."""
    ops: dict[str, Callable[[], object]] = {}
    clients: list[Client] = []
    for label, address in addresses.items():
        o, c = daemon_ops(address, blobs, keys, ids)
        ops |= {f"{k}{label}": fn for k, fn in o.items()}
        clients += c
    times: dict[str, list[int]] = {k: [] for k in ops}
    for r in range(rounds + 20):
        for k, fn in ops.items():
            a = time.perf_counter_ns()
            fn()
            if r >= 20:  # warm-up rounds (HTTP/2 flow-control windows grow over the first calls)
                times[k].append(time.perf_counter_ns() - a)
    for c in clients:
        c.close()
    return {k: statistics.median(v) / 1e3 for k, v in sorted(times.items())}


def parts(tmp: Path, blobs: list[bytes], keys: list[bytes], ids: object, rounds: int) -> dict[str, float]:
    """p50 (us) of the load's parts, each alone, in this process."""
    from kvstore.server.config import DaemonConfig
    from kvstore.store import open_store

    sessions = open_store(DaemonConfig(data_dir=str(tmp / "parts")).store_config())
    try:
        m = manifest_for(NS, "s", keys, ids)  # type: ignore[arg-type]
        sessions.save_session(NS, m.layout_id, bytes(16), 0, blobs, m)
        arena = shm.Arena.create(Path(tempfile.mkdtemp()), 80 << 20)
        ac = ArenaCarrier(arena, "a")
        sc = StreamCarrier()
        pairs = list(enumerate(blobs))
        stream_msgs = [pb.LoadSessionResponse(chunks=p.message()).SerializeToString() for p in sc.send(pairs)]
        arena_msg = pb.LoadSessionResponse(chunks=next(ac.send(pairs)).message()).SerializeToString()

        def parse_stream() -> None:
            rec = sc.receiver()
            for raw in stream_msgs:
                rec.feed(pb.LoadSessionResponse.FromString(raw).chunks)

        def parse_arena() -> None:
            ac.receiver(copy=False).feed(pb.LoadSessionResponse.FromString(arena_msg).chunks)

        loop = asyncio.new_event_loop()
        out = {
            "store load (host hits, verified)": p50_us(lambda: _read(sessions, keys), rounds),
            "  of which checksum (xxh3)": p50_us(lambda: [chunk.verify_checksum(b) for b in blobs], rounds),
            "arena copy (carrier.send)": p50_us(lambda: list(ac.send(pairs)), rounds),
            "stream framing + protobuf build": p50_us(
                lambda: [pb.LoadSessionResponse(chunks=p.message()).SerializeToString() for p in sc.send(pairs)],
                rounds),
            "asyncio.to_thread hop (idle)": p50_us(lambda: loop.run_until_complete(asyncio.to_thread(int)), rounds),
            "client parse, stream": p50_us(parse_stream, rounds),
            "client parse, arena": p50_us(parse_arena, rounds),
            "manifest get + to_pb": p50_us(lambda: convert.session_to_pb(
                sessions.get(NS, "s")), rounds),
        }
        loop.close()
        arena.close()
        return out
    finally:
        sessions.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--py-spy", type=Path, help="record the daemon with py-spy into this SVG")
    ap.add_argument("--against", type=Path, help="another checkout's daemon, measured interleaved")
    args = ap.parse_args()
    from kvstore.server.process import DaemonProcess

    chunk_bytes = len(common.chunk_session(get_layout(LAYOUT), NS, 1, CHUNK_TOKENS, seed=0)[0][0])
    n = max(1, round((args.mib << 20) / chunk_bytes))
    blobs, keys, ids = common.chunk_session(get_layout(LAYOUT), NS, n, CHUNK_TOKENS, seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="profile-load-"))
    with contextlib.ExitStack() as stack:
        d = stack.enter_context(DaemonProcess(tmp / "daemon", ["--log-level", "WARNING"]))
        addresses = {"": d.address}
        if args.against:  # `python -m cli.main` in that directory imports that checkout's kvstore
            here = os.getcwd()
            os.chdir(args.against)
            try:
                addresses[f" [{args.against.name}]"] = stack.enter_context(
                    DaemonProcess(tmp / "against", ["--log-level", "WARNING"])).address
            finally:
                os.chdir(here)
        spy = None
        if args.py_spy:
            spy = subprocess.Popen(["py-spy", "record", "-o", str(args.py_spy), "--pid", str(d.proc.pid),  # type: ignore[union-attr]
                                    "--threads", "--nonblocking", "--idle",
                                    "--format", "raw" if args.py_spy.suffix == ".txt" else "flamegraph"])
        e2e = end_to_end(addresses, blobs, keys, ids, args.rounds)
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
    local = parts(tmp, blobs, keys, ids, args.rounds)
    print(f"{n} chunks, {n * chunk_bytes} B; p50 of {args.rounds} rounds, us")
    print(common.markdown_table(["through the daemon", "p50 us"], [(k, f"{v:.0f}") for k, v in e2e.items()]))
    print()
    print(common.markdown_table(["part, alone in this process", "p50 us"], [(k, f"{v:.0f}") for k, v in local.items()]))
    for label in addresses:
        h = e2e["health" + label]
        print(f"{label or 'this checkout'}: arena load / health {e2e['arena load' + label] / h:.2f}x,"
              f" stream load / health {e2e['stream load' + label] / h:.2f}x")


if __name__ == "__main__":
    main()
