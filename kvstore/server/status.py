"""Exceptions -> gRPC status codes, in one place: every handler of the servicer goes through here.

A domain error (kvstore.errors) becomes its status with its message; anything else is INTERNAL and
logged with its traceback, since it is a daemon bug. Every message is capped (``capped``): what it
quotes of a request can be as long as the request. Bytes a client sent that do not parse are the
client's error (INVALID_ARGUMENT), never INTERNAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import struct
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from kvstore.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvstore.server.handlers import Undecodable

log = logging.getLogger("kvstore.server")
# the most a status message carries (UTF-8 bytes): ample for any message of ours, with what it quotes
MAX_DETAILS_BYTES = 1024

_STATUS: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
]


def _status_of(e: BaseException) -> grpc.StatusCode | None:
    return next((code for cls, code in _STATUS if isinstance(e, cls)), None)


def capped(details: str, limit: int = MAX_DETAILS_BYTES) -> str:
    """``details`` in at most ``limit`` UTF-8 bytes: a message quotes client input (ids, paths),
    and a status message travels in a trailer that a stock gRPC client refuses past its metadata
    limit (8 KiB by default; percent-encoding may triple the bytes), answering RESOURCE_EXHAUSTED
    instead, which in this API means a full disk. Head and tail are kept, the middle is cut
    (the tail often names the namespace or the fix)."""
    raw = details.encode("utf-8", errors="replace")
    if len(raw) <= limit:
        return details
    mark = f" ...[{len(raw)} bytes, cut]... "
    keep = max(0, limit - len(mark.encode()))
    head, tail = raw[: keep * 3 // 4], raw[len(raw) - (keep - keep * 3 // 4):]
    return head.decode(errors="ignore") + mark + tail.decode(errors="ignore")


async def abort(context: grpc.aio.ServicerContext, method: str, e: Exception) -> None:
    code = _status_of(e)
    if code is None:
        log.exception("internal error in %s", method)
        await context.abort(grpc.StatusCode.INTERNAL, capped(f"internal error: {type(e).__name__}: {e}"))
    details = capped(str(e))
    log.info("%s -> %s: %s", method, code.name, details)  # type: ignore[union-attr]
    await context.abort(code, details)  # type: ignore[arg-type]


def parsed(request: Any) -> Any:
    if isinstance(request, Undecodable):
        raise InvalidArgument(request.reason)
    return request


@contextlib.contextmanager
def client_bytes(what: str) -> Iterator[None]:
    """Around code that parses bytes a client sent (chunks, a trailing span): a parse failure that
    is not already a domain error is still the client's, never an internal error."""
    try:
        yield
    except (struct.error, OverflowError) as e:
        raise InvalidArgument(f"{what} do not parse: {e}") from e


def rpc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Map domain exceptions to gRPC status codes (unary and server-streaming handlers); a request
    whose bytes did not parse is INVALID_ARGUMENT before the handler runs."""
    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in fn(self, parsed(request), context):
                    yield item
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception as e:
                await abort(context, fn.__name__, e)
        return stream

    @functools.wraps(fn)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, parsed(request), context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as e:
            await abort(context, fn.__name__, e)
    return unary
