"""Per-namespace bearer tokens. With no tokens configured every caller is allowed (the daemon
then binds only to loopback unless told otherwise)."""

from __future__ import annotations

import hashlib
import hmac
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvstore.errors import PermissionDenied, Unauthenticated

ADMIN = "*"


class Auth:
    def __init__(self, tokens: Mapping[str, Sequence[str]]) -> None:
        self._tokens = {t: frozenset(ns) for t, ns in tokens.items()}

    @classmethod
    def from_file(cls, path: str) -> Auth:
        """TOML: ``[tokens]`` table of ``"<token>" = ["namespace", ...]``; ``"*"`` covers every
        namespace and the admin RPCs (stats, eviction)."""
        if not path:
            return cls({})
        data = tomllib.loads(Path(path).read_text())
        tokens = data.get("tokens", {})
        if not isinstance(tokens, dict) or not all(isinstance(v, list) for v in tokens.values()):
            raise ValueError(f"{path}: expected a [tokens] table of token = [namespaces]")
        return cls(tokens)

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def _match(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> tuple[str, frozenset[str]]:
        header = next((v for k, v in metadata or () if k == "authorization"), None)
        if isinstance(header, bytes):
            header = header.decode(errors="replace")
        if not header or not header.startswith("Bearer "):
            raise Unauthenticated("missing bearer token (metadata 'authorization: Bearer <token>')")
        given = header[len("Bearer "):].strip().encode()
        found = None
        for token, scopes in self._tokens.items():  # compare against every token: no timing hint
            if hmac.compare_digest(token.encode(), given):
                found = token, scopes
        if found is None:
            raise Unauthenticated("unknown bearer token")
        return found

    def _scopes(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> frozenset[str]:
        return self._match(metadata)[1]

    def identity(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
        """Who is calling, to bind what a call creates (an arena) to its caller: a digest of the
        bearer token (the token itself is kept out of memory dumps of that state and out of logs).
        With no tokens configured every caller is the one identity ""."""
        if not self.enabled:
            return ""
        return hashlib.sha256(self._match(metadata)[0].encode()).hexdigest()

    def namespaces(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> frozenset[str] | None:
        """The namespaces the caller may use; None = all of them."""
        if not self.enabled:
            return None
        scopes = self._scopes(metadata)
        return None if ADMIN in scopes else scopes

    def check(self, metadata: Sequence[tuple[str, str | bytes]] | None, namespace: str) -> None:
        allowed = self.namespaces(metadata)
        if allowed is not None and namespace not in allowed:
            raise PermissionDenied(f"token does not cover namespace {namespace!r}")

    def check_admin(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> None:
        if self.enabled and self.namespaces(metadata) is not None:
            raise PermissionDenied("this RPC needs an admin token (scope '*')")
