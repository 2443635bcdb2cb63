"""The gRPC front end: the servicer's synchronous bodies (handlers.py) served by a grpc.aio server.

The daemon's one event loop only moves bytes; a body, which blocks as long as its store calls do
(an fsync'd save, LMDB reads), runs in a worker thread (the loop's default executor, which the
daemon drains before it closes the store), in exactly one of three ways, by the method's kind:

- unary: the body in one worker-thread hop;
- server streaming: the body's generator advanced a few messages (``MESSAGES_PER_HOP``) per hop,
  one hop ahead: the next hop reads while the loop sends this hop's messages (gRPC's core sends
  without the GIL). Never more than one hop in flight, so one thread at a time advances the
  generator; a call cancelled mid-stream closes it only once the hop in flight is done;
- client streaming: the messages collected on the loop (the first vetted at once, where the body
  says how: handlers.first_checked_by), then the body in one hop.

A body that declares a call quick (handlers.quick_when: a small load the memory tier holds) runs on
the loop itself: a hop costs more than such a call (0.1-0.45 ms, more under load; without this,
1 MiB loads over gRPC took 11-18% longer, with 1 and with 8 clients). Exceptions become status
codes through status.status_of, as on the local socket.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import grpc

from kvstore.server.handlers import SERVICE, Call, Method, methods, parsed
from kvstore.server.status import status_of
from kvstore.transport import retry

MESSAGES_PER_HOP = 4  # stream messages a worker-thread hop makes while a streamed answer is sent
_T = TypeVar("_T")

_KINDS = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
          (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


def _hop(fn: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:
    """``fn(*args)`` in a worker thread of the loop's default executor."""
    return asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _call(context: grpc.aio.ServicerContext) -> Call:
    return Call(context.invocation_metadata() or ())


async def _abort(context: grpc.aio.ServicerContext, m: Method, e: Exception) -> None:
    await context.abort(*status_of(m.name, e), trailing_metadata=retry.trailers(e))


def _unary(m: Method) -> Callable[..., Any]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        call = _call(context)
        try:
            if m.quick is not None and m.quick(request, call):
                return m.handler(request, call)
            return await _hop(m.handler, request, call)
        except Exception as e:
            await _abort(context, m, e)
    return unary


def _take(answers: Iterator[Any], n: int) -> tuple[list[Any], bool, Exception | None]:
    """Up to ``n`` answers, whether there may be more (no extra hop just to learn the end), and what
    the body raised making them (the answers made before are still sent, as on the local socket)."""
    out: list[Any] = []
    try:
        for a in answers:
            out.append(a)
            if len(out) == n:
                return out, True, None
    except Exception as e:
        return out, False, e
    return out, False, None


def _server_streaming(m: Method) -> Callable[..., Any]:
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        call = _call(context)
        answers: Iterator[Any] | None = None
        ahead: asyncio.Future[tuple[list[Any], bool, Exception | None]] | None = None
        try:
            answers = m.handler(request, call)
            if m.quick is not None and m.quick(request, call):
                for a in answers:
                    yield a
                return
            ahead = _hop(_take, answers, MESSAGES_PER_HOP)
            more = True
            while more:
                # shielded: a cancelled call must not mark the hop done while its thread still runs
                batch, more, error = await asyncio.shield(ahead)
                if more:
                    ahead = _hop(_take, answers, MESSAGES_PER_HOP)
                for a in batch:
                    yield a
                if error is not None:
                    raise error
        except Exception as e:
            await _abort(context, m, e)
        finally:
            if answers is not None:
                _close(answers, ahead)
    return stream


def _close(answers: Iterator[Any], ahead: asyncio.Future[Any] | None) -> None:
    """Close a body's generator (its ``finally`` unpins what it read) in a worker thread, once no
    hop advances it any more: a call cancelled mid-stream may leave one in flight."""
    def later(done: asyncio.Future[Any] | None = None) -> None:
        if done is not None and not done.cancelled():
            done.exception()  # retrieved: if the call is gone, nobody else will look
        close = getattr(answers, "close", None)
        if close is None or getattr(answers, "gi_frame", True) is None:  # finished: nothing to close
            return
        try:
            _hop(close)
        except RuntimeError:  # the executor is shut down (the daemon is stopping): here, then
            close()

    if ahead is None or ahead.done():
        later(ahead)
    else:
        ahead.add_done_callback(later)


def _client_streaming(m: Method) -> Callable[..., Any]:
    async def collect(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        call = _call(context)
        try:
            got: list[Any] = []
            async for r in requests:
                if not got and m.first_check is not None:
                    m.first_check(parsed(r), call)
                got.append(r)
            return await _hop(m.handler, got, call)
        except Exception as e:
            await _abort(context, m, e)
    return collect


def _behavior(m: Method) -> Callable[..., Any]:
    """The adapter of one method's kind (``methods`` refuses a bidirectional one at startup)."""
    if m.client_streaming:
        return _client_streaming(m)
    return _server_streaming(m) if m.server_streaming else _unary(m)


def add_service(servicer: Any, server: grpc.aio.Server) -> None:
    """``add_KVStoreServicer_to_server`` for the synchronous bodies of ``servicer``, with the lenient
    deserializers of handlers.methods."""
    handlers = {}
    for m in methods(servicer).values():
        make = _KINDS[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = make(_behavior(m), request_deserializer=m.deserialize, response_serializer=m.serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)

