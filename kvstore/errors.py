"""Domain errors. The gRPC layer maps each to one status code, in one place (kvstore/server/status.py).

A refusal the client can cure and then ask again says so with a typed ``Retry`` reason (and, for a
destination too small, the bytes it needs): it travels beside the status (``RetryInfo`` in the proto)
and the client decides on it alone, never on the message, which is for people."""

from __future__ import annotations

import enum


class Retry(enum.IntEnum):
    """Why a refused call may succeed once the client has done something; the proto's ``RetryReason``
    (same names and numbers: tests/client/test_retry_reasons.py)."""

    RETRY_REASON_UNSPECIFIED = 0
    UNKNOWN_ARENA = 1  # attach a fresh arena, ask again
    ARENA_TOO_SMALL = 2  # grow the arena to ``needed_bytes``, ask again (nothing was written)
    CALLER_MEMORY_REFUSED = 3  # the daemon cannot reach the caller's memory: go through the arena or the stream
    CALLER_MEMORY_TOO_SMALL = 4  # the caller's buffer holds less than ``needed_bytes`` (nothing was written)


class KvstoreError(Exception):
    """Base of every error kvstore raises on purpose. ``reason``: a ``Retry`` reason, if the caller
    can cure the refusal; ``needed_bytes``: for a destination too small, what the answer takes."""

    def __init__(self, *args: object, reason: Retry = Retry.RETRY_REASON_UNSPECIFIED, needed_bytes: int = 0) -> None:
        super().__init__(*args)
        self.reason = reason
        self.needed_bytes = needed_bytes


class InvalidArgument(KvstoreError, ValueError):
    """The request itself is wrong (bad layout, sizes, ids, chunk bytes)."""


class NotFound(KvstoreError, KeyError):
    """The named session does not exist (a chunk miss is a normal answer, not this)."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class FailedPrecondition(KvstoreError):
    """The request is well formed but the store's state does not allow it (e.g. a commit that
    references chunks the store does not hold)."""


class PermissionDenied(KvstoreError):
    """The caller's credentials do not cover this namespace."""


class Unavailable(KvstoreError):
    """Every tier that could serve the request failed; retrying later may succeed."""


class ResourceExhausted(KvstoreError):
    """The store is out of space (a full disk, its configured size limit): nothing was written,
    everything stored before is still served, and the same request may succeed once space returns."""


class Unauthenticated(KvstoreError):
    """No bearer token, or one the daemon does not know."""
