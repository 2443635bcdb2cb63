"""The KVStore servicer: proto <-> domain, auth, and exceptions -> status codes (status.py).

Store calls block (LMDB fsyncs), so they run in worker threads (on a local-socket connection's own
thread, inline: offload.py); the event loop only moves bytes.
Chunk data travels through the caller's carrier (carriers.py): its arena, or the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc

from kvstore import __version__
from kvstore.errors import InvalidArgument
from kvstore.format import chunk, page
from kvstore.format.layout import PRESETS
from kvstore.format.manifest import Manifest, check_namespace
from kvstore.results import SaveResult
from kvstore.server.auth import Auth
from kvstore.server.carriers import Carriers
from kvstore.server.device_arenas import DeviceArenas
from kvstore.server.offload import inline, offload
from kvstore.server.stats_pb import prefetch_to_pb, stats_to_pb
from kvstore.server.status import client_bytes, parsed, rpc
from kvstore.store import SessionStore, store_stats
from kvstore.store.prefetch import Prefetcher
from kvstore.transport import convert, fastpb, framing, shm
from kvstore.transport.carrier import Carrier, Piece, Receiver
from kvstore.transport.framing import Blob
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

MESSAGES_PER_HOP = 4  # stream messages built per worker-thread hop while a load streams
# A load this small whose chunks all sit in the fastest tier (memory) is read, verified and framed on
# the event loop: that costs ~0.15 ms per MiB (benchmarks/profile_load.py), a worker-thread hop
# 0.1-0.45 ms (more under load). Anything else (LMDB reads, big loads) runs in worker threads.
INLINE_LOAD_BYTES = 4 << 20
MAX_LOOKUP_KEYS = 1 << 16
#: The largest engine page blob a save buffers (a vLLM chunk of a few blocks of every layer of a group).
MAX_PAGE_BLOB_BYTES = 64 << 20


class KVStoreService(pb_grpc.KVStoreServicer):
    def __init__(self, sessions: SessionStore, auth: Auth, shm_dir: Path | None,
                 max_message_bytes: int = framing.MAX_MESSAGE_BYTES) -> None:
        self.sessions = sessions
        self.auth = auth
        self.max_message_bytes = max_message_bytes
        self._info: pb.ServerInfo | None = None
        self.local_socket = ""  # set by the daemon when it serves a local socket (server/local.py)
        self.carriers = Carriers(shm_dir, min(framing.DEFAULT_MESSAGE_BYTES, max_message_bytes // 2))
        # a saved chunk holds exactly chunk_tokens tokens of a known layout: nothing larger is
        # buffered, whatever size a stream's header declares
        self.max_chunk_bytes = max(chunk.encoded_size(lay, sessions.config.chunk_tokens) for lay in PRESETS.values())
        #: resume-ahead prefetch (PrefetchSession): its worker is started and stopped by the daemon
        self.prefetcher = Prefetcher(sessions)

    # -- helpers ----------------------------------------------------------------------------------
    def _ns(self, context: grpc.aio.ServicerContext, namespace: str) -> str:
        check_namespace(namespace)
        self.auth.check(context.invocation_metadata(), namespace)
        return namespace

    def _carrier(self, context: grpc.aio.ServicerContext, arena_id: str) -> Carrier:
        """The caller's carrier: its own arena, or the stream."""
        return self.carriers.for_call(self.auth.identity(context.invocation_metadata()) if arena_id else "", arena_id)

    async def _send(self, carrier: Carrier, namespace: str, keys: list[bytes]
                    ) -> AsyncIterator[Piece]:
        """Stream the verified chunks as they are read, a few messages per worker-thread hop (the
        arena part is written in the hop that reads it, while the chunk is still in cache)."""
        hits = ((i, b) for i, (_, b) in enumerate(self.sessions.load(namespace, keys)) if b is not None)
        pieces = carrier.send(hits)
        if self._in_memory(keys):  # read as it is sent: no hops
            for p in pieces:
                yield p
            self.carriers.count(carrier)
            return
        if inline():  # a local-socket thread: reads that may block, a few messages at a time, its turn given up
            more = True
            while more:
                batch, more = await offload(_take, pieces, MESSAGES_PER_HOP)
                for p in batch:
                    yield p
            self.carriers.count(carrier)
            return
        # the next hop reads while this one's messages are sent (gRPC's core sends without the GIL):
        # one hop ahead, never more, so one thread at a time advances ``pieces``
        ahead = asyncio.ensure_future(asyncio.to_thread(_take, pieces, MESSAGES_PER_HOP))
        try:
            more = True
            while more:
                batch, more = await ahead
                if more:
                    ahead = asyncio.ensure_future(asyncio.to_thread(_take, pieces, MESSAGES_PER_HOP))
                for p in batch:
                    yield p
        finally:
            with contextlib.suppress(ValueError):  # a cancelled call's hop may still be running
                pieces.close()
        self.carriers.count(carrier)

    async def _manifest(self, namespace: str, session_id: str) -> Manifest:
        """A session's manifest: read on the event loop (a dict lookup), or in a worker thread when a
        shared tier makes the read a network round trip that must not stall the loop."""
        if self.sessions.reads_remote:
            return await offload(self.sessions.get, namespace, session_id)
        return self.sessions.get(namespace, session_id)

    def _in_memory(self, keys: list[bytes]) -> bool:
        """Whether a load is small and held whole by the fastest tier, a memory tier (a lookup, no
        read: a chunk demoted meanwhile is still read correctly, just once from a slower tier here)."""
        return (len(keys) * chunk.HEADER_BYTES <= INLINE_LOAD_BYTES
                and self.sessions.store.held_in_memory(keys, INLINE_LOAD_BYTES))

    def _store_turn(self, header: pb.SaveHeader, receiver: Receiver, streamed: list[Blob],
                    commit: Manifest | None) -> tuple[SaveResult, Manifest | None]:
        """In one worker-thread hop: the arena part of the chunks copied out (it comes first), then
        the chunks stored and, for a turn, its manifest committed in the same durable transaction."""
        blobs = [*receiver.arena_prefix(header.arena_bytes), *streamed] if header.arena_id else streamed
        args = (header.namespace, bytes(header.layout_id), bytes(header.parent_key) or bytes(16), header.first_index,
                blobs)
        if commit is None:
            return self.sessions.save_chunks(*args), None
        committed, res = self.sessions.save_session(*args, commit)
        return res, committed

    # -- RPCs -------------------------------------------------------------------------------------
    @rpc
    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: Any) -> pb.ServerInfo:
        if self._info is None:  # fixed for the daemon's life: built once (every client asks at connect)
            cfg = self.sessions.config
            self._info = pb.ServerInfo(
                version=__version__, chunk_tokens=cfg.chunk_tokens, layouts=sorted(PRESETS),
                tiers=self.sessions.store.tier_names(), host_id=shm.host_id(),
                shm_dir=str(self.carriers.shm_dir or ""), max_message_bytes=self.max_message_bytes,
                write_mode=cfg.write_mode, carriers=self.carriers.offered,
                layout_info=[convert.layout_to_pb(PRESETS[n], cfg.chunk_tokens) for n in sorted(PRESETS)],
                local_socket=self.local_socket)
        return self._info

    @rpc
    async def SaveChunks(self, requests: AsyncIterator[pb.SaveChunksRequest],
                         context: grpc.aio.ServicerContext) -> pb.SaveChunksResponse:
        header: pb.SaveHeader | None = None
        carrier: Carrier | None = None
        receiver: Receiver | None = None
        blobs: list[Blob] = []
        streamed = False
        async for req in requests:
            req = parsed(req)
            if header is None:
                if not req.HasField("header"):
                    raise InvalidArgument("the first SaveChunks message must carry the header")
                header = req.header
                self._check_header(context, header)
                carrier = self._carrier(context, header.arena_id)
                receiver = Receiver(carrier if header.arena_id else None, copy=True,  # type: ignore[arg-type]
                                              max_blob=self._max_blob(bytes(header.layout_id)))
            elif req.HasField("header"):
                raise InvalidArgument("only the first SaveChunks message may carry a header")
            if req.data:
                assert receiver is not None
                streamed = True
                blobs.extend(receiver.blobs(req.data))
        if header is None or receiver is None or carrier is None:
            raise InvalidArgument("empty SaveChunks stream: no header")
        receiver.finish()
        commit = self._turn_manifest(header) if header.HasField("commit") else None
        with client_bytes("chunk bytes"):
            res, committed = await offload(self._store_turn, header, receiver, blobs, commit)
        self.carriers.count(carrier, streamed)
        return pb.SaveChunksResponse(keys=res.keys, written=res.written,
                                     session=convert.session_to_pb(committed) if committed else None)

    def _max_blob(self, layout_id: bytes) -> int:
        """The largest blob a save under ``layout_id`` may hold: a chunk of chunk_tokens tokens, or
        the largest page blob of a registered engine page layout (nothing larger is buffered,
        whatever a stream declares)."""
        lay = self.sessions.layouts.page(layout_id)
        if lay is None:
            return self.max_chunk_bytes
        return min(MAX_PAGE_BLOB_BYTES, max(page.blob_bytes(g, page.MAX_HASH_BYTES) for g in lay.groups))

    def _check_header(self, context: grpc.aio.ServicerContext, header: pb.SaveHeader) -> None:
        self._ns(context, header.namespace)
        if len(header.parent_key) not in (0, 16):
            raise InvalidArgument(f"parent_key must be 16 bytes (or empty for chunk 0), got {len(header.parent_key)}")
        if header.HasField("commit"):  # the commit is authorized by the header's namespace: they must agree
            c = header.commit
            if c.namespace != header.namespace or bytes(c.layout_id) != bytes(header.layout_id):
                raise InvalidArgument("SaveHeader.commit must name the header's namespace and layout")

    @staticmethod
    def _turn_manifest(header: pb.SaveHeader) -> Manifest:
        try:
            return convert.session_from_pb(header.commit, time.time())
        except ValueError as e:
            raise InvalidArgument(str(e)) from e

    @rpc
    async def LoadChunks(self, request: pb.LoadChunksRequest, context: Any) -> AsyncIterator[pb.ChunkData]:
        self._ns(context, request.namespace)
        if any(len(k) != 16 for k in request.keys):
            raise InvalidArgument("chunk keys must be 16 bytes")
        carrier = self._carrier(context, request.arena_id)
        async for piece in self._send(carrier, request.namespace, [bytes(k) for k in request.keys]):
            yield piece.message() if piece.handle is not None else fastpb.Encoded(b"".join(piece.encoded()))

    @rpc
    async def LoadSession(self, request: pb.LoadSessionRequest, context: Any) -> AsyncIterator[pb.LoadSessionResponse]:
        self._ns(context, request.namespace)
        carrier = self._carrier(context, request.arena_id)  # before any answer
        m = await self._manifest(request.namespace, request.session_id)
        session: pb.Session | None = convert.session_to_pb(m)  # in the first message, with the first chunks
        async for piece in self._send(carrier, request.namespace, list(m.chunk_keys)):
            if piece.handle is not None:
                r = pb.LoadSessionResponse(session=session) if session is not None else pb.LoadSessionResponse()
                piece.into(r.chunks)
                yield r
            else:
                yield fastpb.load_session_message(session.SerializeToString() if session is not None else None,
                                                  piece.encoded())
            session = None
        if session is not None:
            yield pb.LoadSessionResponse(session=session)

    @rpc
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        self._ns(context, request.namespace)
        r = await offload(self.sessions.lookup, request.namespace, bytes(request.layout_id),
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
        with client_bytes("the trailing span's bytes"):
            m = await offload(self.sessions.commit, m)
        return pb.CommitSessionResponse(session=convert.session_to_pb(m))

    @rpc
    async def GetSession(self, request: pb.GetSessionRequest, context: Any) -> pb.GetSessionResponse:
        self._ns(context, request.namespace)
        m = await self._manifest(request.namespace, request.session_id)

        def count() -> dict[str, int]:  # one worker-thread hop for the whole session
            tiers: dict[str, int] = {}
            for k in m.chunk_keys:
                where = self.sessions.store.where(k)
                name = where[0] if where else "missing"
                tiers[name] = tiers.get(name, 0) + 1
            return tiers

        tiers = await offload(count)
        return pb.GetSessionResponse(session=convert.session_to_pb(m),
                                     tiers=[pb.TierCount(tier=t, chunks=n) for t, n in tiers.items()])

    @rpc
    async def ListSessions(self, request: pb.ListSessionsRequest, context: Any) -> pb.ListSessionsResponse:
        if request.namespace:
            self._ns(context, request.namespace)
            ms = self.sessions.list_sessions(request.namespace)
        else:
            allowed = self.auth.namespaces(context.invocation_metadata())
            ms = [m for m in self.sessions.list_sessions() if allowed is None or m.namespace in allowed]
        out = pb.ListSessionsResponse(sessions=[convert.summary_to_pb(m) for m in ms])
        for summary, m in zip(out.sessions, ms):  # an engine's page layout is named by its model
            if not summary.layout_name and (lay := self.sessions.layouts.page(m.layout_id)) is not None:
                summary.layout_name = f"{lay.engine}:{lay.name}"
        return out

    @rpc
    async def DeleteSession(self, request: pb.DeleteSessionRequest, context: Any) -> pb.DeleteSessionResponse:
        self._ns(context, request.namespace)
        freed = await offload(self.sessions.delete, request.namespace, request.session_id)
        return pb.DeleteSessionResponse(freed_chunks=freed)

    @rpc
    async def TouchSession(self, request: pb.TouchSessionRequest, context: Any) -> pb.TouchSessionResponse:
        self._ns(context, request.namespace)
        if request.retention.ttl_s < 0:
            raise InvalidArgument(f"ttl_s must be >= 0 (0 = never), got {request.retention.ttl_s}")
        m = await offload(self.sessions.touch, request.namespace, request.session_id,
                          convert.retention_from_pb(request.retention))
        return pb.TouchSessionResponse(session=convert.session_to_pb(m))

    @rpc
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        self.auth.check_admin(context.invocation_metadata())
        r = stats_to_pb(await offload(store_stats, self.sessions))
        r.transport.CopyFrom(self.carriers.stats())
        r.prefetch.CopyFrom(prefetch_to_pb(self.prefetcher.counters()))
        return r

    @rpc
    async def AttachArena(self, request: pb.AttachArenaRequest, context: Any) -> pb.AttachArenaResponse:
        owner = self.auth.identity(context.invocation_metadata())  # any known token: strangers get no mappings
        return pb.AttachArenaResponse(arena_id=await self.carriers.attach(owner, request, context))

    @rpc
    async def DetachArena(self, request: pb.DetachArenaRequest, context: Any) -> pb.DetachArenaResponse:
        self.carriers.detach(self.auth.identity(context.invocation_metadata()), request.arena_id)
        return pb.DetachArenaResponse()

    @rpc
    async def EvictSession(self, request: pb.EvictSessionRequest, context: Any) -> pb.EvictSessionResponse:
        self.auth.check_admin(context.invocation_metadata())
        moved = await offload(self.sessions.evict, request.namespace, request.session_id, request.tier)
        return pb.EvictSessionResponse(moved_chunks=moved)

    @rpc
    async def PrefetchSession(self, request: pb.PrefetchSessionRequest, context: Any) -> pb.PrefetchSessionResponse:
        self._ns(context, request.namespace)  # then the session in that namespace, as a load finds it
        a = await offload(self.prefetcher.request, request.namespace, request.session_id)
        return pb.PrefetchSessionResponse(queued=a.queued, already_fast=a.already_fast, coalesced=a.coalesced,
                                          dropped=a.dropped, tier=self.prefetcher.fast_tier)

    @rpc
    async def RegisterLayout(self, request: pb.RegisterLayoutRequest, context: Any) -> pb.RegisterLayoutResponse:
        self.auth.identity(context.invocation_metadata())  # any known token
        lay = await offload(self.sessions.layouts.register, bytes(request.definition))
        return pb.RegisterLayoutResponse(layout_id=lay.layout_id, name=lay.name,
                                         bytes_per_token=float(lay.bytes_per_token))

    @rpc
    async def LookupKeys(self, request: pb.LookupKeysRequest, context: Any) -> pb.LookupKeysResponse:
        self._ns(context, request.namespace)
        if len(request.keys) > MAX_LOOKUP_KEYS or any(len(k) != 16 for k in request.keys):
            raise InvalidArgument(f"LookupKeys takes at most {MAX_LOOKUP_KEYS} keys of 16 bytes each")
        where = await offload(self.sessions.lookup_keys, request.namespace, [bytes(k) for k in request.keys])
        return pb.LookupKeysResponse(tiers=[t or "" for t in where])

    # -- same GPU: loads copied device to device into a client's own CUDA IPC buffer (device_arenas.py)
    @functools.cached_property
    def device_arenas(self) -> DeviceArenas:
        return DeviceArenas(self.sessions)

    @rpc
    async def AttachDeviceBuffer(self, request: pb.AttachDeviceBufferRequest, context: Any
                                 ) -> pb.AttachDeviceBufferResponse:
        owner = self.auth.identity(context.invocation_metadata())  # any known token, as AttachArena
        buffer_id = await offload(self.device_arenas.attach, owner, request)
        return pb.AttachDeviceBufferResponse(buffer_id=buffer_id)

    @rpc
    async def LoadSessionToDevice(self, request: pb.LoadSessionToDeviceRequest, context: Any
                                  ) -> pb.LoadSessionToDeviceResponse:
        self._ns(context, request.namespace)
        owner = self.auth.identity(context.invocation_metadata())
        return await offload(self.device_arenas.load, owner, request.namespace, request.session_id,
                             request.buffer_id)

    @rpc
    async def DetachDeviceBuffer(self, request: pb.DetachArenaRequest, context: Any) -> pb.DetachArenaResponse:
        self.device_arenas.detach(self.auth.identity(context.invocation_metadata()), request.arena_id)
        return pb.DetachArenaResponse()


def _take(pieces: Iterator[Piece], n: int) -> tuple[list[Piece], bool]:
    """Up to ``n`` pieces, and whether there may be more (no extra hop just to learn the end)."""
    out: list[Piece] = []
    for m in pieces:
        out.append(m)
        if len(out) == n:
            return out, True
    return out, False
