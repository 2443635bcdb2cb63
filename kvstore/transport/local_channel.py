"""KVStore calls over the daemon's Unix socket: a channel with grpc.Channel's call surface.

On one host a gRPC call costs ~0.5-0.8 ms of HTTP/2 and thread hand-offs in Python; an arena load of
1 MiB needs ~0.2 ms of work. A same-host client that shares an arena with the daemon therefore makes
its calls over a Unix socket the daemon offers (``ServerInfo.local_socket``): the same methods, the
same protobuf messages, the same status codes and metadata, framed simply (docs/LOCAL.md):

    frame  = u32 length (little-endian, of what follows) | u8 kind | body
    client:  CALL  body = u16 path length | path | u16 metadata length | metadata (key\\0value\\0...)
             MSG   body = one serialized request
             END   body = empty                      (a call sends CALL MSG* END, in one write)
    daemon:  MSG   body = one serialized response, then
             STATUS body = u8 grpc status code | utf-8 details [| 0xFF | serialized RetryInfo]

A refusal's typed retry reason (kvstore/transport/retry.py) ends the status frame behind a 0xFF byte,
which UTF-8 never holds; the channel hands it back as gRPC hands back trailing metadata.

A call may pass fds beside its first byte (SCM_RIGHTS): AttachArena hands the daemon the sealed memfd
of the caller's arena that way (kvstore/transport/shm.py).

``LocalChannel`` hands out the callables ``KVStoreStub`` asks a channel for, so the client keeps one
code path whichever way its calls go. A call holds one socket for its whole exchange (a pool serves
concurrent threads) and reads the answer whole before returning: an arena answer is one small
message, and nothing is left on a socket that the next call could misread.
"""

from __future__ import annotations

import array
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc

from kvstore.transport.retry import RETRY_KEY

CALL, MSG, END, STATUS = 1, 2, 3, 4
ATTACH_ARENA = "/kvstore.v1.KVStore/AttachArena"  # the call that passes an fd: an arena's sealed memfd
HEADER = struct.Struct("<IB")  # a frame's length and kind
RETRY_MARK = b"\xff"  # in a status frame, after its details: the RetryInfo follows (never a byte of UTF-8)
MAX_FRAME = 64 << 20  # a bound on what either side accepts as one frame


def encode_metadata(metadata: Sequence[tuple[str, str | bytes]] | None) -> bytes:
    out = []
    for k, v in metadata or ():
        vb = v if isinstance(v, bytes) else v.encode()
        out.append(k.encode() + b"\0" + vb + b"\0")
    return b"".join(out)


def decode_metadata(raw: bytes) -> tuple[tuple[str, str], ...]:
    parts = raw.split(b"\0")
    return tuple((parts[i].decode(errors="replace"), parts[i + 1].decode(errors="replace"))
                 for i in range(0, len(parts) - 1, 2))


def frame(kind: int, body: bytes = b"") -> bytes:
    return HEADER.pack(len(body) + 1, kind) + body


def status_frame(code: grpc.StatusCode, details: str = "", retry: bytes = b"") -> bytes:
    """A STATUS frame: the code, the details (UTF-8), and the serialized RetryInfo if there is one."""
    tail = RETRY_MARK + retry if retry else b""
    return frame(STATUS, bytes([code.value[0]]) + details.encode(errors="replace") + tail)


def call_frame(path: str, metadata: Sequence[tuple[str, str | bytes]] | None) -> bytes:
    p, md = path.encode(), encode_metadata(metadata)
    return frame(CALL, struct.pack("<H", len(p)) + p + struct.pack("<H", len(md)) + md)


def parse_call(body: bytes) -> tuple[str, tuple[tuple[str, str], ...]]:
    (n,) = struct.unpack_from("<H", body, 0)
    path = body[2 : 2 + n].decode()
    (m,) = struct.unpack_from("<H", body, 2 + n)
    return path, decode_metadata(body[4 + n : 4 + n + m])


class LocalRpcError(grpc.RpcError):
    """A call's non-OK status, shaped like the error a grpc call raises (``code()``, ``details()``,
    ``trailing_metadata()``: the typed retry reason, if the status frame carried one)."""

    def __init__(self, code: grpc.StatusCode, details: str, retry: bytes = b"") -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self._retry = retry

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return ((RETRY_KEY, self._retry),) if self._retry else ()


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def broken(path: str, e: BaseException) -> LocalRpcError:
    """What a caller hears of an exchange the socket broke off: past its deadline, or unavailable."""
    code = grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(e, TimeoutError) else grpc.StatusCode.UNAVAILABLE
    return LocalRpcError(code, f"local socket {path}: {e or type(e).__name__}")


def status_code(value: int) -> grpc.StatusCode:
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


class _Answer:
    """A server-streaming call's messages, read whole: an iterator like a grpc call's, done already."""

    def __init__(self, items: Iterable[Any]) -> None:
        self._it = iter(list(items))

    def __iter__(self) -> _Answer:
        return self

    def __next__(self) -> Any:
        return next(self._it)

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        fn(self)


class LocalChannel:
    """``grpc.Channel``'s call surface over a Unix socket (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._free: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    # -- sockets ----------------------------------------------------------------------------------
    def _take(self, pooled: bool = True) -> socket.socket:
        with self._lock:
            if self._closed:
                raise LocalRpcError(grpc.StatusCode.CANCELLED, "the channel is closed")
            while pooled and self._free:
                s = self._free.pop()
                if _open(s):
                    return s
                s.close()  # the daemon closed it (it restarted, say): a fresh one below
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as e:  # out of fds, say
            raise broken(self.path, e) from None
        try:
            s.connect(self.path)
        except OSError as e:
            s.close()
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, f"local socket {self.path}: {e.strerror or e}") from None
        return s

    def _give(self, s: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(s)
                return
        s.close()

    def probe(self) -> None:
        """Connect one socket now (kept for the first call): raises LocalRpcError if that fails."""
        self._give(self._take())

    def peer_pid(self) -> int:
        """The daemon's pid, as the kernel names the socket's peer (SO_PEERCRED)."""
        s = self._take()
        try:
            creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        finally:
            self._give(s)
        return int(struct.unpack("3i", creds)[0])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for s in free:
            s.close()

    # -- one exchange -----------------------------------------------------------------------------
    def _exchange(self, path: str, requests: Iterable[bytes], timeout: float | None,
                  metadata: Sequence[tuple[str, str | bytes]] | None, fds: Sequence[int] = ()) -> list[bytes]:
        """One call: sent whole (with ``fds`` passed beside its first byte), its answer read whole.
        Whatever the socket does, the caller hears a status (LocalRpcError), never an OSError, and
        only a socket whose answer was read to its end goes back to the pool."""
        data = b"".join([call_frame(path, metadata), *(frame(MSG, r) for r in requests), frame(END)])
        s = self._sent(data, fds, timeout)
        try:
            answers = _read_answer(s)
        except LocalRpcError:
            self._give(s)  # a status was read in full: the socket is clean
            raise
        except (OSError, EOFError) as e:
            s.close()  # a broken or timed-out exchange leaves the socket unusable
            raise broken(self.path, e) from None
        self._give(s)
        return answers

    def _sent(self, data: bytes, fds: Sequence[int], timeout: float | None) -> socket.socket:
        """A socket the call was written to. A pooled one the daemon closed since it was checked (it
        restarted, say) fails the write: nothing reached a daemon, so the call goes once more on a
        fresh socket. Any socket that failed is closed here and never pooled again."""
        s = self._take()
        try:
            _send(s, data, fds, timeout)
            return s
        except (BrokenPipeError, ConnectionResetError):
            s.close()
        except OSError as e:
            s.close()
            raise broken(self.path, e) from None
        s = self._take(pooled=False)
        try:
            _send(s, data, fds, timeout)
            return s
        except OSError as e:
            s.close()
            raise broken(self.path, e) from None

    # -- grpc.Channel's surface (what the generated stub and the client call) ---------------------
    def unary_unary(self, path: str, request_serializer: Callable[[Any], bytes],
                    response_deserializer: Callable[[bytes], Any], **_: Any) -> Callable[..., Any]:
        def call(request: Any, timeout: float | None = None, metadata: Any = None, **__: Any) -> Any:
            (raw,) = self._exchange(path, [request_serializer(request)], timeout, metadata)
            return response_deserializer(raw)
        return call

    def unary_with_fds(self, path: str, request_serializer: Callable[[Any], bytes],
                       response_deserializer: Callable[[bytes], Any]) -> Callable[..., Any]:
        """A unary call that passes fds with its request (SCM_RIGHTS): ``call(request, fds, ...)``.
        Only the local socket can: AttachArena hands the daemon an arena's memfd this way."""
        def call(request: Any, fds: Sequence[int], timeout: float | None = None, metadata: Any = None,
                 **__: Any) -> Any:
            (raw,) = self._exchange(path, [request_serializer(request)], timeout, metadata, fds)
            return response_deserializer(raw)
        return call

    def unary_stream(self, path: str, request_serializer: Callable[[Any], bytes],
                     response_deserializer: Callable[[bytes], Any], **_: Any) -> Callable[..., Any]:
        def call(request: Any, timeout: float | None = None, metadata: Any = None, **__: Any) -> _Answer:
            raws = self._exchange(path, [request_serializer(request)], timeout, metadata)
            return _Answer(response_deserializer(r) for r in raws)
        return call

    def stream_unary(self, path: str, request_serializer: Callable[[Any], bytes],
                     response_deserializer: Callable[[bytes], Any], **_: Any) -> Callable[..., Any]:
        def call(requests: Iterator[Any], timeout: float | None = None, metadata: Any = None, **__: Any) -> Any:
            (raw,) = self._exchange(path, (request_serializer(r) for r in requests), timeout, metadata)
            return response_deserializer(raw)
        return call

    def stream_stream(self, path: str, request_serializer: Callable[[Any], bytes],
                      response_deserializer: Callable[[bytes], Any], **_: Any) -> Callable[..., Any]:
        def call(requests: Iterator[Any], timeout: float | None = None, metadata: Any = None, **__: Any) -> _Answer:
            raws = self._exchange(path, (request_serializer(r) for r in requests), timeout, metadata)
            return _Answer(response_deserializer(r) for r in raws)
        return call


def reachable(path: str) -> LocalChannel | None:
    """A channel to the daemon's socket at ``path`` if it answers from here (one socket connected
    now, kept for the first call), else None (another mount namespace, say: gRPC it is)."""
    local = LocalChannel(path)
    try:
        local.probe()
    except grpc.RpcError:
        local.close()
        return None
    return local


def _read_answer(s: socket.socket) -> list[bytes]:
    """MSG frames up to the STATUS frame; a non-OK status raises LocalRpcError. Reads as much as
    the socket holds at a time (one small answer is usually one recv), frames cut from that."""
    answers: list[bytes] = []
    buf = b""
    while True:
        while len(buf) < HEADER.size:
            buf += _recv(s, 1 << 16)
        length, kind = HEADER.unpack_from(buf)
        end = HEADER.size + frame_length(length)
        if len(buf) < end:
            buf += _recv_exact(s, end - len(buf))
        body, buf = buf[HEADER.size : end], buf[end:]
        if answer_frame(kind, body, answers):
            return answers


def frame_length(length: int) -> int:
    """A frame's body length from its header's length field; EOFError when out of range."""
    if not 1 <= length <= MAX_FRAME:
        raise EOFError(f"a frame of {length} bytes from the daemon")
    return length - 1


def answer_frame(kind: int, body: bytes, answers: list[bytes]) -> bool:
    """One frame of an answer: a message is kept in ``answers``; the status ends the answer (True),
    raising LocalRpcError unless it is OK; any other kind breaks the framing (EOFError)."""
    if kind == MSG:
        answers.append(body)
        return False
    if kind == STATUS:
        code = status_code(body[0]) if body else grpc.StatusCode.UNKNOWN
        if code != grpc.StatusCode.OK:
            details, _, retry = bytes(body[1:]).partition(RETRY_MARK)
            raise LocalRpcError(code, details.decode(errors="replace"), retry)
        return True
    raise EOFError(f"an unknown frame kind {kind} from the daemon")


def _open(s: socket.socket) -> bool:
    """Whether a pooled socket is still connected (nothing is pending on it between calls)."""
    try:
        s.setblocking(False)  # a socket with a timeout would wait for data to peek at
        return s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:  # closed, or broken: not one to use
        return False


def _send(s: socket.socket, data: bytes, fds: Sequence[int], timeout: float | None) -> None:
    s.settimeout(timeout)
    if not fds:
        s.sendall(data)
        return
    sent = s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    if sent < len(data):
        s.sendall(memoryview(data)[sent:])


def _recv(s: socket.socket, n: int) -> bytes:
    data = s.recv(n)
    if not data:
        raise EOFError("the daemon closed the local socket")
    return data


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = s.recv_into(view[got:])
        if k == 0:
            raise EOFError("the daemon closed the local socket")
        got += k
    return bytes(buf)
