"""A hostile same-host client, run as a process of its own:
``python benchmarks/reliability/hostile_client.py SPEC CASE``.

It runs as the daemon's user (the only user the daemon shares memory with) and does to an arena what
such a client can: truncates its file under the daemon (once, or over and over while its own calls
run through it), punches its pages out, attaches a sparse file, a memfd without seals, a hugetlbfs
memfd, an fd that is no memfd at all, several fds, an arena path with a NUL byte, then calls
LoadChunks, LoadSession and SaveChunks through it. Each step's answer is printed as one JSON object,
``{step: [status code name, details]}`` (for steps repeated while the file is truncated:
``["COUNTS", json of {code: count}]``); benchmarks/reliability/hostile.py says what each step must
get. SPEC is a JSON file: ``address``, ``token``, ``namespace``, ``session_id``, ``keys`` (hex) and
``layout_id`` (hex) of a session this client's token saved, ``blob`` (hex) of its first chunk,
``scratch``, a directory for a file on disk, and optionally ``seconds`` (how long the in-flight
cases run) and ``sparse_bytes``.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvstore.transport import local_channel, shm
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x1, 0x2
SIZE = 1 << 20
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
Outcome = list[str]


@dataclass
class Hostile:
    spec: dict[str, Any]
    grpc_stub: pb_grpc.KVStoreStub
    local: local_channel.LocalChannel
    shm_dir: Path

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.spec['token']}"),)

    @property
    def local_stub(self) -> pb_grpc.KVStoreStub:
        return pb_grpc.KVStoreStub(self.local)

    def attach_path(self, path: str, size: int, nonce: bytes, stub: pb_grpc.KVStoreStub | None = None) -> Outcome:
        req = pb.AttachArenaRequest(path=path, size=size, nonce=nonce)
        return outcome(lambda: (stub or self.grpc_stub).AttachArena(req, timeout=30, metadata=self.metadata).arena_id)

    def attach_fds(self, fds: list[int], size: int, nonce: bytes) -> Outcome:
        call = self.local.unary_with_fds(local_channel.ATTACH_ARENA, pb.AttachArenaRequest.SerializeToString,
                                         pb.AttachArenaResponse.FromString)
        req = pb.AttachArenaRequest(size=size, nonce=nonce)
        return outcome(lambda: call(req, fds, timeout=30, metadata=self.metadata).arena_id)

    def call_fns(self, arena_id: str) -> dict[str, Callable[[], Outcome]]:
        """The three calls that touch an arena, named by ``arena_id``, over gRPC and the local socket."""
        s, blob = self.spec, bytes.fromhex(self.spec["blob"])
        keys = [bytes.fromhex(k) for k in s["keys"]]
        load_chunks = pb.LoadChunksRequest(namespace=s["namespace"], keys=keys, arena_id=arena_id)
        load_session = pb.LoadSessionRequest(namespace=s["namespace"], session_id=s["session_id"], arena_id=arena_id)
        header = pb.SaveHeader(namespace=s["namespace"], layout_id=bytes.fromhex(s["layout_id"]), parent_key=b"",
                               first_index=0, arena_id=arena_id, arena_bytes=len(blob))
        md = self.metadata
        out: dict[str, Callable[[], Outcome]] = {}
        for transport, stub in (("grpc", self.grpc_stub), ("local", self.local_stub)):
            out[f"LoadChunks {transport}"] = lambda stub=stub: outcome(
                lambda: len(list(stub.LoadChunks(load_chunks, timeout=30, metadata=md))))
            out[f"LoadSession {transport}"] = lambda stub=stub: outcome(
                lambda: len(list(stub.LoadSession(load_session, timeout=30, metadata=md))))
            out[f"SaveChunks {transport}"] = lambda stub=stub: outcome(
                lambda: stub.SaveChunks(iter([pb.SaveChunksRequest(header=header)]), timeout=30, metadata=md).written)
        return out

    def calls(self, arena_id: str) -> dict[str, Outcome]:
        return {step: fn() for step, fn in self.call_fns(arena_id).items()}


def outcome(fn: Callable[[], object]) -> Outcome:
    """[status code name, details] of a call: OK and its result, or the status it failed with."""
    try:
        return ["OK", str(fn())]
    except grpc.RpcError as e:
        return [e.code().name, (e.details() or "")[:300]]  # type: ignore[attr-defined]
    except OSError as e:
        return ["OSError", f"{e.errno} {e.strerror}"]


def punch(fd: int, size: int) -> None:
    """Free every page of ``fd`` (fallocate PUNCH_HOLE): the file keeps its size, its pages are gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, size) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def memfd(size: int, allocate: bool = True, seals: int = SEALS, flags: int = 0) -> tuple[int, bytes]:
    fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | flags)
    os.ftruncate(fd, size)
    if allocate:
        os.posix_fallocate(fd, 0, size)
    nonce = os.urandom(shm.NONCE_BYTES)
    os.pwrite(fd, nonce, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd, nonce


def arena_id_of(result: Outcome) -> str:
    return result[1] if result[0] == "OK" else "not-attached"


# -- the cases --------------------------------------------------------------------------------------------
def file_truncated(h: Hostile) -> dict[str, Outcome]:
    """A /dev/shm file attached by path (any stock client can), then truncated to 0 bytes."""
    arena = shm.Arena.create(h.shm_dir, SIZE)
    out = {"attach": h.attach_path(arena.path, arena.size, arena.nonce)}
    os.truncate(arena.path, 0)
    os.unlink(arena.path)
    out.update(h.calls(arena_id_of(out["attach"])))
    return out


def file_holes(h: Hostile) -> dict[str, Outcome]:
    """A /dev/shm file attached by path, then every page punched out of it."""
    arena = shm.Arena.create(h.shm_dir, SIZE)
    out = {"attach": h.attach_path(arena.path, arena.size, arena.nonce)}
    fd = os.open(arena.path, os.O_RDWR)
    os.unlink(arena.path)
    punch(fd, SIZE)
    out.update(h.calls(arena_id_of(out["attach"])))
    os.close(fd)
    return out


def file_sparse(h: Hostile) -> dict[str, Outcome]:
    """A sparse /dev/shm file: its size set, only its nonce written (on a small /dev/shm, touching
    its holes finds no room: the SIGBUS of the daemon's prefault)."""
    path = h.shm_dir / f"kvstore-cli-{os.urandom(16).hex()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    size = int(h.spec.get("sparse_bytes", 64 << 20))
    os.ftruncate(fd, size)
    nonce = os.urandom(shm.NONCE_BYTES)
    os.pwrite(fd, nonce, 0)
    out = {"attach": h.attach_path(str(path), size, nonce)}
    out.update(h.calls(arena_id_of(out["attach"])))
    os.unlink(path)
    os.close(fd)
    return out


def sealed_truncated(h: Hostile) -> dict[str, Outcome]:
    """The client's own kind of arena, a sealed memfd: a truncation is refused by the kernel; the
    daemon serves through it as ever."""
    fd, nonce = memfd(SIZE)
    out = {"attach": h.attach_fds([os.dup(fd)], SIZE, nonce)}
    out["ftruncate"] = outcome(lambda: os.ftruncate(fd, 0))
    out.update(h.calls(arena_id_of(out["attach"])))
    os.close(fd)
    return out


def sealed_holes(h: Hostile) -> dict[str, Outcome]:
    """A sealed memfd whose every page is punched out after the attach (seals allow that): the
    daemon's next touches allocate fresh pages on the kernel's unlimited internal tmpfs."""
    fd, nonce = memfd(SIZE)
    out = {"attach": h.attach_fds([os.dup(fd)], SIZE, nonce)}
    punch(fd, SIZE)
    out.update(h.calls(arena_id_of(out["attach"])))
    os.close(fd)
    return out


def _in_flight(h: Hostile, arena_id: str, fd: int, out: dict[str, Outcome]) -> dict[str, Outcome]:
    """The three calls, looping on threads through ``arena_id`` while ``fd`` is truncated to 0 bytes
    and extended again, over and over, for ``seconds``; each step's answers counted by code."""
    stop = threading.Event()
    counts: dict[str, Counter[str]] = {}
    samples: dict[str, str] = {}

    def loop(step: str, fn: Callable[[], Outcome]) -> None:
        c = counts.setdefault(step, Counter())
        while not stop.is_set():
            code, details = fn()
            c[code] += 1
            if code != "OK" and f"{code}: " not in samples.get(step, ""):  # one message per code, to tell why
                samples[step] = samples.get(step, "") + f"{code}: {details[:200]}; "

    calls = h.call_fns(arena_id)
    threads = [threading.Thread(target=loop, args=(step, fn), daemon=True) for step, fn in calls.items()]
    for t in threads:
        t.start()
    refused: Counter[str] = Counter()
    deadline = time.monotonic() + float(h.spec.get("seconds", 1.0))
    while time.monotonic() < deadline:
        refused[outcome(lambda: os.ftruncate(fd, 0))[0]] += 1  # the truncations counted
        time.sleep(0.0005)
        outcome(lambda: os.ftruncate(fd, SIZE))  # and the file whole again, for the next calls to find
        time.sleep(0.0005)
    stop.set()
    for t in threads:
        t.join(60)
    out["ftruncate"] = ["COUNTS", json.dumps(refused)]
    out.update({step: ["COUNTS", json.dumps(c)] for step, c in counts.items()})
    out.update({f"{step} samples": ["SAMPLES", text] for step, text in samples.items()})
    return out


def file_truncated_in_flight(h: Hostile) -> dict[str, Outcome]:
    """A /dev/shm file attached by path, truncated and extended again while loads and saves run
    through it (the daemon's copies of a mapping would fault at random points; pread/pwrite fail)."""
    arena = shm.Arena.create(h.shm_dir, SIZE)
    out = {"attach": h.attach_path(arena.path, arena.size, arena.nonce)}
    fd = os.open(arena.path, os.O_RDWR)
    os.unlink(arena.path)
    try:
        return _in_flight(h, arena_id_of(out["attach"]), fd, out)
    finally:
        os.close(fd)


def sealed_truncated_in_flight(h: Hostile) -> dict[str, Outcome]:
    """A sealed memfd, truncated (refused by the kernel) over and over while loads and saves run."""
    fd, nonce = memfd(SIZE)
    out = {"attach": h.attach_fds([os.dup(fd)], SIZE, nonce)}
    try:
        return _in_flight(h, arena_id_of(out["attach"]), fd, out)
    finally:
        os.close(fd)


def memfd_unsealed(h: Hostile) -> dict[str, Outcome]:
    """A memfd without seals (it could be truncated under a mapping): refused."""
    fd, nonce = memfd(SIZE, seals=0)
    out = {"attach": h.attach_fds([os.dup(fd)], SIZE, nonce)}
    os.ftruncate(fd, 0)
    out.update(h.calls(arena_id_of(out["attach"])))
    os.close(fd)
    return out


def memfd_sparse(h: Hostile) -> dict[str, Outcome]:
    """A sealed memfd without its pages allocated: refused (the client, not the daemon, pays for them)."""
    fd, nonce = memfd(64 << 20, allocate=False)
    out = {"attach": h.attach_fds([os.dup(fd)], 64 << 20, nonce)}
    os.close(fd)
    return out


def memfd_hugetlb(h: Hostile) -> dict[str, Outcome]:
    """A hugetlbfs memfd, sealed: its pool can run dry on a fault (SIGBUS): refused."""
    try:
        fd = os.memfd_create("hostile-huge", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
    except OSError as e:
        return {"attach": ["SKIPPED", f"no hugetlbfs memfd here: {e.strerror}"]}
    size = 2 << 20
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError as e:
        os.close(fd)
        return {"attach": ["SKIPPED", f"cannot size or seal a hugetlbfs memfd here: {e.strerror}"]}
    out = {"attach": h.attach_fds([os.dup(fd)], size, bytes(shm.NONCE_BYTES))}
    os.close(fd)
    return out


def not_memfds(h: Hostile) -> dict[str, Outcome]:
    """Fds that are no memfd: a pipe, a /dev/shm file, a file on disk, a directory; and two fds."""
    out = {}
    r, w = os.pipe()
    out["pipe"] = h.attach_fds([r], SIZE, bytes(16))
    arena = shm.Arena.create(h.shm_dir, SIZE)
    fd = os.open(arena.path, os.O_RDWR)
    os.unlink(arena.path)
    out["shm file"] = h.attach_fds([fd], SIZE, arena.nonce)
    disk = Path(h.spec["scratch"]) / f"disk-{os.getpid()}"
    disk.write_bytes(arena.nonce + bytes(SIZE - shm.NONCE_BYTES))
    out["disk file"] = h.attach_fds([os.open(disk, os.O_RDWR)], SIZE, arena.nonce)
    out["directory"] = h.attach_fds([os.open(h.shm_dir, os.O_RDONLY)], SIZE, bytes(16))
    a, nonce = memfd(SIZE)
    out["two fds"] = h.attach_fds([os.dup(a), os.dup(a)], SIZE, nonce)
    out["memfd and a path"] = outcome(lambda: h.local.unary_with_fds(
        local_channel.ATTACH_ARENA, pb.AttachArenaRequest.SerializeToString, pb.AttachArenaResponse.FromString)(
        pb.AttachArenaRequest(path=arena.path, size=SIZE, nonce=nonce), [os.dup(a)], timeout=30,
        metadata=h.metadata))
    out["wrong size"] = h.attach_fds([os.dup(a)], 2 * SIZE, nonce)
    out["wrong nonce"] = h.attach_fds([os.dup(a)], SIZE, bytes(16))
    for x in (w, a):
        os.close(x)
    disk.unlink()
    arena.close()
    return out


def fds_with_other_calls(h: Hostile) -> dict[str, Outcome]:
    """Fds passed with calls that take none (the daemon must close them, not keep them)."""
    call = h.local.unary_with_fds("/kvstore.v1.KVStore/GetServerInfo", pb.GetServerInfoRequest.SerializeToString,
                                  pb.ServerInfo.FromString)
    out = {}
    fd, _ = memfd(1 << 16)
    for i in range(64):
        out[f"GetServerInfo {i}"] = outcome(lambda: call(pb.GetServerInfoRequest(), [os.dup(fd), os.dup(fd)],
                                                         timeout=30, metadata=h.metadata).version)
    os.close(fd)
    return out


def nul_paths(h: Hostile) -> dict[str, Outcome]:
    """Arena paths with a NUL byte, in the directory part and in the name, over both transports."""
    name = f"kvstore-cli-{os.urandom(16).hex()}"
    out = {}
    for transport, stub in (("grpc", h.grpc_stub), ("local", h.local_stub)):
        for where, path in (("dir", f"{h.shm_dir}\0x/{name}"), ("name", f"{h.shm_dir}/{name}\0"),
                            ("long", f"{h.shm_dir}/{'d' * 100_000}\0/{name}")):
            out[f"{where} {transport}"] = h.attach_path(path, SIZE, bytes(16), stub)
    return out


CASES: dict[str, Callable[[Hostile], dict[str, Outcome]]] = {
    f.__name__: f for f in (file_truncated, file_holes, file_sparse, file_truncated_in_flight, sealed_truncated,
                            sealed_holes, sealed_truncated_in_flight, memfd_unsealed, memfd_sparse, memfd_hugetlb,
                            not_memfds, fds_with_other_calls, nul_paths)}


def connected(spec: dict[str, Any]) -> Iterator[Hostile]:
    with grpc.insecure_channel(spec["address"]) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30,
                                  metadata=(("authorization", f"Bearer {spec['token']}"),))
        local = local_channel.LocalChannel(info.local_socket)
        try:
            yield Hostile(spec, stub, local, Path(info.shm_dir))
        finally:
            local.close()


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    for h in connected(spec):
        print(json.dumps(CASES[argv[2]](h)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
