"""The asyncio twin of ``kvstore.transport.local_channel.LocalChannel``: grpc.aio.Channel's call surface over the
daemon's local socket (docs/LOCAL.md), for ``AsyncClient``. Same framing, same rules: a call holds one
connection from a pool for its whole exchange and reads its answer whole."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import grpc

from kvstore.transport.local_channel import (
    END,
    HEADER,
    MAX_FRAME,
    MSG,
    LocalRpcError,
    answer_frame,
    broken,
    call_frame,
    frame,
    frame_length,
)

_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class AsyncLocalChannel:
    def __init__(self, path: str) -> None:
        self.path = path
        self._free: list[_Conn] = []
        self._closed = False

    async def _take(self, pooled: bool = True) -> _Conn:
        if self._closed:
            raise LocalRpcError(grpc.StatusCode.CANCELLED, "the channel is closed")
        while pooled and self._free:
            conn = self._free.pop()
            if not conn[0].at_eof() and not conn[1].is_closing():
                return conn
            conn[1].close()  # the daemon closed it (it restarted, say)
        try:
            return await asyncio.open_unix_connection(self.path, limit=MAX_FRAME)
        except OSError as e:
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, f"local socket {self.path}: {e.strerror or e}") from None

    def _give(self, conn: _Conn) -> None:
        if self._closed:
            conn[1].close()
        else:
            self._free.append(conn)

    async def probe(self) -> None:
        self._give(await self._take())

    async def close(self) -> None:
        self._closed = True
        free, self._free = self._free, []
        for _, w in free:
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()

    async def _exchange(self, path: str, requests: Iterable[bytes], timeout: float | None,
                        metadata: Sequence[tuple[str, str | bytes]] | None) -> list[bytes]:
        data = b"".join([call_frame(path, metadata), *(frame(MSG, r) for r in requests), frame(END)])
        conn = await self._sent(data)
        try:
            answers = await asyncio.wait_for(_read_answer(*conn), timeout)
        except LocalRpcError:
            self._give(conn)  # a status was read in full: the connection is clean
            raise
        except (OSError, EOFError, asyncio.IncompleteReadError, TimeoutError) as e:
            conn[1].close()
            raise broken(self.path, e) from None
        self._give(conn)
        return answers

    async def _sent(self, data: bytes) -> _Conn:
        """As LocalChannel._sent: a connection the call was written to; one that failed is closed
        here and never pooled again."""
        conn = await self._take()
        try:
            conn[1].write(data)
            await conn[1].drain()
            return conn
        except ConnectionError:
            # a pooled connection the daemon closed while idle (the loop had not seen its EOF yet):
            # nothing reached a daemon, so the call goes once more on a fresh connection
            conn[1].close()
        except OSError as e:
            conn[1].close()
            raise broken(self.path, e) from None
        conn = await self._take(pooled=False)
        try:
            conn[1].write(data)  # drained by the answer's reader
            return conn
        except OSError as e:
            conn[1].close()
            raise broken(self.path, e) from None

    def unary_unary(self, path: str, request_serializer: Callable[[Any], bytes],
                    response_deserializer: Callable[[bytes], Any], **_: Any) -> Callable[..., Any]:
        async def call(request: Any, timeout: float | None = None, metadata: Any = None, **__: Any) -> Any:
            (raw,) = await self._exchange(path, [request_serializer(request)], timeout, metadata)
            return response_deserializer(raw)
        return call

    def unary_stream(self, path: str, request_serializer: Callable[[Any], bytes],
                     response_deserializer: Callable[[bytes], Any], **_: Any) -> Callable[..., Any]:
        def call(request: Any, timeout: float | None = None, metadata: Any = None, **__: Any) -> AsyncIterator[Any]:
            async def answers() -> AsyncIterator[Any]:
                for raw in await self._exchange(path, [request_serializer(request)], timeout, metadata):
                    yield response_deserializer(raw)
            return answers()
        return call

    def stream_unary(self, path: str, request_serializer: Callable[[Any], bytes],
                     response_deserializer: Callable[[bytes], Any], **_: Any) -> Callable[..., Any]:
        async def call(requests: Iterable[Any], timeout: float | None = None, metadata: Any = None, **__: Any) -> Any:
            (raw,) = await self._exchange(path, [request_serializer(r) for r in requests], timeout, metadata)
            return response_deserializer(raw)
        return call

    def stream_stream(self, path: str, request_serializer: Callable[[Any], bytes],
                      response_deserializer: Callable[[bytes], Any], **_: Any) -> Callable[..., Any]:
        def call(requests: Iterable[Any], timeout: float | None = None, metadata: Any = None,
                 **__: Any) -> AsyncIterator[Any]:
            async def answers() -> AsyncIterator[Any]:
                raws = await self._exchange(path, [request_serializer(r) for r in requests], timeout, metadata)
                for raw in raws:
                    yield response_deserializer(raw)
            return answers()
        return call


async def _read_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> list[bytes]:
    await writer.drain()
    answers: list[bytes] = []
    while True:
        length, kind = HEADER.unpack(await reader.readexactly(HEADER.size))
        body = await reader.readexactly(frame_length(length))
        if answer_frame(kind, body, answers):
            return answers
