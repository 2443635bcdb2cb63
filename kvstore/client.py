"""Python client for the kvstore daemon: ``Client`` (blocking); ``kvstore.aio_client.AsyncClient``
is the asyncio twin.

Both speak the same wire protocol through the helpers in this module: requests are built and
answers parsed in one place. Unary calls retry with exponential backoff on UNAVAILABLE and carry
a deadline. Chunk streams are produced and consumed lazily, so a session is never held in memory
twice. When the daemon runs on the same host (same boot id, its shm directory reachable), chunk
data moves through shared memory and gRPC carries only control; otherwise the stream is used.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from kvstore import convert, transport
from kvstore.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvstoreError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from kvstore.manifest import Manifest, Retention
from kvstore.results import LookupResult, SaveResult
from kvstore.server.config import DEFAULT_PORT
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

T = TypeVar("T")
DEFAULT_ADDRESS = f"127.0.0.1:{DEFAULT_PORT}"
ARENA_REATTACH_S = 240.0  # below the daemon's idle limit for arenas


class Unauthenticated(KvstoreError):
    pass


_ERRORS: dict[grpc.StatusCode, type[Exception]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
}


def _unknown_arena(e: grpc.RpcError) -> bool:
    """The daemon does not know the arena we named: it restarted, or unmapped it when idle."""
    return (e.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            and (e.details() or "").startswith(transport.UNKNOWN_ARENA))  # type: ignore[attr-defined]


def _domain_error(e: grpc.RpcError) -> Exception:
    code = e.code()  # type: ignore[attr-defined]
    cls = _ERRORS.get(code, KvstoreError)
    return cls(f"{e.details()}" if code != grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
               else f"daemon unavailable: {e.details()}")  # type: ignore[attr-defined]


def default_address() -> str:
    return os.environ.get("KVSTORE_ADDRESS", DEFAULT_ADDRESS)


@dataclass(frozen=True)
class ClientTls:
    ca_file: str = ""  # CA that signed the daemon's certificate
    cert_file: str = ""  # client certificate for mutual TLS
    key_file: str = ""
    server_name: str = ""  # override the name checked against the certificate

    def credentials(self) -> grpc.ChannelCredentials:
        def read(p: str) -> bytes | None:
            return Path(p).read_bytes() if p else None

        return grpc.ssl_channel_credentials(read(self.ca_file), read(self.key_file), read(self.cert_file))


@dataclass(frozen=True)
class ClientConfig:
    address: str = ""  # "" = $KVSTORE_ADDRESS or 127.0.0.1:50151
    token: str = ""  # bearer token
    tls: ClientTls | None = None
    timeout_s: float = 60.0  # deadline of each call
    retries: int = 4  # attempts after the first, on UNAVAILABLE
    backoff_s: float = 0.1  # first retry delay; doubles each time, with jitter
    shared_memory: bool = True  # use the same-host path when the daemon is local
    arena_bytes: int = 64 << 20  # same-host arena kept mapped by both sides (0 = a new file per call)


def _channel_options(cfg: ClientConfig) -> list[tuple[str, Any]]:
    opts: list[tuple[str, Any]] = [("grpc.max_receive_message_length", transport.MAX_MESSAGE_BYTES),
                                   ("grpc.max_send_message_length", transport.MAX_MESSAGE_BYTES)]
    if cfg.tls and cfg.tls.server_name:
        opts.append(("grpc.ssl_target_name_override", cfg.tls.server_name))
    return opts


def _save_requests(header: pb.SaveHeader, blobs: Iterable[transport.Blob], data_bytes: int
                   ) -> Iterator[pb.SaveChunksRequest]:
    yield pb.SaveChunksRequest(header=header)
    for data, _ in transport.pack(blobs, data_bytes):
        yield pb.SaveChunksRequest(data=data)


class _ChunkReader:
    """Turns ChunkData messages (stream or shm handle) into (request index, blob) pairs."""

    def __init__(self, shm_dir: Path | None, arena: transport.Arena | None = None) -> None:
        self.shm_dir = shm_dir
        self.arena = arena
        self.assembler = transport.BlobAssembler()
        self.pending: list[int] = []

    def feed(self, msg: pb.ChunkData) -> list[tuple[int, transport.Blob]]:
        if msg.HasField("shm"):
            h = msg.shm
            if h.arena_id:
                if self.arena is None:
                    raise InvalidArgument("daemon answered in an arena this client did not name")
                view = self.arena.view
                return [(i, view[o : o + n]) for i, o, n in zip(h.indices, h.offsets, h.sizes)]
            if self.shm_dir is None:
                raise InvalidArgument("daemon answered through shared memory, which this client did not ask for")
            view = transport.open_shm(h.path, self.shm_dir, h.size)
            return [(i, view[o : o + n]) for i, o, n in zip(h.indices, h.offsets, h.sizes)]
        self.pending.extend(msg.indices)
        blobs = self.assembler.feed(msg.data)
        out = list(zip(self.pending[: len(blobs)], blobs))
        del self.pending[: len(blobs)]
        return out


def _lookup_result(r: pb.LookupResponse) -> LookupResult:
    return LookupResult(r.cached_tokens, r.requested_tokens, r.chunks, {t.tier: t.chunks for t in r.tiers})


def _retention(r: Retention) -> pb.Retention:
    return convert.retention_to_pb(r)


class _Base:
    def __init__(self, config: ClientConfig | None = None, **kwargs: Any) -> None:
        cfg = config or ClientConfig()
        if kwargs:
            cfg = ClientConfig(**{**cfg.__dict__, **kwargs})
        self.config = cfg
        self.address = cfg.address or default_address()
        self._metadata = (("authorization", f"Bearer {cfg.token}"),) if cfg.token else ()
        self._info: pb.ServerInfo | None = None
        self._shm_dir: Path | None = None

    def _negotiate(self, info: pb.ServerInfo) -> None:
        self._info = info
        d = Path(info.shm_dir) if info.shm_dir else None
        local = info.host_id == transport.host_id() and d is not None and d.is_dir() and os.access(d, os.W_OK)
        self._shm_dir = d if (local and self.config.shared_memory) else None

    @property
    def uses_shared_memory(self) -> bool:
        return self._shm_dir is not None

    def _delay(self, attempt: int) -> float:
        return self.config.backoff_s * (2**attempt) * (0.5 + random.random())


class Client(_Base):
    """Blocking client. ``Client(address="127.0.0.1:50151", token=...)`` or ``Client(ClientConfig(...))``."""

    def __init__(self, config: ClientConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        opts = _channel_options(self.config)
        self._channel = (grpc.secure_channel(self.address, self.config.tls.credentials(), opts) if self.config.tls
                         else grpc.insecure_channel(self.address, opts))
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._arena: transport.Arena | None = None
        self._arena_id = ""
        self._arena_used = 0.0
        self._arena_refused = False  # the daemon would not map our arena (another user): stream instead

    def close(self) -> None:
        self._drop_arena()
        self._channel.close()

    def _drop_arena(self) -> None:
        if self._arena is not None:
            self._arena.close()
        self._arena, self._arena_id = None, ""

    def _ensure_arena(self) -> transport.Arena | None:
        """The same-host arena, attached on first use (None when the daemon is not local, or
        refused to map our file: then chunk data takes the stream)."""
        self.info()
        if self._arena is not None and time.monotonic() - self._arena_used > ARENA_REATTACH_S:
            self._drop_arena()  # the daemon unmaps arenas idle for 300 s: attach a fresh one
        if (self._arena is None and self._shm_dir is not None and self.config.arena_bytes > 0
                and not self._arena_refused):
            arena = transport.Arena.create(self._shm_dir, self.config.arena_bytes)
            try:
                r = self._call(self._stub.AttachArena,
                               pb.AttachArenaRequest(path=arena.path, size=arena.size, nonce=arena.nonce))
            except InvalidArgument:
                arena.close()
                self._arena_refused = True
                return None
            finally:
                os.unlink(arena.path)  # both sides have it mapped; no name left to leak
            self._arena, self._arena_id = arena, r.arena_id
        self._arena_used = time.monotonic()
        return self._arena

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: Callable[..., T], request: Any) -> T:
        for attempt in range(self.config.retries + 1):
            try:
                return fn(request, timeout=self.config.timeout_s, metadata=self._metadata)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == self.config.retries:  # type: ignore[attr-defined]
                    raise _domain_error(e) from None
                time.sleep(self._delay(attempt))
        raise AssertionError("unreachable")

    def info(self) -> pb.ServerInfo:
        if self._info is None:
            self._negotiate(self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest()))
        return self._info  # type: ignore[return-value]

    def health(self) -> str:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        r = self._call(stub.Check, health_pb2.HealthCheckRequest(service=""))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    # -- chunks -----------------------------------------------------------------------------------
    def save_chunks(self, namespace: str, layout_id: bytes, parent: bytes, first_index: int,
                    blobs: Iterable[transport.Blob]) -> SaveResult:
        """Same host: through the arena when the chunks fit in it, else the stream. An arena the
        daemon no longer knows (it restarted) is attached afresh, once, and the save retried."""
        info = self.info()
        data_bytes = min(transport.DEFAULT_MESSAGE_BYTES, info.max_message_bytes // 2)
        for attempt in range(2):
            header = pb.SaveHeader(namespace=namespace, layout_id=layout_id, parent_key=parent,
                                   first_index=first_index)
            arena = self._ensure_arena()
            stream: Iterable[transport.Blob] = blobs
            if arena is not None:
                blobs = list(blobs)  # kept: a retry or the stream may need them again
                placed = arena.write(blobs)
                if placed is not None:
                    header.arena_id, header.arena_bytes = self._arena_id, sum(placed[1])
                    stream = ()
            try:
                r = self._stub.SaveChunks(_save_requests(header, stream, data_bytes),
                                          timeout=self.config.timeout_s, metadata=self._metadata)
                return SaveResult(list(r.keys), r.written)
            except grpc.RpcError as e:
                if attempt == 0 and header.arena_id and _unknown_arena(e):
                    self._drop_arena()
                    continue
                raise _domain_error(e) from None
        raise AssertionError("unreachable")

    def load_chunks(self, namespace: str, keys: Sequence[bytes], zero_copy: bool = False
                    ) -> Iterator[tuple[int, transport.Blob]]:
        """(index into ``keys``, verified-by-daemon blob) for each hit, in order; misses are skipped.
        ``zero_copy`` (same host): blobs are views into this client's arena, valid only until its
        next load or save; copy what you keep."""
        for attempt in range(2):
            arena = self._ensure_arena() if zero_copy else None
            req = pb.LoadChunksRequest(namespace=namespace, keys=list(keys), shared_memory=self.uses_shared_memory,
                                       arena_id=self._arena_id if arena else "")
            reader = _ChunkReader(self._shm_dir, arena)
            answered = False
            try:
                for msg in self._stub.LoadChunks(req, timeout=self.config.timeout_s, metadata=self._metadata):
                    answered = True
                    yield from reader.feed(msg)
            except grpc.RpcError as e:
                if attempt == 0 and arena is not None and not answered and _unknown_arena(e):
                    self._drop_arena()  # the daemon restarted: attach afresh, once
                    continue
                raise _domain_error(e) from None
            reader.assembler.finish()
            return

    def load_session(self, namespace: str, session_id: str, zero_copy: bool = False
                     ) -> tuple[Manifest, Iterator[tuple[int, transport.Blob]]]:
        """The manifest, and an iterator of (chunk index, blob) for the chunks the store still has.
        ``zero_copy``: as in :meth:`load_chunks`."""
        for attempt in range(2):
            arena = self._ensure_arena() if zero_copy else None
            req = pb.LoadSessionRequest(namespace=namespace, session_id=session_id,
                                        shared_memory=self.uses_shared_memory, arena_id=self._arena_id if arena else "")
            stream = self._stub.LoadSession(req, timeout=self.config.timeout_s, metadata=self._metadata)
            try:
                first = next(stream)  # the daemon checks the arena before it answers the manifest
                break
            except grpc.RpcError as e:
                if attempt == 0 and arena is not None and _unknown_arena(e):
                    self._drop_arena()
                    continue
                raise _domain_error(e) from None
        manifest = convert.session_from_pb(first.session)
        reader = _ChunkReader(self._shm_dir, arena)

        def chunks() -> Iterator[tuple[int, transport.Blob]]:
            try:
                for msg in stream:
                    yield from reader.feed(msg.chunks)
            except grpc.RpcError as e:
                raise _domain_error(e) from None
            reader.assembler.finish()

        return manifest, chunks()

    # -- sessions ---------------------------------------------------------------------------------
    def lookup(self, namespace: str, layout_id: bytes, token_ids: Sequence[int]) -> LookupResult:
        r = self._call(self._stub.Lookup, pb.LookupRequest(namespace=namespace, layout_id=layout_id,
                                                           token_ids=list(map(int, token_ids))))
        return _lookup_result(r)

    def commit(self, manifest: Manifest) -> Manifest:
        r = self._call(self._stub.CommitSession, pb.CommitSessionRequest(session=convert.session_to_pb(manifest)))
        return convert.session_from_pb(r.session)

    def get_session(self, namespace: str, session_id: str) -> tuple[Manifest, dict[str, int]]:
        r = self._call(self._stub.GetSession, pb.GetSessionRequest(namespace=namespace, session_id=session_id))
        return convert.session_from_pb(r.session), {t.tier: t.chunks for t in r.tiers}

    def list_sessions(self, namespace: str = "") -> list[pb.SessionSummary]:
        return list(self._call(self._stub.ListSessions, pb.ListSessionsRequest(namespace=namespace)).sessions)

    def delete_session(self, namespace: str, session_id: str) -> int:
        req = pb.DeleteSessionRequest(namespace=namespace, session_id=session_id)
        return self._call(self._stub.DeleteSession, req).freed_chunks

    def touch_session(self, namespace: str, session_id: str, retention: Retention) -> Manifest:
        req = pb.TouchSessionRequest(namespace=namespace, session_id=session_id, retention=_retention(retention))
        return convert.session_from_pb(self._call(self._stub.TouchSession, req).session)

    def stats(self) -> pb.StatsResponse:
        return self._call(self._stub.Stats, pb.StatsRequest())

    def evict(self, namespace: str, session_id: str, tier: str) -> int:
        req = pb.EvictSessionRequest(namespace=namespace, session_id=session_id, tier=tier)
        return self._call(self._stub.EvictSession, req).moved_chunks
