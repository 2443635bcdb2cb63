"""Per-RPC Prometheus metrics: calls by method and status code, latency histograms, message bytes.

The store's own state (tiers, hits, sessions) is read at scrape time by ``metrics.StoreCollector``;
what only the gRPC layer sees (each call's outcome, duration and message bytes) is counted here as
it happens, by a server interceptor, so no handler has to remember to report. One instance per
daemon, on the daemon's own registry: no globals. Chunk bytes that travel through a same-host arena
are not in the message bytes; ``kvstore_transport_*`` counts those calls.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message
from prometheus_client import CollectorRegistry, Counter, Histogram

# From a cached lookup (~0.1 ms) to a multi-GB load or a save behind a slow fsync (tens of seconds).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0)


class RpcMetrics:
    """What the daemon records about each finished call."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.calls = Counter("kvstore_rpc", "RPCs finished, by method and final status code",
                             ["method", "code"], registry=registry)
        self.seconds = Histogram("kvstore_rpc_duration_seconds", "Time from a call's start to its final status",
                                 ["method"], buckets=LATENCY_BUCKETS, registry=registry)
        self.bytes = Counter("kvstore_rpc_message_bytes", "Serialized message bytes, by method and direction",
                             ["method", "direction"], registry=registry)

    def observe(self, method: str, code: str, seconds: float, received: int, sent: int) -> None:
        """Record one finished call: ``code`` is the gRPC status name ("OK", "NOT_FOUND", ...)."""
        self.calls.labels(method, code).inc()
        self.seconds.labels(method).observe(seconds)
        self.bytes.labels(method, "received").inc(received)
        self.bytes.labels(method, "sent").inc(sent)


_HANDLER_OF = {"unary_unary": grpc.unary_unary_rpc_method_handler,
               "unary_stream": grpc.unary_stream_rpc_method_handler,
               "stream_unary": grpc.stream_unary_rpc_method_handler,
               "stream_stream": grpc.stream_stream_rpc_method_handler}


def _size(msg: Any) -> int:
    return msg.ByteSize() if isinstance(msg, Message) else 0  # an undecodable request counts nothing


class _Call:
    """One call being measured: bytes as they pass, the outcome when the RPC terminates."""

    def __init__(self, metrics: RpcMetrics, method: str, context: grpc.aio.ServicerContext) -> None:
        self.metrics, self.method, self.start = metrics, method, time.perf_counter()
        self.received = self.sent = 0
        context.add_done_callback(self._done)

    def _done(self, context: grpc.aio.ServicerContext) -> None:
        code = context.code()
        name = "CANCELLED" if code is None and context.cancelled() else (code or grpc.StatusCode.OK).name
        self.metrics.observe(self.method, name, time.perf_counter() - self.start, self.received, self.sent)

    async def requests(self, it: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for msg in it:
            self.received += _size(msg)
            yield msg

    async def responses(self, it: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for msg in it:
            self.sent += _size(msg)
            yield msg


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler of the server so that each call is observed exactly once."""

    def __init__(self, metrics: RpcMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:  # an unknown method: gRPC answers UNIMPLEMENTED itself
            return None
        method = details.method.rsplit("/", 1)[-1]
        m = self.metrics
        kind = ("stream" if handler.request_streaming else "unary") + "_" + (
            "stream" if handler.response_streaming else "unary")
        behavior = getattr(handler, kind)

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            call = _Call(m, method, context)
            if handler.request_streaming:
                request = call.requests(request)
            else:
                call.received += _size(request)
            out = behavior(request, context)
            if handler.response_streaming:
                return call.responses(out)
            response = await out
            call.sent += _size(response)
            return response

        if handler.response_streaming:
            async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for msg in await wrapped(request, context):
                    yield msg
            fn: Any = streaming
        else:
            fn = wrapped
        return _HANDLER_OF[kind](fn, request_deserializer=handler.request_deserializer,
                           response_serializer=handler.response_serializer)
