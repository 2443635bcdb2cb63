"""Exceptions -> gRPC status codes, in one place: both front ends (grpc_adapter.py, local.py) answer
a servicer body's exception with ``status_of``.

A domain error (kvstore.errors) becomes its status with its message; anything else is INTERNAL and
logged with its traceback, since it is a daemon bug. A domain error's typed retry reason
(``KvstoreError.reason``) goes beside its status (``retry_of``: kvstore/transport/retry.py), never
in its words. Every message is capped (``capped``): what it quotes of a request can be as long as
the request. Bytes a client sent that do not parse are the client's error (INVALID_ARGUMENT), never
INTERNAL (``client_bytes``, handlers.parsed).
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections.abc import Iterator

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
from kvstore.transport import retry

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


def status_of(method: str, e: Exception) -> tuple[grpc.StatusCode, str]:
    """The status a call of ``method`` that raised ``e`` ends with, and its capped message; logged
    (an internal error with its traceback: call this from the ``except`` that caught ``e``)."""
    code = next((code for cls, code in _STATUS if isinstance(e, cls)), None)
    if code is None:
        log.error("internal error in %s", method, exc_info=e)
        return grpc.StatusCode.INTERNAL, capped(f"internal error: {type(e).__name__}: {e}")
    details = capped(str(e))
    log.info("%s -> %s: %s", method, code.name, details)
    return code, details


def retry_of(e: BaseException) -> bytes:
    """The serialized RetryInfo that goes beside ``e``'s status (b"": none): the local socket's RETRY
    frame; gRPC's trailing metadata is ``retry.trailers(e)``, the same bytes under ``retry.RETRY_KEY``."""
    return retry.encode(e)


@contextlib.contextmanager
def client_bytes(what: str) -> Iterator[None]:
    """Around code that parses bytes a client sent (chunks, a trailing span): a parse failure that
    is not already a domain error is still the client's, never an internal error."""
    try:
        yield
    except (struct.error, OverflowError) as e:
        raise InvalidArgument(f"{what} do not parse: {e}") from e
