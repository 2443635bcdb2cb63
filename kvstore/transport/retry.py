"""A refusal's typed retry reason, as it travels beside the status on both front ends.

The daemon puts a ``RetryInfo`` (kvstore.v1) beside a non-OK status when the client can cure the
refusal and ask again (``kvstore.errors.Retry``): on gRPC as the binary trailing metadata
``RETRY_KEY``, on the local socket as a RETRY frame before the status (kvstore/transport/local_channel.py),
which the local channel hands back under the same key. The client reads it here, into the exception
it raises, and decides its retries on that alone: a status message is for people, and a message
that merely begins with the old words is not a reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from google.protobuf.message import DecodeError

from kvstore.errors import KvstoreError, Retry
from kvstore.v1 import kvstore_pb2 as pb

RETRY_KEY = "kvstore-retry-bin"  # "-bin": gRPC carries the value as bytes


def encode(e: BaseException) -> bytes:
    """The serialized RetryInfo a refusal carries, or b"" when it carries none."""
    if not isinstance(e, KvstoreError) or e.reason == Retry.RETRY_REASON_UNSPECIFIED:
        return b""
    info = pb.RetryInfo(reason=pb.RetryReason.Value(e.reason.name), needed_bytes=max(0, e.needed_bytes))
    return info.SerializeToString()


def trailers(e: BaseException) -> tuple[tuple[str, bytes], ...]:
    """``e``'s reason as gRPC trailing metadata (empty when it has none)."""
    raw = encode(e)
    return ((RETRY_KEY, raw),) if raw else ()


def decode(metadata: Iterable[Any] | None) -> tuple[Retry, int]:
    """(reason, needed bytes) from a status's trailing metadata; (unspecified, 0) when it names none
    or one this client does not know (a newer daemon's: not retried)."""
    for item in metadata or ():
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key != RETRY_KEY or not isinstance(value, bytes):
            continue
        info = pb.RetryInfo()
        try:
            info.ParseFromString(value)
            reason = Retry(info.reason)
        except (DecodeError, ValueError):
            break
        return reason, int(info.needed_bytes)
    return Retry.RETRY_REASON_UNSPECIFIED, 0
