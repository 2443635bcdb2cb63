"""What ``Client`` and ``AsyncClient`` share: requests built and answers parsed in one place, the
status -> exception mapping, and the choice of carrier when a client connects. No I/O here: the
two clients differ only in how they wait."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from kvstore import convert, framing, shm, transport
from kvstore.client_config import ClientConfig
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
from kvstore.keys import ROOT
from kvstore.manifest import Manifest
from kvstore.results import LookupResult, SaveResult
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
            and (e.details() or "").startswith(transport.UNKNOWN_ARENA))  # type: ignore[attr-defined]


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


# -- connecting: which carrier ---------------------------------------------------------------------
@dataclass(frozen=True)
class Connection:
    """What a client learned when it connected, and the arena it should offer (if any)."""

    info: pb.ServerInfo
    arena_dir: Path | None  # create an arena here and attach it; None = the stream
    message_bytes: int

    def stream(self) -> transport.StreamCarrier:
        return transport.StreamCarrier(self.message_bytes)


def connection(info: pb.ServerInfo, cfg: ClientConfig) -> Connection:
    d = transport.same_host_dir(info.host_id, info.shm_dir) if cfg.shared_memory and cfg.arena_bytes > 0 else None
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


def save_requests(header: pb.SaveHeader, pieces: Iterator[transport.Piece]) -> Iterator[pb.SaveChunksRequest]:
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
