"""Loads into the caller's memory reach only the process that sent the request (issue 27, item 1).

The daemon names the sender of every request from the kernel (kvstore/transport/sender.py), never a
pid remembered when the socket connected: a forked child, a process handed the connection with
SCM_RIGHTS, the connection's survivor after the connecting process exited, and a new process that
got the old pid each get what their own requests ask for, and nothing anyone else asked for. Real
daemon, real processes, real fork; the pid reuse runs in a pid namespace of its own (root)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import FailedPrecondition
from kvstore.server.process import Exec, kvstore_command
from kvstore.transport import cma, shm
from kvstore.transport.sender import CALLER_MEMORY_REFUSED, SCM_PIDFD, Sender, Senders
from tests.helpers import caller_identity_driver as drv
from tests.helpers.daemon import Daemon, SyntheticSession, make_session, running_daemon, save_session, start_daemon

pytestmark = pytest.mark.skipif(shm.default_shm_dir() is None, reason="no writable /dev/shm on this host")
DRIVER = Path(drv.__file__)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("identity") / "data") as d:
        yield d


@pytest.fixture
def session(daemon: Daemon) -> Iterator[tuple[SyntheticSession, str]]:
    """A saved session, and the daemon's local socket path."""
    s = make_session(namespace=f"id-{uuid.uuid4().hex[:12]}", tokens=1300)
    with Client(address=daemon.address) as c:
        save_session(c, s)
        path = c.info().local_socket
    yield s, path
    with Client(address=daemon.address) as c:  # nothing stored was harmed
        _, chunks = c.load_session(s.namespace, s.session_id)
        assert [bytes(b) for _, b in chunks] == list(s.blobs)


def packed(s: SyntheticSession) -> bytes:
    return b"".join(s.blobs)


def test_a_forked_child_loads_into_its_own_buffer(daemon: Daemon, session: tuple[SyntheticSession, str]) -> None:
    """The child inherits the parent's client and its connected socket; the parent's buffers, at the
    same addresses, stay untouched."""
    s, _ = session
    with Client(address=daemon.address) as c:
        c.connect()  # the parent connects: the child inherits its client and a pooled local socket
        assert c._local is not None and c._local._free
        out_session = np.zeros(len(packed(s)), np.uint8)
        out_chunks = np.zeros(len(packed(s)), np.uint8)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                c.load_session_into(s.namespace, s.session_id, out_session)
                c.load_chunks_into(s.namespace, s.keys, out_chunks)
                os.write(w, json.dumps({"session": out_session.tobytes() == packed(s),
                                        "chunks": out_chunks.tobytes() == packed(s),
                                        "refused": c._into_refused}).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        with os.fdopen(r) as f:
            child = json.loads(f.read() or "{}")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # the daemon wrote into the child itself (no fallback), and nothing into the parent
        assert child == {"session": True, "chunks": True, "refused": ""}
        assert not out_session.any() and not out_chunks.any()
        _, placed = c.load_session_into(s.namespace, s.session_id, out_session)  # the parent's own load
        assert out_session.tobytes() == packed(s) and len(placed) == len(s.blobs)


def test_a_process_handed_the_socket_is_its_own_caller(session: tuple[SyntheticSession, str]) -> None:
    """This process connects and hands the connection to another (SCM_RIGHTS): that one's loads land
    in its own buffer, and naming this process's buffer reaches nothing here."""
    s, path = session
    mine = np.zeros(len(packed(s)), np.uint8)
    ours, theirs = socket.socketpair()
    with ours, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        q = subprocess.Popen([sys.executable, str(DRIVER), "handed", str(theirs.fileno()), s.namespace,
                              s.session_id, str(cma.address_of(mine)), str(len(mine))],
                             pass_fds=[theirs.fileno()], stdout=subprocess.PIPE, text=True)
        theirs.close()
        drv.send_fd(ours, conn.fileno())
        out, _ = q.communicate(timeout=60)
    report = json.loads(out)
    assert report["own"] == ["OK", ""] and bytes.fromhex(report["own_bytes"]) == packed(s)
    assert not mine.any()  # the daemon never wrote here for the other process's calls
    assert report["other"][0] in ("OK", "INVALID_ARGUMENT")  # its own memory at that address, or none


def test_the_connection_outlives_the_process_that_connected(session: tuple[SyntheticSession, str]) -> None:
    """Another process connects, hands the connection here and exits: this process's loads on it are
    written here (not refused because the connecting pid is gone, and never sent to that pid)."""
    s, path = session
    ours, theirs = socket.socketpair()
    with ours:
        connector = subprocess.Popen([sys.executable, str(DRIVER), "hand", path, str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()])
        theirs.close()
        conn = drv.receive_fd(ours)
        ours.send(b"k")
    assert connector.wait(timeout=60) == 0
    with conn:
        for name in (s.session_id, s.keys):
            out = np.zeros(len(packed(s)), np.uint8)
            status = drv.call(conn, drv.load_into_request(drv.LOAD_SESSION if isinstance(name, str) else
                                                          drv.LOAD_CHUNKS, s.namespace, name,
                                                          cma.address_of(out), len(out)))
            assert status == ("OK", "") and out.tobytes() == packed(s)


def test_a_call_from_two_processes_names_no_sender(session: tuple[SyntheticSession, str]) -> None:
    """A call whose bytes two processes sent (the parent its first half, a forked child the rest) has no
    one sender: FAILED_PRECONDITION saying why, nothing written, and the connection serves on."""
    s, path = session
    out = np.zeros(len(packed(s)), np.uint8)
    data = drv.load_into_request(drv.LOAD_SESSION, s.namespace, s.session_id, cma.address_of(out), len(out))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        conn.sendall(data[: len(data) // 2])
        pid = os.fork()
        if pid == 0:
            try:
                conn.sendall(data[len(data) // 2 :])
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        code, details = drv.answer(conn)
        assert code == "FAILED_PRECONDITION" and details.startswith(CALLER_MEMORY_REFUSED)
        assert "more than one process" in details and not out.any()
        assert drv.call(conn, data) == ("OK", "") and out.tobytes() == packed(s)  # all from this process


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1) to pick the next pid in a pid namespace")
def test_a_new_process_with_the_connecting_pid_gets_nothing(tmp_path: Path) -> None:
    """The connecting process exits and a new process is given its pid; the process holding the
    connection loads: the bytes land in that process, the new one's memory stays as it was."""
    run = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(DRIVER), "reuse",
                          str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["reused"], "the pid namespace did not hand out the old pid"
    assert report["status"] == ["OK", ""]
    assert report["written_into_caller"] and not report["written_into_new_process"]


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1) to run the daemon in a pid namespace of its own")
def test_a_client_the_daemon_cannot_see_loads_through_its_arena(tmp_path: Path) -> None:
    """The daemon in a pid namespace of its own (a container without ``--pid=host``) cannot name this
    process: the kernel says pid 0. Its load into caller memory is refused, saying why, and the client
    loads through its arena instead: the right bytes in its own buffer."""
    s = make_session(namespace="hidden", tokens=1300)
    unshared = Exec(["unshare", "--pid", "--fork", "--kill-child", *kvstore_command()])
    d = start_daemon(tmp_path / "data", spawner=unshared)
    try:
        with Client(address=d.address) as c:
            save_session(c, s)
            assert c.uses_shared_memory
            out = np.zeros(len(packed(s)), np.uint8)
            _, placed = c.load_session_into(s.namespace, s.session_id, out)
            assert out.tobytes() == packed(s) and [bytes(v) for _, v in placed] == list(s.blobs)
            assert c._into_refused.startswith(CALLER_MEMORY_REFUSED) and "can see" in c._into_refused
            out[:] = 0
            assert len(c.load_chunks_into(s.namespace, s.keys, out)) == len(s.keys)
            assert out.tobytes() == packed(s)
    finally:
        d.kill()  # unshare(1) does not pass SIGTERM on; --kill-child takes the daemon with it


# -- the sender of a stream's bytes, read by read (no daemon) -----------------------------------------
def _reads_of(*senders: int) -> list[list[tuple[int, int, bytes]]]:
    """The ancillary data of one read per pid, as the kernel gives it (credentials; a pidfd of this
    process stands in for each, since only its number matters here)."""
    return [[(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack("3i", pid, os.getuid(), os.getgid())),
             (socket.SOL_SOCKET, SCM_PIDFD, struct.pack("i", os.pidfd_open(os.getpid())))] for pid in senders]


def _pidfds() -> int:
    """This process's open pidfds (other fds come and go with other tests' threads: not counted)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
    return n


def test_a_calls_sender_is_the_one_process_that_sent_every_read() -> None:
    before = _pidfds()
    senders = Senders(pidfds=True)
    for read in _reads_of(os.getpid(), os.getpid()):
        senders.saw(read)
    one = senders.of_call()
    assert one.pid == os.getpid() and one.pidfd >= 0
    with one.reaching() as pid:
        assert pid == os.getpid()
    senders.begin(buffered=False)
    for read in _reads_of(os.getpid(), 1):
        senders.saw(read)
    assert senders.of_call().pid == 0 and "more than one process" in senders.of_call().unknown
    senders.begin(buffered=False)
    senders.saw([])  # a read the kernel named no sender for
    with pytest.raises(FailedPrecondition, match=CALLER_MEMORY_REFUSED), senders.of_call().reaching():
        pass
    senders.close()
    creds_only = Senders(pidfds=False)  # a kernel without SO_PASSPIDFD: the pid is opened when a write needs it
    creds_only.saw([(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack("3i", os.getpid(), os.getuid(), 0))])
    with creds_only.of_call().reaching() as pid:
        assert pid == os.getpid()
    creds_only.close()
    assert _pidfds() == before  # every pidfd received or opened was closed


def test_a_sender_that_exited_is_never_written() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    fd = os.pidfd_open(p.pid)
    p.wait()
    gone = Sender(p.pid, os.getuid(), fd)
    with pytest.raises(FailedPrecondition, match="has exited"), gone.reaching():
        raise AssertionError("a write to an exited sender's pid")
    os.close(fd)
    no_pidfd = Sender(p.pid, os.getuid())  # the kernel gave none: opened by pid when the write needs it
    with pytest.raises(FailedPrecondition, match=r"cannot be opened|has exited"), no_pidfd.reaching():
        raise AssertionError("a write to an exited sender's pid")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    fd = os.pidfd_open(live.pid)
    try:
        with pytest.raises(FailedPrecondition, match="exited during the write"), \
                Sender(live.pid, os.getuid(), fd).reaching() as pid:
            assert pid == live.pid
            live.kill()  # it dies while "written": the write is not answered as done
            live.wait()
    finally:
        os.close(fd)
