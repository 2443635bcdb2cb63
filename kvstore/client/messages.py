"""What ``Client`` and ``AsyncClient`` share: requests built and answers parsed in one place, the
status -> exception mapping, and the choice of carrier when a client connects. No I/O here: the
two clients differ only in how they wait."""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from kvstore.client.config import ClientConfig, default_address
from kvstore.defaults import DEFAULT_PORT
from kvstore.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvstoreError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvstore.format.keys import ROOT
from kvstore.format.manifest import Manifest
from kvstore.results import LookupResult, SaveResult
from kvstore.transport import convert, framing, shm
from kvstore.transport.carrier import UNKNOWN_ARENA, Piece, StreamCarrier, same_host_dir
from kvstore.v1 import kvstore_pb2 as pb

ARENA_REATTACH_S = 240.0  # below the daemon's idle limit for arenas (server/arenas.py)
DETACH_TIMEOUT_S = 2.0  # a closing client does not wait long for a daemon that is gone

_ERRORS: dict[grpc.StatusCode, type[Exception]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
}


class SavedSession(NamedTuple):
    """A turn saved in one call: the new chunks' keys, how many were new, the committed manifest."""

    keys: list[bytes]
    written: int
    manifest: Manifest


def domain_error(e: grpc.RpcError) -> Exception:
    code = e.code()  # type: ignore[attr-defined]
    cls = _ERRORS.get(code, KvstoreError)
    details = e.details()  # type: ignore[attr-defined]
    return cls(f"daemon unavailable: {details}" if code == grpc.StatusCode.UNAVAILABLE else f"{details}")


def unknown_arena(e: grpc.RpcError) -> bool:
    """The daemon does not know the arena we named: it restarted, or unmapped it when idle."""
    return (e.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            and (e.details() or "").startswith(UNKNOWN_ARENA))  # type: ignore[attr-defined]


def retryable(e: grpc.RpcError) -> bool:
    return e.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def backoff(cfg: ClientConfig, attempt: int) -> float:
    return cfg.backoff_s * (2**attempt) * (0.5 + random.random())


def channel_options(cfg: ClientConfig) -> list[tuple[str, Any]]:
    opts: list[tuple[str, Any]] = [("grpc.max_receive_message_length", framing.MAX_MESSAGE_BYTES),
                                   ("grpc.max_send_message_length", framing.MAX_MESSAGE_BYTES)]
    if cfg.tls and cfg.tls.server_name:
        opts.append(("grpc.ssl_target_name_override", cfg.tls.server_name))
    return opts


def metadata(cfg: ClientConfig) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {cfg.token}"),) if cfg.token else ()


# -- a client's config and address -------------------------------------------------------------------
#: gRPC target URIs, passed to gRPC as they are (``unix:/run/kvstore.sock``, ``dns:///host:port``, ...)
_URI = re.compile(r"(unix|unix-abstract|dns|ipv4|ipv6|vsock):")


def client_config(config: ClientConfig | str | None, overrides: Mapping[str, Any]) -> ClientConfig:
    """What ``Client(...)`` / ``AsyncClient(...)`` were given: a ClientConfig, or the address as a
    positional string (``Client("127.0.0.1:50151")``), with keyword overrides of its fields."""
    if isinstance(config, str):
        if "address" in overrides:
            raise TypeError("the address was given twice: positionally and as address=")
        overrides = {**overrides, "address": config}
        config = None
    if config is not None and not isinstance(config, ClientConfig):
        raise TypeError(f"expected a ClientConfig or an address string, got {type(config).__name__}")
    cfg = config or ClientConfig()
    return ClientConfig(**{**cfg.__dict__, **overrides}) if overrides else cfg


def target(address: str) -> str:
    """The gRPC target a client dials for ``address`` ("" = $KVSTORE_ADDRESS or the default): HOST,
    HOST:PORT, [IPv6] or [IPv6]:PORT, or a bare IPv6 address; without a port the daemon's default
    port (50151, not gRPC's 443). A gRPC URI (unix:, dns:, ipv4:, ...) is passed on as it is.
    ValueError for a port that is not a number in 1-65535."""
    a = (address or default_address()).strip()
    if not a:
        raise ValueError("empty daemon address")
    if _URI.match(a):
        return a
    if a.startswith("["):
        host, bracket, rest = a.partition("]")
        if not bracket or host == "[":
            raise ValueError(f"malformed daemon address {address!r}: an IPv6 address needs its closing ']'")
        port = rest[1:] if rest.startswith(":") else None
        if rest and port is None:
            raise ValueError(f"malformed daemon address {address!r}: expected [IPv6]:PORT")
    elif a.count(":") > 1:  # a bare IPv6 address: it has no port
        return f"[{a}]:{DEFAULT_PORT}"
    else:
        host, colon, port_s = a.partition(":")
        if not host:
            raise ValueError(f"malformed daemon address {address!r}: no host")
        port = port_s if colon else None
    if port is None:
        return f"{a}:{DEFAULT_PORT}"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"malformed daemon address {address!r}: the port must be a number in 1-65535, got {port!r}")
    return a


# -- session versions ----------------------------------------------------------------------------------
class Versions:
    """The version (``Manifest.generation``) of each session a client last saved or loaded: the base its
    next save of that session names, so that a save over a version another client wrote since fails
    whole (FAILED_PRECONDITION) instead of silently replacing it. A session this client never saved
    or loaded has no base: its save replaces whatever is stored, as before versions."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def saw(self, m: Manifest) -> Manifest:
        """Note the version of a manifest the daemon answered with (a save, a load, a read)."""
        with self._lock:
            if m.generation:
                self._seen[(m.namespace, m.session_id)] = m.generation
            else:  # written before version stamps: no base to name
                self._seen.pop((m.namespace, m.session_id), None)
        return m

    def forget(self, namespace: str, session_id: str) -> None:
        with self._lock:
            self._seen.pop((namespace, session_id), None)

    def based(self, m: Manifest, base: int | None) -> Manifest:
        """``m`` as a save sends it: its generation is ``base`` if given (0: no base), else the version
        this client last saved or loaded of that session (whatever generation ``m`` carried: a
        manifest read from one session and saved as another must not name the first one's version)."""
        if base is None:
            with self._lock:
                base = self._seen.get((m.namespace, m.session_id), 0)
        if base < 0:
            raise InvalidArgument(f"a base version is >= 0 (0: none), got {base}")
        return replace(m, generation=base)


# -- connecting: which carrier ---------------------------------------------------------------------
@dataclass(frozen=True)
class Connection:
    """What a client learned when it connected, and the arena it should offer (if any)."""

    info: pb.ServerInfo
    arena_dir: Path | None  # create an arena here and attach it; None = the stream
    message_bytes: int

    def stream(self) -> StreamCarrier:
        return StreamCarrier(self.message_bytes)


def connection(info: pb.ServerInfo, cfg: ClientConfig) -> Connection:
    d = same_host_dir(info.host_id, info.shm_dir) if cfg.shared_memory and cfg.arena_bytes > 0 else None
    return Connection(info, d, min(framing.DEFAULT_MESSAGE_BYTES, info.max_message_bytes // 2))


def attach_request(arena: shm.Arena) -> pb.AttachArenaRequest:
    return pb.AttachArenaRequest(path=arena.path, size=arena.size, nonce=arena.nonce)


# -- requests -------------------------------------------------------------------------------------
def save_header(namespace: str, layout_id: bytes, parent: bytes, first_index: int) -> pb.SaveHeader:
    return pb.SaveHeader(namespace=namespace, layout_id=layout_id, parent_key=parent, first_index=first_index)


def turn_header(manifest: Manifest, new_chunks: int) -> pb.SaveHeader:
    """A turn: the manifest's last ``new_chunks`` chunks are sent, then the manifest is committed."""
    first = len(manifest.chunk_keys) - new_chunks
    if first < 0:
        raise InvalidArgument(f"{new_chunks} new chunks, but the manifest names {len(manifest.chunk_keys)}")
    h = save_header(manifest.namespace, manifest.layout_id, manifest.chunk_keys[first - 1] if first else ROOT, first)
    h.commit.CopyFrom(convert.session_to_pb(manifest))
    return h


def save_requests(header: pb.SaveHeader, pieces: Iterator[Piece]) -> Iterator[pb.SaveChunksRequest]:
    """The header (naming the arena part of the batch, if any), then the streamed part."""
    h = pb.SaveHeader()
    h.CopyFrom(header)
    first = next(pieces, None)
    if first is not None and first.handle is not None:
        h.arena_id, h.arena_bytes = first.handle.arena_id, first.handle.size
        first = None
    yield pb.SaveChunksRequest(header=h, data=first.data if first is not None else b"")
    for p in pieces:
        yield pb.SaveChunksRequest(data=p.data)


def lookup_request(namespace: str, layout_id: bytes, token_ids: Any) -> pb.LookupRequest:
    return pb.LookupRequest(namespace=namespace, layout_id=layout_id, token_ids=list(map(int, token_ids)))


def prefetch_request(namespace: str, session_id: str) -> pb.PrefetchSessionRequest:
    return pb.PrefetchSessionRequest(namespace=namespace, session_id=session_id)


# -- answers --------------------------------------------------------------------------------------
def save_result(r: pb.SaveChunksResponse) -> SaveResult:
    return SaveResult(list(r.keys), r.written)


def saved_session(r: pb.SaveChunksResponse) -> SavedSession:
    return SavedSession(list(r.keys), r.written, convert.session_from_pb(r.session))


def lookup_result(r: pb.LookupResponse) -> LookupResult:
    return LookupResult(r.cached_tokens, r.requested_tokens, r.chunks, {t.tier: t.chunks for t in r.tiers})


def session_chunks(msg: pb.LoadSessionResponse) -> pb.ChunkData | None:
    return msg.chunks if msg.HasField("chunks") else None


def tier_counts(tiers: Any) -> dict[str, int]:
    return {t.tier: t.chunks for t in tiers}
