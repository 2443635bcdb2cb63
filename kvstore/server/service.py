"""The KVStore servicer: proto <-> domain, auth, and exceptions -> status codes in one place.

Store calls block (LMDB fsyncs), so they run in worker threads; the event loop only moves bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from kvstore import __version__, chunk, convert, transport
from kvstore.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from kvstore.layout import PRESETS
from kvstore.manifest import check_namespace
from kvstore.server.arenas import Arenas
from kvstore.server.auth import Auth, Unauthenticated
from kvstore.server.handlers import Undecodable
from kvstore.store import SessionStore, store_stats
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger("kvstore.server")

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


async def _abort(context: grpc.aio.ServicerContext, method: str, e: Exception) -> None:
    code = _status_of(e)
    if code is None:
        log.exception("internal error in %s", method)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
    log.info("%s -> %s: %s", method, code.name, e)  # type: ignore[union-attr]
    await context.abort(code, str(e))  # type: ignore[arg-type]


def _parsed(request: Any) -> Any:
    if isinstance(request, Undecodable):
        raise InvalidArgument(request.reason)
    return request


@contextlib.contextmanager
def _client_bytes(what: str) -> Iterator[None]:
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
                async for item in fn(self, _parsed(request), context):
                    yield item
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception as e:
                await _abort(context, fn.__name__, e)
        return stream

    @functools.wraps(fn)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, _parsed(request), context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as e:
            await _abort(context, fn.__name__, e)
    return unary


class KVStoreService(pb_grpc.KVStoreServicer):
    def __init__(self, sessions: SessionStore, auth: Auth, shm_dir: Path | None,
                 max_message_bytes: int = transport.MAX_MESSAGE_BYTES) -> None:
        self.sessions = sessions
        self.auth = auth
        self.shm_dir = shm_dir
        self.max_message_bytes = max_message_bytes
        self.arenas = Arenas()
        self.data_bytes = min(transport.DEFAULT_MESSAGE_BYTES, max_message_bytes // 2)
        # a saved chunk holds exactly chunk_tokens tokens of a known layout: nothing larger is
        # buffered, whatever size a stream's header declares
        self.max_chunk_bytes = max(chunk.encoded_size(lay, sessions.config.chunk_tokens) for lay in PRESETS.values())

    # -- helpers ----------------------------------------------------------------------------------
    def _ns(self, context: grpc.aio.ServicerContext, namespace: str) -> str:
        check_namespace(namespace)
        self.auth.check(context.invocation_metadata(), namespace)
        return namespace

    def _arena(self, context: grpc.aio.ServicerContext, arena_id: str) -> transport.Arena:
        """The caller's own arena: another token's arena id is as unknown as a made-up one."""
        return self.arenas.get(self.auth.identity(context.invocation_metadata()), arena_id)

    def _load(self, namespace: str, keys: list[bytes], arena: transport.Arena | None
              ) -> tuple[list[tuple[int, transport.Blob]], pb.ShmHandle | None]:
        """Verified chunks (request index, blob), read once. With an arena, each is also copied into it
        right after its checksum pass (while still in cache); the handle is None if they do not fit."""
        loaded: list[tuple[int, transport.Blob]] = []
        h: pb.ShmHandle | None = pb.ShmHandle() if arena is not None else None
        off = 0
        for i, (_, blob) in enumerate(self.sessions.load(namespace, keys)):
            if blob is None:
                continue
            loaded.append((i, blob))
            if h is not None and arena is not None:
                n = len(blob)
                if off + n > arena.size:
                    h = None  # too big for the arena: the caller falls back to a transfer file
                    continue
                arena.view[off : off + n] = blob
                h.indices.append(i)
                h.offsets.append(off)
                h.sizes.append(n)
                off += n
        if h is not None:
            h.size = off
        return loaded, h

    async def _chunks(self, namespace: str, keys: list[bytes], shared_memory: bool, arena: transport.Arena | None,
                      arena_id: str) -> AsyncIterator[pb.ChunkData]:
        """Read chunks in worker threads and stream them (or hand them over in shared memory)."""
        loaded, handle = await asyncio.to_thread(self._load, namespace, keys, arena)
        if handle is not None:
            handle.arena_id = arena_id
            yield pb.ChunkData(shm=handle)
            return
        if arena is not None:
            shared_memory = True  # too big for the arena: one transfer file instead
        if shared_memory and self.shm_dir is not None:
            blobs = [b for _, b in loaded]
            path, offsets, sizes = await asyncio.to_thread(transport.write_shm, self.shm_dir, blobs, "srv")
            yield pb.ChunkData(shm=pb.ShmHandle(path=path, size=sum(sizes), indices=[i for i, _ in loaded],
                                                offsets=offsets, sizes=sizes))
            return
        index = [i for i, _ in loaded]
        for data, starts in transport.pack((b for _, b in loaded), self.data_bytes):
            yield pb.ChunkData(data=data, indices=[index[s] for s in starts])

    # -- RPCs -------------------------------------------------------------------------------------
    @rpc
    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: Any) -> pb.ServerInfo:
        cfg = self.sessions.config
        return pb.ServerInfo(version=__version__, chunk_tokens=cfg.chunk_tokens, layouts=sorted(PRESETS),
                             tiers=[t.name for t in self.sessions.store.tiers], host_id=transport.host_id(),
                             shm_dir=str(self.shm_dir or ""), max_message_bytes=self.max_message_bytes,
                             write_mode=cfg.write_mode)

    async def SaveChunks(self, request_iterator: AsyncIterator[pb.SaveChunksRequest],
                         context: grpc.aio.ServicerContext) -> pb.SaveChunksResponse:
        try:
            return await self._save(request_iterator, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as e:
            await _abort(context, "SaveChunks", e)
            raise  # unreachable: abort raises

    async def _save(self, requests: AsyncIterator[pb.SaveChunksRequest],
                    context: grpc.aio.ServicerContext) -> pb.SaveChunksResponse:
        header: pb.SaveHeader | None = None
        assembler = transport.BlobAssembler(self.max_chunk_bytes)
        blobs: list[transport.Blob] = []
        async for req in requests:
            req = _parsed(req)
            if header is None:
                if not req.HasField("header"):
                    raise InvalidArgument("the first SaveChunks message must carry the header")
                header = req.header
                self._ns(context, header.namespace)
                if len(header.parent_key) not in (0, 16):
                    raise InvalidArgument(f"parent_key must be 16 bytes (or empty for chunk 0), "
                                          f"got {len(header.parent_key)}")
                if header.shm_path:  # the daemon never opens a file a request names (it may be another's)
                    raise InvalidArgument("SaveHeader.shm_path is not accepted: save through an attached arena "
                                          "(arena_id) or the stream")
                if header.arena_id:
                    arena = self._arena(context, header.arena_id)
                    if header.arena_bytes > arena.size:
                        raise InvalidArgument(f"arena_bytes {header.arena_bytes} exceeds the arena's {arena.size}")
                    # copy out first: the client can still write to its arena, and what was
                    # verified must be exactly what gets stored
                    data = await asyncio.to_thread(bytes, arena.view[: header.arena_bytes])
                    blobs.extend(assembler.feed(data))
            elif req.HasField("header"):
                raise InvalidArgument("only the first SaveChunks message may carry a header")
            if req.data:
                blobs.extend(assembler.feed(req.data))
        if header is None:
            raise InvalidArgument("empty SaveChunks stream: no header")
        assembler.finish()
        with _client_bytes("chunk bytes"):
            res = await asyncio.to_thread(self.sessions.save_chunks, header.namespace, bytes(header.layout_id),
                                          bytes(header.parent_key) or bytes(16), header.first_index, blobs)
        return pb.SaveChunksResponse(keys=res.keys, written=res.written)

    @rpc
    async def LoadChunks(self, request: pb.LoadChunksRequest, context: Any) -> AsyncIterator[pb.ChunkData]:
        self._ns(context, request.namespace)
        if any(len(k) != 16 for k in request.keys):
            raise InvalidArgument("chunk keys must be 16 bytes")
        arena = self._arena(context, request.arena_id) if request.arena_id else None
        async for msg in self._chunks(request.namespace, [bytes(k) for k in request.keys], request.shared_memory, arena,
                                      request.arena_id):
            yield msg

    @rpc
    async def LoadSession(self, request: pb.LoadSessionRequest, context: Any) -> AsyncIterator[pb.LoadSessionResponse]:
        self._ns(context, request.namespace)
        arena = self._arena(context, request.arena_id) if request.arena_id else None  # before any answer
        m = self.sessions.get(request.namespace, request.session_id)
        yield pb.LoadSessionResponse(session=convert.session_to_pb(m))
        keys = list(m.chunk_keys)
        async for msg in self._chunks(request.namespace, keys, request.shared_memory, arena, request.arena_id):
            yield pb.LoadSessionResponse(chunks=msg)

    @rpc
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        self._ns(context, request.namespace)
        r = await asyncio.to_thread(self.sessions.lookup, request.namespace, bytes(request.layout_id),
                                    list(request.token_ids))
        return pb.LookupResponse(cached_tokens=r.cached_tokens, requested_tokens=r.requested_tokens,
                                 chunks=r.chunks, tiers=[pb.TierCount(tier=t, chunks=n) for t, n in r.tiers.items()])

    @rpc
    async def CommitSession(self, request: pb.CommitSessionRequest, context: Any) -> pb.CommitSessionResponse:
        self._ns(context, request.session.namespace)
        try:
            m = convert.session_from_pb(request.session, time.time())
        except ValueError as e:
            raise InvalidArgument(str(e)) from e
        with _client_bytes("the trailing span's bytes"):
            m = await asyncio.to_thread(self.sessions.commit, m)
        return pb.CommitSessionResponse(session=convert.session_to_pb(m))

    @rpc
    async def GetSession(self, request: pb.GetSessionRequest, context: Any) -> pb.GetSessionResponse:
        self._ns(context, request.namespace)
        m = self.sessions.get(request.namespace, request.session_id)
        def count() -> dict[str, int]:  # one worker-thread hop for the whole session
            tiers: dict[str, int] = {}
            for k in m.chunk_keys:
                where = self.sessions.store.where(k)
                name = where[0] if where else "missing"
                tiers[name] = tiers.get(name, 0) + 1
            return tiers

        tiers = await asyncio.to_thread(count)
        return pb.GetSessionResponse(session=convert.session_to_pb(m),
                                     tiers=[pb.TierCount(tier=t, chunks=n) for t, n in tiers.items()])

    @rpc
    async def ListSessions(self, request: pb.ListSessionsRequest, context: Any) -> pb.ListSessionsResponse:
        if request.namespace:
            self._ns(context, request.namespace)
            ms = self.sessions.list(request.namespace)
        else:
            allowed = self.auth.namespaces(context.invocation_metadata())
            ms = [m for m in self.sessions.list() if allowed is None or m.namespace in allowed]
        return pb.ListSessionsResponse(sessions=[convert.summary_to_pb(m) for m in ms])

    @rpc
    async def DeleteSession(self, request: pb.DeleteSessionRequest, context: Any) -> pb.DeleteSessionResponse:
        self._ns(context, request.namespace)
        freed = await asyncio.to_thread(self.sessions.delete, request.namespace, request.session_id)
        return pb.DeleteSessionResponse(freed_chunks=freed)

    @rpc
    async def TouchSession(self, request: pb.TouchSessionRequest, context: Any) -> pb.TouchSessionResponse:
        self._ns(context, request.namespace)
        if request.retention.ttl_s < 0:
            raise InvalidArgument(f"ttl_s must be >= 0 (0 = never), got {request.retention.ttl_s}")
        m = await asyncio.to_thread(self.sessions.touch, request.namespace, request.session_id,
                                    convert.retention_from_pb(request.retention))
        return pb.TouchSessionResponse(session=convert.session_to_pb(m))

    @rpc
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        self.auth.check_admin(context.invocation_metadata())
        return convert.stats_to_pb(await asyncio.to_thread(store_stats, self.sessions))

    @rpc
    async def AttachArena(self, request: pb.AttachArenaRequest, context: Any) -> pb.AttachArenaResponse:
        owner = self.auth.identity(context.invocation_metadata())  # any known token: strangers get no mappings
        if self.shm_dir is None:
            raise InvalidArgument("shared memory is disabled on this daemon")
        arena = await asyncio.to_thread(transport.Arena.attach, request.path, self.shm_dir, request.size,
                                        bytes(request.nonce))
        return pb.AttachArenaResponse(arena_id=self.arenas.add(owner, arena))

    @rpc
    async def EvictSession(self, request: pb.EvictSessionRequest, context: Any) -> pb.EvictSessionResponse:
        self.auth.check_admin(context.invocation_metadata())
        moved = await asyncio.to_thread(self.sessions.evict, request.namespace, request.session_id, request.tier)
        return pb.EvictSessionResponse(moved_chunks=moved)
