"""The daemon's local socket: every KVStore method, for same-host clients of the daemon's own user.

The same servicer bodies as the gRPC listener (handlers.methods), the same messages, status codes
(status.status_of) and metadata (auth is unchanged), framed as kvstore/transport/local_channel.py
describes. What it saves is gRPC's per-call cost on one host (HTTP/2 framing, completion-queue
thread hops: ~0.5-0.8 ms a call), which dominates a small arena load or save. Each connection has
its own thread, which reads a call, calls its body right there (a plain function: its store calls
block this thread only, and concurrent connections' saves share fsyncs: group commit) and writes
the answer: a call wakes one daemon thread and, with its answer, the client; nothing else. The
socket file is mode 0600 in the daemon's shm directory and every connection's peer is checked
(SO_PEERCRED) to run as the daemon's uid, the same rule the arenas follow (kvstore/transport/shm.py).

Who a call comes from is learned per call, never from the connect: the kernel names the sender of
every read (SCM_CREDENTIALS and a pidfd, SCM_PIDFD), and a call's sender (``Call.sender``) is the one
process that sent all its bytes (kvstore/transport/sender.py). A load into the caller's memory is
written into that process only: a forked child, or a process handed the socket, is its own caller.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import grpc

from kvstore.server.handlers import Call, Method
from kvstore.server.status import capped, retry_of, status_of
from kvstore.transport import local_channel
from kvstore.transport.local_channel import CALL, END, HEADER, MSG, status_frame
from kvstore.transport.sender import ANCILLARY_BYTES, Sender, Senders, ask_kernel

log = logging.getLogger("kvstore.server")
READ_BUFFER = 1 << 16  # a connection's read buffer: a call's small frames in one recv


def socket_path(shm_dir: Path, port: int) -> Path:
    """One socket per daemon port (the port is this daemon's alone while it runs)."""
    return shm_dir / f"kvstore-{port}.sock"


def sweep_stale(shm_dir: Path) -> int:
    """Remove the sockets of daemons of this user that died without removing theirs (SIGKILL): no one
    listens on them, so a connect is refused. A live daemon's socket accepts and is left alone."""
    removed = 0
    for p in shm_dir.glob("kvstore-*.sock"):
        try:
            st = p.lstat()
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(0.5)
                s.connect(str(p))
        except ConnectionRefusedError:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed += 1
        except OSError:
            continue
    if removed:
        log.info("local socket: removed %d stale socket files in %s", removed, shm_dir)
    return removed


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class _Protocol(Exception):
    """The peer broke the framing: the connection is closed."""


class _Stream:
    """One connection's frames, read with recvmsg into one buffer, so that fds passed with a call
    (SCM_RIGHTS) and the kernel's name for each read's sender arrive with it (a plain recv would drop
    both); a call's frames usually arrive in one segment: one recvmsg for them all. Fds are kept for
    the call being read (``take_fds``), its sender in ``senders`` (``begin_call``, ``sender``)."""

    MAX_FDS = 4  # a call passes one (AttachArena); more are received and closed, never kept
    ANCILLARY = socket.CMSG_SPACE(MAX_FDS * 4) + ANCILLARY_BYTES

    def __init__(self, sock: socket.socket, pidfds: bool) -> None:
        self.sock = sock
        self.buf = bytearray(READ_BUFFER)
        self.view = memoryview(self.buf)
        self.start = self.end = 0
        self.fds: list[int] = []
        self.senders = Senders(pidfds)

    def _recv_into(self, into: memoryview) -> int:
        n, ancillary, _, _ = self.sock.recvmsg_into([into], self.ANCILLARY, socket.MSG_CMSG_CLOEXEC)
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                self.fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
        if n:
            self.senders.saw(ancillary)  # closes the pidfds it does not keep
        return n

    def begin_call(self) -> None:
        """Before a call's first frame is read: its sender is named by the reads from here on."""
        self.senders.begin(buffered=self.end > self.start)

    def sender(self) -> Sender:
        """After a call's last frame was read: the one process that sent it, or why none can be named."""
        return self.senders.of_call()

    def _fill(self, n: int) -> int:
        """At least ``n`` (at most the buffer's size) bytes buffered, unless the peer closed first;
        how many are."""
        if self.end - self.start >= n:
            return self.end - self.start
        if self.start:  # what is left moves to the front, then the rest is read behind it
            have = self.end - self.start
            self.buf[:have] = self.view[self.start : self.end].tobytes()
            self.start, self.end = 0, have
        while self.end < n and (k := self._recv_into(self.view[self.end :])):
            self.end += k
        return self.end

    def _read(self, n: int) -> bytes | bytearray:
        """``n`` bytes, or fewer if the peer closed first."""
        if n > len(self.buf):  # a large frame: straight into a buffer of its own
            have = self.end - self.start
            big = bytearray(n)
            big[:have] = self.view[self.start : self.end]
            self.start = self.end = 0
            got, into = have, memoryview(big)
            while got < n and (k := self._recv_into(into[got:])):
                got += k
            return big if got == n else big[:got]
        take = min(n, self._fill(n))
        out = self.view[self.start : self.start + take].tobytes()
        self.start += take
        return out

    def frame(self, at_call: bool = False) -> tuple[int, bytes | bytearray] | None:
        """The next frame (kind, body); None at a clean end between calls (``at_call``)."""
        start = self.start
        if self.end - start >= HEADER.size:  # the usual case: the whole frame is buffered already
            length, kind = HEADER.unpack_from(self.buf, start)
            stop = start + HEADER.size + length - 1
            if length >= 1 and stop <= self.end:
                self.start = stop
                return kind, self.view[start + HEADER.size : stop].tobytes()
        return self._frame(at_call)

    def _frame(self, at_call: bool) -> tuple[int, bytes | bytearray] | None:
        have = self._fill(HEADER.size)
        if have < HEADER.size:
            if at_call and not have:
                return None
            raise _Protocol("the connection ended inside a frame")
        length, kind = HEADER.unpack_from(self.buf, self.start)
        if not 1 <= length <= local_channel.MAX_FRAME:
            raise _Protocol(f"a frame of {length} bytes")
        self.start += HEADER.size
        body = self._read(length - 1)
        if len(body) < length - 1:
            raise _Protocol("the connection ended inside a frame")
        return kind, body

    def requests(self) -> list[bytes | bytearray]:
        """A call's request messages, up to its END (a client sends a call whole before it reads)."""
        out = []
        while (got := self.frame()) is not None and got[0] != END:
            if got[0] != MSG:
                raise _Protocol(f"expected a request message or the end, got frame kind {got[0]}")
            out.append(got[1])
        return out

    def take_fds(self) -> list[int]:
        fds, self.fds = self.fds, []
        if len(fds) > self.MAX_FDS:
            _close_all(fds[self.MAX_FDS :])
            fds = fds[: self.MAX_FDS]
        return fds

    def close(self) -> None:
        _close_all(self.take_fds())
        self.senders.close()
        self.view.release()


class LocalServer:
    """The listener: an accept thread, and one thread per connection that reads a call, calls its
    body to the end right there and writes the answer. A call costs two wake-ups (the request, the
    answer) instead of four through the daemon's event loop and a worker thread."""

    def __init__(self, methods: dict[str, Method], path: Path, on_call: Callable[[], None] = lambda: None) -> None:
        self.methods = methods
        self.path = path
        self.on_call = on_call  # counts calls for Stats
        self._listener: socket.socket | None = None
        self._pidfds = False  # the kernel names each read's sender with a pidfd too (ask_kernel)
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._stopping = False

    async def start(self) -> None:
        sweep_stale(self.path.parent)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # left by a daemon on this port that was killed: the port is ours now
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # created 0600: no window in which another user could connect
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(old)
        self._pidfds = ask_kernel(listener)  # before listen: every connection inherits it
        listener.listen(128)
        self._listener = listener
        threading.Thread(target=self._accept, name="kvstore-local-accept", daemon=True).start()

    async def stop(self, grace_s: float = 30.0) -> None:
        """Stop accepting, let each connection finish the call it is in, then close them all."""
        with self._lock:
            self._stopping = True
            conns = dict(self._conns)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
            self._listener.close()
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RD)  # a thread waiting for a call wakes; one in a call answers it
        await asyncio.to_thread(_join, list(conns.values()), grace_s)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # the listener was shut down
            if _peer_uid(sock) != os.getuid():
                log.warning("local socket: refused a peer of another user")
                sock.close()
                continue
            t = threading.Thread(target=self._serve, args=(sock,), name="kvstore-local", daemon=True)
            with self._lock:
                if self._stopping:
                    sock.close()
                    return
                self._conns[sock] = t
            t.start()

    def _serve(self, sock: socket.socket) -> None:
        stream = _Stream(sock, self._pidfds)
        try:
            while True:
                stream.begin_call()
                if (got := stream.frame(at_call=True)) is None:
                    break
                kind, body = got
                if kind != CALL:
                    raise _Protocol(f"expected a call, got frame kind {kind}")
                path, metadata = local_channel.parse_call(bytes(body))
                requests = stream.requests()
                call = Call(metadata, stream.take_fds(), stream.sender())
                try:
                    self._call(self.methods.get(path), path, call, requests, _Reply(sock))
                finally:
                    call.close_fds()  # those the body did not take
        except (_Protocol, ConnectionError, struct.error, UnicodeDecodeError) as e:
            log.info("local socket: connection dropped: %s", e)
        except OSError as e:  # the socket itself failed (shut down at stop, say)
            log.debug("local socket: connection ended: %s", e)
        except Exception:  # a handler's bug (handlers answer every error as a status): this connection only
            log.exception("local socket: connection failed")
        finally:
            with self._lock:
                self._conns.pop(sock, None)
            stream.close()
            sock.close()

    def _call(self, method: Method | None, path: str, call: Call, raw: list[bytes | bytearray],
              out: _Reply) -> None:
        """One call: its body's answers, then its status. Only what the body raises is its status:
        a failure to send (the client left) ends the connection."""
        if method is None:
            out.add(_status(grpc.StatusCode.UNIMPLEMENTED, f"no method {path}"))
            out.end()
            return
        self.on_call()
        if method.client_streaming:
            request: Any = [method.deserialize(r) for r in raw]
        elif len(raw) == 1:
            request = method.deserialize(raw[0])
        else:
            raise _Protocol(f"a unary call with {len(raw)} request messages")
        status = _status(grpc.StatusCode.OK)
        if method.server_streaming:
            try:
                with contextlib.closing(_answers(method, request, call)) as answers:
                    for answer in answers:
                        out.message(method.serialize(answer))
            except _Raised as e:
                status = _status(*status_of(method.name, e.error), retry_of(e.error))
        else:
            try:
                answer = method.handler(request, call)
            except Exception as e:
                status = _status(*status_of(method.name, e), retry_of(e))
            else:
                out.message(method.serialize(answer))
        out.add(status)
        out.end()


class _Raised(Exception):
    """What a streaming body raised, told apart from a failure to send its answers."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _answers(method: Method, request: Any, call: Call) -> Generator[Any, None, None]:
    """A streaming body's answers; what calling or advancing it raises comes out as ``_Raised``.
    Closed however it ends: an abandoned stream unpins what it read, here and now."""
    try:
        answers = method.handler(request, call)
    except Exception as e:
        raise _Raised(e) from e
    with contextlib.closing(answers):
        while True:
            try:
                answer = next(answers)
            except StopIteration:
                return
            except Exception as e:
                raise _Raised(e) from e
            yield answer


class _Reply:
    """A call's answer frames, sent in as few writes as possible: each send wakes the client, and
    on a busy host a wake-up costs more than joining a few small frames (an arena answer is one
    small message and a status: one send)."""

    FLUSH_BYTES = 1 << 20

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, data: bytes) -> None:
        self.parts.append(data)
        self.size += len(data)

    def message(self, raw: bytes) -> None:
        self.add(HEADER.pack(len(raw) + 1, MSG))
        self.add(raw)
        if self.size >= self.FLUSH_BYTES:  # a streamed answer: sent as it is made, a few at a time
            self.end()

    def end(self) -> None:
        if self.parts:
            data = self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)
            self.parts, self.size = [], 0
            self.sock.sendall(data)


def _join(threads: list[threading.Thread], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def _status(code: grpc.StatusCode, details: str = "", retry: bytes = b"") -> bytes:
    """The status frame, with its typed retry reason if it has one (kvstore/server/status.py ``retry_of``)."""
    return status_frame(code, capped(details), retry)


def _peer_uid(sock: socket.socket) -> int:
    """The connecting process's uid, as the kernel recorded it at connect (SO_PEERCRED). Its pid is
    not kept: who sends each call is named per call (``_Stream.sender``)."""
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(uid)
