"""kvstore beside LMCache's server, redis-py and raw LMDB: the same session bytes saved and loaded.

    python benchmarks/peers/bench_peers.py [--quick] [--session-mib 8] [--clients 1,8] [--repeats 5]

One run installs LMCache (pinned, CPU torch) into benchmarks/.peers-venv on first use
(``peers_venv.py``), starts a kvstore daemon per chunk size (default durable config: every save is
an fsync'd LMDB commit, plus the host-memory tier), LMCache's ``lmcache_server`` in CPU mode and a
redis-server without persistence, and one client process per client and system: kvstore, redis-py
and LMDB in kvstore's venv (``peers_kv_worker.py``), LMCache's own ``lm://`` client in the peers
venv (``peers_lmc_worker.py``). Per chunk size (256 tokens = 229,208 B ~ 224 KiB, 1,172 tokens =
1,048,136 B ~ 1 MiB, real deepseek-v4.1-flash chunks) and client count, every system saves and
loads the same session bytes, interleaved round by round; a round's wall time runs from the first
client's start to the last one's end. Writes results/peers.{md,json,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import common
from benchmarks.daemon import ceilings
from benchmarks.peers import peers_proto, peers_report, peers_venv
from kvstore.format import chunk
from kvstore.format.layout import get_layout
from kvstore.server.process import DaemonProcess

HERE = Path(__file__).resolve().parent
VENV = HERE.parent / ".peers-venv"  # benchmarks/.peers-venv (git-ignored)
CHUNKS = {"256 KiB": 256, "1 MiB": 1172}  # label -> chunk tokens at deepseek-v4.1-flash
KV_PEERS = ("kvstore-grpc", "kvstore-local", "kvstore-grpc-nosync", "kvstore-local-nosync", "redis", "lmdb")
SAVE_ONLY = ("kvstore-grpc-nosync", "kvstore-local-nosync")  # loads read the same host tier
LMC_PEERS = ("lmcache-server", "lmcache-engine")


@dataclass(frozen=True)
class RunConfig:
    session_bytes: int
    clients: tuple[int, ...]
    warmup: int
    repeats: int


class Proc:
    """A client process speaking ``peers_proto``: one JSON command in, one ``@@`` answer out."""

    def __init__(self, python: str, script: Path, log: Path, env: dict[str, str]) -> None:
        self.log = log
        with open(log, "ab") as err:
            self.p = subprocess.Popen([python, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=err, text=True, env=env)

    def send(self, **cmd: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def recv(self) -> Any:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith(peers_proto.PREFIX):
                value = json.loads(line[len(peers_proto.PREFIX):])
                if isinstance(value, dict) and "error" in value:
                    raise RuntimeError(f"client process failed:\n{value['error']}")
                return value
        raise RuntimeError(f"client process exited ({self.p.wait()}); its log:\n{self.log.read_text()[-3000:]}")

    def quit(self) -> None:
        if self.p.poll() is None:
            with contextlib.suppress(OSError):
                self.send(op="quit")

    def stop(self) -> None:
        """After ``quit``: wait a little, then kill."""
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def all_of(procs: list[Proc], **cmd: Any) -> list[Any]:
    for p in procs:
        p.send(**cmd)
    return [p.recv() for p in procs]


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lmcache_server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("lmcache_server did not listen")


def measure_row(kv: list[Proc], lmc: list[Proc], cfg: RunConfig, tmp: Path, info: dict[str, Any], **setup: Any
                ) -> dict[str, list[float]]:
    """Walls (s) of every save and load op over ``cfg.warmup + cfg.repeats`` interleaved rounds;
    what the LMCache clients say at setup goes into ``info``."""
    for i, p in enumerate(kv):
        p.send(op="setup", idx=i, blob_file=str(tmp / f"blobs{i}.bin"), lmdb_dir=str(tmp / f"lmdb{i}-{len(kv)}"),
               **setup)
    [p.recv() for p in kv]
    for i, p in enumerate(lmc):
        p.send(op="setup", idx=i, blob_file=str(tmp / f"blobs{i}.bin"), **setup)
    info.update(*[p.recv() for p in lmc][:1])
    groups = [(f"{op} {peer}", kv) for op in ("save",) for peer in KV_PEERS]
    groups += [(f"save {peer}", lmc) for peer in LMC_PEERS if lmc]
    walls: dict[str, list[float]] = {}
    for phase in ("save", "load"):
        if phase == "load":
            all_of(kv + lmc, op="prepare")
            groups = [(name.replace("save", "load", 1), procs) for name, procs in groups
                      if name.split(" ", 1)[1] not in SAVE_ONLY]
        for r in range(cfg.warmup + cfg.repeats):
            for name, procs in groups:
                stamps = all_of(procs, op=name)
                if r >= cfg.warmup:
                    walls.setdefault(name, []).append(max(e for _, e in stamps) - min(s for s, _ in stamps))
    return walls


def run(cfg: RunConfig, env_info: peers_venv.PeersEnv) -> dict[str, Any]:
    lay = get_layout("deepseek-v4.1-flash")
    tmp = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LMCACHE_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
           "PYTHONHASHSEED": "0"}  # LMCache's token hashes: stable across its processes, as it asks
    out: dict[str, Any] = {"rows": [], "filesystem": subprocess.run(
        ["df", "--output=source,fstype", str(tmp)], capture_output=True, text=True).stdout.split("\n")[1].split()}
    redis_proc, lmc_server, procs = ceilings.start_redis(redis_port := ceilings.free_port()), None, []
    daemons: dict[tuple[int, bool], DaemonProcess] = {}
    try:
        t0 = time.perf_counter()
        # every daemon (a durable one and a --no-sync one per chunk size) starts at once, beside the clients
        for ct in CHUNKS.values():
            for nosync in (False, True):
                daemons[(ct, nosync)] = DaemonProcess(tmp / f"daemon{ct}{'-nosync' * nosync}",
                                                      ["--log-level", "WARNING", "--chunk-tokens", str(ct),
                                                       *(["--no-sync"] * nosync)])
        with ThreadPoolExecutor(len(daemons)) as ex:
            starting = [ex.submit(d.start) for d in daemons.values()]
            n_max = max(cfg.clients)
            procs += [Proc(sys.executable, HERE / "peers_kv_worker.py", tmp / f"kv{i}.log", env) for i in range(n_max)]
            lmc_port = 0
            if env_info.python is not None:
                lmc_port = ceilings.free_port()
                with open(tmp / "lmcache_server.log", "ab") as log:
                    lmc_server = subprocess.Popen([str(env_info.python.parent / "lmcache_server"), "127.0.0.1",
                                                   str(lmc_port), "cpu"], stdout=log, stderr=log, env=env)
                wait_port(lmc_port, lmc_server)
                procs += [Proc(str(env_info.python), HERE / "peers_lmc_worker.py", tmp / f"lmc{i}.log", env)
                          for i in range(n_max)]
            for f in starting:
                f.result()
        kv, lmc = procs[:n_max], procs[n_max:]
        print(f"servers up ({time.perf_counter() - t0:.0f} s)", flush=True)
        for label, ct in CHUNKS.items():
            size = chunk.encoded_size(lay, ct)
            n = max(1, round(cfg.session_bytes / size))
            for nc in cfg.clients:
                t = time.perf_counter()
                setup = {"address": daemons[(ct, False)].address, "address_nosync": daemons[(ct, True)].address,
                         "chunk_tokens": ct, "n_chunks": n, "chunk_bytes": size, "redis_port": redis_port,
                         "port": lmc_port}
                info: dict[str, Any] = {}
                walls = measure_row(kv[:nc], lmc[:nc], cfg, tmp, info, **setup)
                out["rows"].append({"chunk": label, "chunk_tokens": ct, "chunk_bytes": size, "n_chunks": n,
                                    "clients": nc, "walls_s": walls, **info})
                print(f"{label} x {nc} clients ({time.perf_counter() - t:.0f} s): " + ", ".join(
                    f"{k} {nc * n * size / statistics.median(v) / 1e9:.2f}" for k, v in walls.items())
                    + " GB/s", flush=True)
    finally:
        for p in procs:
            p.quit()
        for p in procs:
            p.stop()
        for d in daemons.values():  # SIGTERM to all first: they shut down in parallel
            if d.proc is not None and d.proc.poll() is None:
                d.proc.terminate()
        for d in daemons.values():
            d.stop()
        for proc in (lmc_server, redis_proc):
            if proc is not None:
                proc.terminate()
                proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 MiB sessions, 1 and 2 clients, 2 repeats")
    ap.add_argument("--session-mib", type=float, default=8, help="bytes each client saves and loads per op")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--from-json", type=Path, help="rewrite the report from a run's peers.json; measure nothing")
    args = ap.parse_args()
    if args.from_json:
        for path in peers_report.report(json.loads(args.from_json.read_text())):
            print(f"wrote {path}")
        return
    if args.quick:
        args.session_mib, args.clients, args.repeats = 2, "1,2", 2
    began, load_before = time.perf_counter(), os.getloadavg()
    env_info = peers_venv.ensure(VENV)
    print(f"LMCache: {env_info.lmcache or 'NOT installed: ' + env_info.error} ({time.perf_counter() - began:.0f} s)")
    cfg = RunConfig(int(args.session_mib * (1 << 20)), tuple(sorted(map(int, args.clients.split(",")))),
                    args.warmup, args.repeats)
    res = run(cfg, env_info)
    res |= {"lmcache": env_info.__dict__ | {"python": str(env_info.python)}, "config": cfg.__dict__,
            "load_before": load_before, "load_after": os.getloadavg(), "elapsed_s": time.perf_counter() - began,
            "command": " ".join(["python benchmarks/peers/bench_peers.py", *sys.argv[1:]]),
            "date": f"{datetime.now(UTC):%Y-%m-%d %H:%M}", "git": common.git_state(),
            "machine": f"{common.machine()}, {os.cpu_count()} cores"}
    for path in peers_report.report(res):
        print(f"wrote {path}")
    print(f"run took {res['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
