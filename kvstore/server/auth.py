"""Per-namespace bearer tokens. With no tokens configured every caller is allowed (the daemon
then binds only to loopback unless told otherwise)."""

from __future__ import annotations

import hashlib
import hmac
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvstore.errors import InvalidArgument, PermissionDenied, Unauthenticated
from kvstore.format.manifest import check_namespace
from kvstore.server.startup import CannotStart
from kvstore.store.quotas import QuotaConfigError, Quotas, from_tokens_file

ADMIN = "*"


def check_tokens(tokens: Mapping[str, Sequence[str]]) -> dict[str, frozenset[str]]:
    """Each token with its scopes, or ValueError saying which entry is unusable (by its scopes: a
    token is a secret, never echoed). A token must be non-blank and without surrounding whitespace
    (a request's token is stripped: a bare ``Bearer `` header would present the empty token, and
    " abc" could never match); scopes are namespaces, or "*"."""
    out: dict[str, frozenset[str]] = {}
    for token, scopes in tokens.items():
        if isinstance(scopes, str) or not all(isinstance(s, str) for s in scopes):
            raise ValueError(f"a token's scopes must be a list of namespaces, got {scopes!r}")
        which = f"the token for {sorted(scopes)}"
        if not isinstance(token, str) or not token.strip():
            raise ValueError(f"{which} is empty or blank: a request with a bare 'Bearer ' header would be "
                             f"served with its scopes")
        if token != token.strip():
            raise ValueError(f"{which} has leading or trailing whitespace: a request's token is stripped, so "
                             f"it could never match")
        for s in scopes:
            if s != ADMIN:
                try:
                    check_namespace(s)
                except InvalidArgument as e:
                    raise ValueError(f"{which}: {e}") from None
        out[token] = frozenset(scopes)
    return out


class Auth:
    def __init__(self, tokens: Mapping[str, Sequence[str]]) -> None:
        self._tokens = check_tokens(tokens)

    @classmethod
    def from_file(cls, path: str) -> Auth:
        """TOML: ``[tokens]`` table of ``"<token>" = ["namespace", ...]``; ``"*"`` covers every
        namespace and the admin RPCs (stats, eviction). A file the daemon cannot use (unreadable,
        not TOML, an empty or blank token, a scope that is no namespace) is CannotStart, naming it."""
        if not path:
            return cls({})
        try:
            data = tomllib.loads(Path(path).read_text())
            tokens = data.get("tokens", {})
            if not isinstance(tokens, dict) or not all(isinstance(v, list) for v in tokens.values()):
                raise ValueError("expected a [tokens] table of token = [namespaces]")
            return cls(tokens)
        except (OSError, ValueError) as e:  # tomllib.TOMLDecodeError is a ValueError
            raise CannotStart(f"tokens file {path}: {e}") from None

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
        if not given:  # never a match: no token may be empty (check_tokens)
            raise Unauthenticated("missing bearer token (metadata 'authorization: Bearer <token>')")
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


def load_quotas(path: str) -> Quotas:
    """The per-namespace quotas of the tokens file (its ``[quotas]`` tables: ``store/quotas.py``); none
    without a file or without that table. One the daemon cannot use is CannotStart, naming the file,
    the namespace and the field."""
    if not path:
        return Quotas()
    try:
        return from_tokens_file(tomllib.loads(Path(path).read_text()))
    except QuotaConfigError as e:
        raise CannotStart(f"tokens file {path}: {e}") from None
    except (OSError, ValueError) as e:
        raise CannotStart(f"tokens file {path}: {e}") from None
