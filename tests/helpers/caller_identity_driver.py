"""Processes for tests/client/test_caller_identity.py: raw local-socket calls, sockets handed over with
SCM_RIGHTS, and the pid-reuse scenario, which runs in a pid namespace of its own so that it can pick
the next pid (``/proc/sys/kernel/ns_last_pid``):

    python tests/helpers/caller_identity_driver.py hand SOCKET_PATH FD        connect, hand the socket over FD, exit
    python tests/helpers/caller_identity_driver.py handed FD NS SESSION ADDR  load into own buffer and into ADDR
    unshare --pid --fork --mount-proc python tests/helpers/caller_identity_driver.py reuse TMP

Each role that reports prints one JSON line.
"""

from __future__ import annotations

import array
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.transport import cma, local_channel
from kvstore.transport.local_channel import END, HEADER, MSG, call_frame, frame
from kvstore.v1 import kvstore_pb2 as pb

LOAD_SESSION = "/kvstore.v1.KVStore/LoadSession"
LOAD_CHUNKS = "/kvstore.v1.KVStore/LoadChunks"


def load_into_request(path: str, namespace: str, name: str | list[bytes], address: int, size: int) -> bytes:
    """A whole LoadSession (``name``: a session id) or LoadChunks (``name``: keys) call into [address, +size)."""
    into = pb.CallerMemory(address=address, size=size)
    if isinstance(name, str):
        req: Any = pb.LoadSessionRequest(namespace=namespace, session_id=name, into=into)
    else:
        req = pb.LoadChunksRequest(namespace=namespace, keys=name, into=into)
    return call_frame(path, ()) + frame(MSG, req.SerializeToString()) + frame(END)


def answer(sock: socket.socket) -> tuple[str, str]:
    """The status (code name, details) of the call just sent on ``sock``, its messages read and dropped."""
    buf, got = b"", []
    while True:
        while len(buf) < HEADER.size or len(buf) < HEADER.size + HEADER.unpack_from(buf)[0] - 1:
            more = sock.recv(1 << 16)
            if not more:
                raise EOFError("the daemon closed the connection")
            buf += more
        length, kind = HEADER.unpack_from(buf)
        end = HEADER.size + length - 1
        body, buf = buf[HEADER.size : end], buf[end:]
        try:
            if local_channel.answer_frame(kind, body, got):
                return "OK", ""
        except local_channel.LocalRpcError as e:
            return e.code().name, e.details()


def call(sock: socket.socket, data: bytes) -> tuple[str, str]:
    sock.sendall(data)
    return answer(sock)


def send_fd(over: socket.socket, fd: int) -> None:
    over.sendmsg([b"s"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def receive_fd(over: socket.socket) -> socket.socket:
    _, ancillary, _, _ = over.recvmsg(1, socket.CMSG_SPACE(4))
    (fd,) = array.array("i", ancillary[0][2])
    return socket.socket(fileno=fd)


def hand(socket_path: str, fd: int) -> None:
    """Connect to the daemon's local socket and hand the connection over ``fd``; then exit."""
    with socket.socket(fileno=fd) as over, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(socket_path)
        send_fd(over, s.fileno())
        over.recv(1)  # the receiver has it


def handed(fd: int, namespace: str, session_id: str, other: int, size: int) -> dict[str, Any]:
    """Receive a connected socket, load a session into a buffer of this process and into ``other``
    (an address in the process that connected it)."""
    with socket.socket(fileno=fd) as over:
        sock = receive_fd(over)
    own = np.zeros(size, np.uint8)
    mine = call(sock, load_into_request(LOAD_SESSION, namespace, session_id, cma.address_of(own), size))
    theirs = call(sock, load_into_request(LOAD_SESSION, namespace, session_id, other, size))
    sock.close()
    return {"own": mine, "own_bytes": own.tobytes().hex(), "other": theirs}


def reuse(tmp: Path) -> dict[str, Any]:
    """The process that connected exits and a new process gets its pid (forced: this driver runs as
    init of its own pid namespace). A call then sent on the connection by the process that received it
    must be written into that process, never into the new one that holds the old pid."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo: tests.helpers
    from kvstore.client import Client
    from tests.helpers.daemon import make_session, running_daemon, save_session  # torch: only this role needs it

    s = make_session(namespace="reuse", session_id="s1", tokens=900)
    packed = b"".join(s.blobs)
    with running_daemon(tmp / "data") as d:
        with Client(address=d.address) as c:
            save_session(c, s)
            path = c.info().local_socket
        mine, theirs = socket.socketpair()
        connector = subprocess.Popen([sys.executable, __file__, "hand", path, str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()])
        theirs.close()
        sock = receive_fd(mine)
        mine.send(b"k")
        connector.wait()  # gone, reaped: its pid is free
        old_pid = connector.pid
        out = np.zeros(len(packed), np.uint8)  # at the same address in the fork below
        for _ in range(20):
            Path("/proc/sys/kernel/ns_last_pid").write_text(str(old_pid - 1))
            go_r, go_w = os.pipe()
            rep_r, rep_w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the process that gets the old pid: a copy of this one, so ``out`` is mapped here too
                os.close(go_w)
                os.read(go_r, 1)
                os.write(rep_w, b"1" if out.any() else b"0")
                os._exit(0)
            os.close(go_r)
            os.close(rep_w)
            if pid == old_pid:
                break
            os.close(go_w)
            os.waitpid(pid, 0)
            os.close(rep_r)
        else:
            return {"reused": False}
        status = call(sock, load_into_request(LOAD_SESSION, "reuse", "s1", cma.address_of(out), len(out)))
        os.write(go_w, b"g")
        written_into_new = os.read(rep_r, 1) == b"1"
        os.waitpid(pid, 0)
        sock.close()
    return {"reused": True, "status": status, "written_into_caller": out.tobytes() == packed,
            "written_into_new_process": written_into_new}


def main(argv: list[str]) -> int:
    role = argv[0]
    if role == "hand":
        hand(argv[1], int(argv[2]))
        return 0
    if role == "handed":
        report = handed(int(argv[1]), argv[2], argv[3], int(argv[4]), int(argv[5]))
    elif role == "reuse":
        t0 = time.monotonic()
        report = reuse(Path(argv[1]))
        report["seconds"] = round(time.monotonic() - t0, 2)
    else:
        raise SystemExit(f"unknown role {role}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
