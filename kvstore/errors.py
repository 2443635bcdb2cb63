"""Domain errors. The gRPC layer maps each to one status code, in one place (kvstore/server/status.py)."""

from __future__ import annotations


class KvstoreError(Exception):
    """Base of every error kvstore raises on purpose."""


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
