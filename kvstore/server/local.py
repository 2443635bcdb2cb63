"""The daemon's local socket: every KVStore method, for same-host clients of the daemon's own user.

The same handlers as the gRPC listener (handlers.methods), the same messages, status codes and
metadata (auth is unchanged), framed as kvstore/localrpc.py describes. What it saves is gRPC's
per-call cost on one host (HTTP/2 framing, completion-queue thread hops: ~0.5-0.8 ms a call), which
dominates a small arena load or save. The socket file is mode 0600 in the daemon's shm directory and
every connection's peer is checked (SO_PEERCRED) to run as the daemon's uid, the same rule the
arenas follow (kvstore/shm.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from kvstore import localrpc
from kvstore.localrpc import CALL, END, HEADER, MSG, STATUS, frame
from kvstore.server.handlers import Method

log = logging.getLogger("kvstore.server")


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


class LocalContext:
    """What the handlers use of a grpc.aio.ServicerContext: the call's metadata, and abort."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata
        self.code = grpc.StatusCode.OK
        self.details = ""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.code, self.details = code, details
        raise grpc.aio.AbortError()


class _Protocol(Exception):
    """The peer broke the framing: the connection is closed."""


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    length, kind = HEADER.unpack(await reader.readexactly(HEADER.size))
    if not 1 <= length <= localrpc.MAX_FRAME:
        raise _Protocol(f"a frame of {length} bytes")
    return kind, await reader.readexactly(length - 1)


class LocalServer:
    def __init__(self, methods: dict[str, Method], path: Path, on_call: Callable[[], None] = lambda: None) -> None:
        self.methods = methods
        self.path = path
        self.on_call = on_call  # counts calls for Stats
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        sweep_stale(self.path.parent)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # left by a daemon on this port that was killed: the port is ours now
        old = os.umask(0o177)  # created 0600: no window in which another user could connect
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=1 << 20)
        finally:
            os.umask(old)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for t in list(self._conns):
                t.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            if _peer_uid(writer) != os.getuid():
                log.warning("local socket: refused a peer of another user")
                return
            while True:
                try:
                    kind, body = await _read_frame(reader)
                except asyncio.IncompleteReadError:
                    return  # the client closed its socket between calls
                if kind != CALL:
                    raise _Protocol(f"expected a call, got frame kind {kind}")
                path, metadata = localrpc.parse_call(body)
                await self._call(self.methods.get(path), path, metadata, reader, writer)
        except (_Protocol, asyncio.IncompleteReadError, ConnectionError, struct.error, UnicodeDecodeError) as e:
            log.info("local socket: connection dropped: %s", e)
        finally:
            self._conns.discard(task)
            writer.close()

    async def _call(self, method: Method | None, path: str, metadata: tuple[tuple[str, str], ...],
                    reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests = _Requests(reader, method.deserialize if method else bytes)
        out = _Reply(writer)
        if method is None:
            await requests.drain()
            out.add(_status(grpc.StatusCode.UNIMPLEMENTED, f"no method {path}"))
            await out.end()
            return
        self.on_call()
        ctx = LocalContext(metadata)
        try:
            request = requests.iterate() if method.client_streaming else await requests.one()
            if method.server_streaming:
                async for answer in method.handler(request, ctx):
                    await out.message(method.serialize(answer))
            else:
                await out.message(method.serialize(await method.handler(request, ctx)))
            status = _status(grpc.StatusCode.OK)
        except grpc.aio.AbortError:
            status = _status(ctx.code, ctx.details)
        await requests.drain()  # the END frame, and what a handler that refused a stream early left
        out.add(status)
        await out.end()


class _Reply:
    """A call's answer frames, sent in as few writes as possible: each send wakes the client, and
    on a busy host a wake-up costs more than joining a few small frames (an arena answer is one
    small message and a status: one send)."""

    FLUSH_BYTES = 1 << 20

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, data: bytes) -> None:
        self.parts.append(data)
        self.size += len(data)

    async def message(self, raw: bytes) -> None:
        self.add(HEADER.pack(len(raw) + 1, MSG))
        self.add(raw)
        if self.size >= self.FLUSH_BYTES:  # a streamed answer: sent as it is made, a few at a time
            self._send()
            await self.writer.drain()

    def _send(self) -> None:
        if self.parts:
            self.writer.write(self.parts[0] if len(self.parts) == 1 else b"".join(self.parts))
            self.parts, self.size = [], 0

    async def end(self) -> None:
        self._send()
        await self.writer.drain()


class _Requests:
    """A call's request frames: MSG* END (one MSG for a unary call)."""

    def __init__(self, reader: asyncio.StreamReader, deserialize: Callable[[bytes], Any]) -> None:
        self.reader = reader
        self.deserialize = deserialize
        self.done = False

    async def one(self) -> Any:
        kind, body = await _read_frame(self.reader)
        if kind != MSG:
            raise _Protocol(f"expected a request message, got frame kind {kind}")
        return self.deserialize(body)

    async def iterate(self) -> AsyncIterator[Any]:
        while not self.done:
            kind, body = await _read_frame(self.reader)
            if kind == END:
                self.done = True
            elif kind == MSG:
                yield self.deserialize(body)
            else:
                raise _Protocol(f"expected a request message or the end, got frame kind {kind}")

    async def drain(self) -> None:
        async for _ in self.iterate():
            pass


def _status(code: grpc.StatusCode, details: str = "") -> bytes:
    return frame(STATUS, bytes([code.value[0]]) + details.encode())


def _peer_uid(writer: asyncio.StreamWriter) -> int:
    sock: socket.socket = writer.get_extra_info("socket")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]
