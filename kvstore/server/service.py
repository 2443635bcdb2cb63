"""The KVStore servicer: proto <-> domain and auth, as plain synchronous bodies (handlers.py).

Each RPC is a method ``Name(request, call)``: a function for a unary RPC, a generator for a
server-streaming one, an iterable of requests for SaveChunks; proto messages in and out, a domain
exception (kvstore.errors) for a refusal, which status.py maps to a status code for both front
ends. A body blocks as long as its store calls do (LMDB fsyncs): the gRPC adapter
(grpc_adapter.py) runs it in worker threads, off the event loop; the local socket (local.py) calls
it on the connection's own thread. Chunk data travels through the caller's carrier (carriers.py):
its arena, or the stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from kvstore import __version__
from kvstore.errors import InvalidArgument, KvstoreError, ResourceExhausted, Retry
from kvstore.format import chunk, page
from kvstore.format.layout import PRESETS
from kvstore.format.manifest import Manifest, check_namespace
from kvstore.format.page_layout import MAX_BLOCK_BYTES
from kvstore.format.turn_record import Append
from kvstore.results import SaveResult
from kvstore.server.auth import Auth
from kvstore.server.carriers import Carriers
from kvstore.server.device_arenas import DeviceArenas
from kvstore.server.handlers import Call, first_checked_by, quick_when
from kvstore.server.stats_pb import prefetch_to_pb, stats_to_pb, usage_to_pb
from kvstore.server.status import client_bytes
from kvstore.store import SessionStore, store_stats
from kvstore.store.sessions.layouts import GLOBAL
from kvstore.store.sessions.prefetch import Prefetcher
from kvstore.transport import convert, fastpb, framing, shm, slots
from kvstore.transport.carrier import (
    ARENA_TOO_SMALL,
    ArenaCarrier,
    Carrier,
    Piece,
    Receiver,
    StreamCarrier,
    caller_memory_errors,
)
from kvstore.transport.framing import Blob
from kvstore.transport.sender import Sender
from kvstore.v1 import kvstore_pb2 as pb

# A load this small whose chunks all sit in the fastest tier (memory) is quick (handlers.quick_when):
# read, verified and framed on gRPC's event loop it costs ~0.15 ms per MiB (benchmarks/profile_load.py),
# a worker-thread hop 0.1-0.45 ms (more under load).
QUICK_LOAD_BYTES = 4 << 20
#: The largest engine page blob a save buffers (a vLLM chunk of a few blocks of every layer of a group):
#: one of the largest block a page layout may have (``MAX_BLOCK_BYTES``), so a registered layout's blobs fit.
MAX_PAGE_BLOB_BYTES = page.header_bytes(page.MAX_HASH_BYTES) + MAX_BLOCK_BYTES + page.CHECKSUM_BYTES
_M = TypeVar("_M")


def _caller_pages(header: pb.SaveHeader) -> list[pb.CallerPages]:
    """The regions of the caller's memory a save reads engine pages from, in order (none: no CallerPages)."""
    return [header.from_caller, *header.more_from_caller] if header.HasField("from_caller") else []


class KVStoreService:
    """Every KVStore RPC's body (handlers.methods serves them); nothing here knows the transport."""

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
        #: same GPU: loads copied device to device into a client's own CUDA IPC buffer (imports torch lazily)
        self.device_arenas = DeviceArenas(sessions)

    # -- helpers ----------------------------------------------------------------------------------
    def _ns(self, call: Call, namespace: str) -> str:
        check_namespace(namespace)
        self.auth.check(call.metadata, namespace)
        return namespace

    def _carrier(self, call: Call, arena_id: str, into: pb.CallerMemory | None = None,
                 n_keys: int | None = None, more_into: Sequence[pb.CallerMemory] = ()) -> Carrier:
        """The caller's carrier: its own memory (``into``; slots of it, and of the further regions
        ``more_into``, for ``n_keys`` engine pages), its arena, or the stream."""
        owner = self.auth.identity(call.metadata) if arena_id else ""
        return self.carriers.for_call(owner, arena_id, into, call.sender, n_keys, more_into)

    def _send(self, carrier: Carrier, namespace: str, keys: list[bytes], encode: Callable[[Piece], _M]
              ) -> Iterator[_M]:
        """The verified chunks as messages (``encode`` makes one of a piece), read as batches (each
        tier asked once, its answers verified in one pass: ``SessionStore.read``) and written or
        encoded while the tiers' bytes are in hand. Through an arena or into the caller's memory: one
        batch, answered in one message; an arena too small for the load is told so before a byte is
        written (the client grows it: ARENA_TOO_SMALL). On the stream: a batch per window of a few MB
        (``SessionStore.windows``), each window's read ended before its messages are yielded, so that
        no read is held open while a remote caller drains the stream; closed early, it unpins."""
        if isinstance(carrier, StreamCarrier):
            def window(start: int, blobs: list[Blob | None]) -> list[_M]:
                return [encode(p) for p in carrier.send((start + i, b) for i, b in enumerate(blobs) if b is not None)]

            yield from self.sessions.windows(namespace, keys, window)
        else:
            with self.sessions.read(namespace, keys) as blobs:
                items = [(i, b) for i, b in enumerate(blobs) if b is not None]
                if isinstance(carrier, ArenaCarrier) and (need := sum(len(b) for _, b in items)) > carrier.arena.size:
                    raise ResourceExhausted(f"{ARENA_TOO_SMALL}: it needs {need} bytes; the arena holds "
                                            f"{carrier.arena.size}", reason=Retry.ARENA_TOO_SMALL, needed_bytes=need)
                answer = [encode(p) for p in carrier.send(items)]
            yield from answer
        self.carriers.count(carrier)

    def _in_memory(self, namespace: str, keys: list[bytes]) -> bool:
        """Whether a load is small, of chunks ``namespace`` owns, held whole by the fastest tier, a
        memory tier (a lookup, no read: a chunk demoted meanwhile is still read correctly, just once
        from a slower tier). Ownership is asked first (``SessionStore.held_in_memory``): whether
        another namespace holds a key never decides a call's path, so never its latency."""
        return (len(keys) * chunk.HEADER_BYTES <= QUICK_LOAD_BYTES
                and self.sessions.held_in_memory(namespace, keys, QUICK_LOAD_BYTES))

    def _quick_keys(self, request: pb.LoadChunksRequest, call: Call) -> bool:
        """LoadChunks of a few chunks of the caller's namespace that the memory tier holds, by a
        caller the namespace admits."""
        try:
            self._ns(call, request.namespace)
        except KvstoreError:
            return False  # the body answers it
        return self._in_memory(request.namespace, [bytes(k) for k in request.keys])

    def _quick_session(self, request: pb.LoadSessionRequest, call: Call) -> bool:
        """LoadSession of a session whose manifest is a dict lookup away and whose chunks are few
        and in the memory tier, by a caller the namespace admits."""
        if self.sessions.reads_remote:  # reading the manifest may be a network round trip
            return False
        try:
            self._ns(call, request.namespace)
            m = self.sessions.get(request.namespace, request.session_id)
        except KvstoreError:
            return False  # the body answers it
        return self._in_memory(request.namespace, list(m.chunk_keys))

    def _store_turn(self, header: pb.SaveHeader, receiver: Receiver, streamed: list[Blob],
                    commit: Manifest | Append | None, sender: Sender | None) -> tuple[SaveResult, Manifest | None]:
        """The engine pages read from the caller's slots and the arena part of the chunks copied out
        (they come first), then the chunks stored and, for a turn, its manifest committed (or its
        append applied) in the same durable transaction."""
        buffer_for = self.sessions.store.buffer_for
        caller: list[Blob] = []
        regions = _caller_pages(header)
        if regions:  # read into buffers the host tier keeps as they are: one copy
            lay = self.sessions.layouts.usable(header.namespace, bytes(header.layout_id))
            assert lay is not None and sender is not None  # _check_header
            with sender.reaching() as pid:
                for pages in regions:
                    region = pages.region
                    with caller_memory_errors(region.address, region.size, "readable"):
                        caller.extend(slots.gather(pid, pages, lay, header.namespace, buffer_for))
        # the arena part copied into buffers the host tier keeps as they are (the save's one copy)
        prefix = receiver.arena_prefix(header.arena_bytes, buffer_for) if header.arena_id else []
        blobs = [*caller, *prefix, *streamed]
        args = (header.namespace, bytes(header.layout_id), bytes(header.parent_key) or bytes(16), header.first_index,
                blobs)
        # the pages read from the caller were sealed here, over the private copy: checked, not hashed again
        sealed = len(caller)
        if commit is None:
            return self.sessions.save_chunks(*args, sealed=sealed), None
        if isinstance(commit, Append):
            committed, res = self.sessions.append_session(*args, commit, sealed=sealed)
        else:
            committed, res = self.sessions.save_session(*args, commit, sealed=sealed)
        return res, committed

    def _max_blob(self, namespace: str, layout_id: bytes) -> int:
        """The largest blob a save under ``layout_id`` may hold: a chunk of chunk_tokens tokens, or
        the largest page blob of an engine page layout the namespace may use (nothing larger is
        buffered, whatever a stream declares; another namespace's layout is any unknown id's)."""
        lay = self.sessions.layouts.usable(namespace, layout_id)
        if lay is None:
            return self.max_chunk_bytes
        return min(MAX_PAGE_BLOB_BYTES, max(page.blob_bytes(g, page.MAX_HASH_BYTES) for g in lay.groups))

    def _check_header(self, call: Call, header: pb.SaveHeader) -> None:
        # the fields' shapes, and a commit naming the header's namespace and layout (it is authorized
        # by the header's): request_checks.py, before this body
        self._ns(call, header.namespace)
        if header.more_from_caller and not header.HasField("from_caller"):
            raise InvalidArgument("SaveHeader.more_from_caller needs from_caller: the first region is that one")
        regions = _caller_pages(header)
        if regions:
            if call.sender is None:
                raise InvalidArgument("CallerPages names memory of the calling process: only a call over the "
                                      "daemon's local socket can (the kernel names its process)")
            if self.sessions.layouts.usable(header.namespace, bytes(header.layout_id)) is None:
                raise InvalidArgument("CallerPages: the save's layout must be an engine page layout its namespace "
                                      "registered (RegisterLayout)")
        for i, pages in enumerate(regions):
            r = pages.region
            at = "from_caller" if i == 0 else f"more_from_caller[{i - 1}]"
            if not r.address or not r.size:
                raise InvalidArgument(f"SaveHeader.{at}: CallerPages.region needs an address and a size")
            try:
                slots.check(r.slot_offsets, r.slot_bytes, r.size, len(pages.groups))
            except InvalidArgument as e:
                raise InvalidArgument(f"SaveHeader.{at}: {e}") from None

    def _check_first(self, first: pb.SaveChunksRequest, call: Call) -> None:
        """A save's first message: its header, authorized, naming the caller's own arena (if any)."""
        if not first.HasField("header"):
            raise InvalidArgument("the first SaveChunks message must carry the header")
        self._check_header(call, first.header)
        self._carrier(call, first.header.arena_id)

    @staticmethod
    def _turn_manifest(header: pb.SaveHeader) -> Manifest:
        try:
            return convert.session_from_pb(header.commit, time.time())
        except ValueError as e:
            raise InvalidArgument(str(e)) from e

    # -- RPCs -------------------------------------------------------------------------------------
    def GetServerInfo(self, request: pb.GetServerInfoRequest, call: Call) -> pb.ServerInfo:
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

    @first_checked_by(_check_first)
    def SaveChunks(self, requests: Iterable[pb.SaveChunksRequest], call: Call) -> pb.SaveChunksResponse:
        header: pb.SaveHeader | None = None
        carrier: Carrier | None = None
        receiver: Receiver | None = None
        blobs: list[Blob] = []
        streamed = False
        for req in requests:
            if header is None:
                self._check_first(req, call)
                header = req.header
                carrier = self._carrier(call, header.arena_id)
                receiver = Receiver(carrier if header.arena_id else None, copy=True,  # type: ignore[arg-type]
                                    max_blob=self._max_blob(header.namespace, bytes(header.layout_id)))
            elif req.HasField("header"):
                raise InvalidArgument("only the first SaveChunks message may carry a header")
            if req.data:
                assert receiver is not None
                streamed = True
                blobs.extend(receiver.blobs(req.data))
        if header is None or receiver is None or carrier is None:
            raise InvalidArgument("empty SaveChunks stream: no header")
        receiver.finish()
        commit: Manifest | Append | None = None
        if header.HasField("commit"):
            commit = self._turn_manifest(header)
        elif header.HasField("append"):
            commit = convert.append_from_pb(header.append, header.namespace, bytes(header.layout_id))
        with client_bytes("chunk bytes"):
            res, committed = self._store_turn(header, receiver, blobs, commit, call.sender)
        if header.HasField("from_caller"):  # the pages came from the caller's memory: no stream, unless more did
            self.carriers.count_caller_memory()
        if not header.HasField("from_caller") or streamed or header.arena_id:
            self.carriers.count(carrier, streamed)
        r = pb.SaveChunksResponse(keys=res.keys, written=res.written)
        if committed is not None:  # an append is answered its version, not the manifest (O(the turn))
            if not isinstance(commit, Append):
                r.session.CopyFrom(convert.session_to_pb(committed))
            r.generation, r.chunk_count = committed.generation, len(committed.chunk_keys)
            r.created_at, r.updated_at = committed.created_at, committed.updated_at
        return r

    @quick_when(_quick_keys)
    def LoadChunks(self, request: pb.LoadChunksRequest, call: Call) -> Iterator[pb.ChunkData | fastpb.Encoded]:
        self._ns(call, request.namespace)  # the keys' count and lengths: request_checks.py, before this body
        carrier = self._carrier(call, request.arena_id, request.into if request.HasField("into") else None,
                                len(request.keys), request.more_into)
        yield from self._send(carrier, request.namespace, [bytes(k) for k in request.keys], _chunk_data)

    @quick_when(_quick_session)
    def LoadSession(self, request: pb.LoadSessionRequest, call: Call
                    ) -> Iterator[pb.LoadSessionResponse | fastpb.Encoded]:
        self._ns(call, request.namespace)
        carrier = self._carrier(call, request.arena_id, request.into if request.HasField("into") else None)
        m = self.sessions.get(request.namespace, request.session_id)
        first = _SessionMessages(convert.session_to_pb(m))  # the session in the first message, with the first chunks
        yield from self._send(carrier, request.namespace, list(m.chunk_keys), first.encode)
        if first.session is not None:
            yield pb.LoadSessionResponse(session=first.session)

    def Lookup(self, request: pb.LookupRequest, call: Call) -> pb.LookupResponse:
        self._ns(call, request.namespace)
        r = self.sessions.lookup(request.namespace, bytes(request.layout_id), list(request.token_ids))
        return pb.LookupResponse(cached_tokens=r.cached_tokens, requested_tokens=r.requested_tokens,
                                 chunks=r.chunks, tiers=[pb.TierCount(tier=t, chunks=n) for t, n in r.tiers.items()])

    def CommitSession(self, request: pb.CommitSessionRequest, call: Call) -> pb.CommitSessionResponse:
        self._ns(call, request.session.namespace)
        try:
            m = convert.session_from_pb(request.session, time.time())
        except ValueError as e:
            raise InvalidArgument(str(e)) from e
        with client_bytes("the trailing span's bytes"):
            m = self.sessions.commit(m)
        return pb.CommitSessionResponse(session=convert.session_to_pb(m))

    def GetSession(self, request: pb.GetSessionRequest, call: Call) -> pb.GetSessionResponse:
        self._ns(call, request.namespace)
        m = self.sessions.get(request.namespace, request.session_id)
        tiers: dict[str, int] = {}
        for k in m.chunk_keys:
            where = self.sessions.store.where(k)
            name = where[0] if where else "missing"
            tiers[name] = tiers.get(name, 0) + 1
        return pb.GetSessionResponse(session=convert.session_to_pb(m),
                                     tiers=[pb.TierCount(tier=t, chunks=n) for t, n in tiers.items()])

    def ListSessions(self, request: pb.ListSessionsRequest, call: Call) -> pb.ListSessionsResponse:
        if request.namespace:
            self._ns(call, request.namespace)
            ms = self.sessions.list_sessions(request.namespace)
        else:
            allowed = self.auth.namespaces(call.metadata)
            ms = [m for m in self.sessions.list_sessions() if allowed is None or m.namespace in allowed]
        out = pb.ListSessionsResponse(sessions=[convert.summary_to_pb(m) for m in ms])
        for summary, m in zip(out.sessions, ms):  # an engine's page layout is named by its model
            if not summary.layout_name and (lay := self.sessions.layouts.page(m.layout_id)) is not None:
                summary.layout_name = f"{lay.engine}:{lay.name}"
        return out

    def DeleteSession(self, request: pb.DeleteSessionRequest, call: Call) -> pb.DeleteSessionResponse:
        self._ns(call, request.namespace)
        return pb.DeleteSessionResponse(freed_chunks=self.sessions.delete(request.namespace, request.session_id))

    def TouchSession(self, request: pb.TouchSessionRequest, call: Call) -> pb.TouchSessionResponse:
        self._ns(call, request.namespace)
        m = self.sessions.touch(request.namespace, request.session_id, convert.retention_from_pb(request.retention))
        return pb.TouchSessionResponse(session=convert.session_to_pb(m))

    def Stats(self, request: pb.StatsRequest, call: Call) -> pb.StatsResponse:
        self.auth.check_admin(call.metadata)
        r = stats_to_pb(store_stats(self.sessions))
        r.transport.CopyFrom(self.carriers.stats())
        r.prefetch.CopyFrom(prefetch_to_pb(self.prefetcher.counters()))
        r.namespaces.extend(usage_to_pb(u) for u in self.sessions.admission.usage())
        return r

    def NamespaceStats(self, request: pb.NamespaceStatsRequest, call: Call) -> pb.NamespaceStatsResponse:
        """Usage and quota of the namespaces the token covers (an admin's: every one, or the one named)."""
        if request.namespace:
            self._ns(call, request.namespace)
            names: frozenset[str] | None = frozenset([request.namespace])
        else:
            names = self.auth.namespaces(call.metadata)
        return pb.NamespaceStatsResponse(namespaces=[usage_to_pb(u) for u in self.sessions.admission.usage(names)])

    def AttachArena(self, request: pb.AttachArenaRequest, call: Call) -> pb.AttachArenaResponse:
        owner = self.auth.identity(call.metadata)  # any known token: strangers get no mappings
        return pb.AttachArenaResponse(arena_id=self.carriers.attach(owner, request, call.take_fds()))

    def DetachArena(self, request: pb.DetachArenaRequest, call: Call) -> pb.DetachArenaResponse:
        self.carriers.detach(self.auth.identity(call.metadata), request.arena_id)
        return pb.DetachArenaResponse()

    def EvictSession(self, request: pb.EvictSessionRequest, call: Call) -> pb.EvictSessionResponse:
        self.auth.check_admin(call.metadata)
        moved = self.sessions.evict(request.namespace, request.session_id, request.tier)
        return pb.EvictSessionResponse(moved_chunks=moved)

    def PrefetchSession(self, request: pb.PrefetchSessionRequest, call: Call) -> pb.PrefetchSessionResponse:
        self._ns(call, request.namespace)  # then the session in that namespace, as a load finds it
        a = self.prefetcher.request(request.namespace, request.session_id)
        return pb.PrefetchSessionResponse(queued=a.queued, already_fast=a.already_fast, coalesced=a.coalesced,
                                          dropped=a.dropped, tier=self.prefetcher.fast_tier)

    def RegisterLayout(self, request: pb.RegisterLayoutRequest, call: Call) -> pb.RegisterLayoutResponse:
        if request.namespace:
            namespaces: tuple[str, ...] = (self._ns(call, request.namespace),)
        else:  # every namespace the token covers; an admin's (or anyone's without tokens) is global
            allowed = self.auth.namespaces(call.metadata)
            namespaces = (GLOBAL,) if allowed is None else tuple(sorted(allowed))
        lay = self.sessions.layouts.register(bytes(request.definition), namespaces)
        return pb.RegisterLayoutResponse(layout_id=lay.layout_id, name=lay.name,
                                         bytes_per_token=float(lay.bytes_per_token))

    def LookupKeys(self, request: pb.LookupKeysRequest, call: Call) -> pb.LookupKeysResponse:
        self._ns(call, request.namespace)  # the keys' count and lengths: request_checks.py, before this body
        where = self.sessions.lookup_keys(request.namespace, [bytes(k) for k in request.keys])
        return pb.LookupKeysResponse(tiers=[t or "" for t in where])

    # -- same GPU (device_arenas.py) -------------------------------------------------------------
    def AttachDeviceBuffer(self, request: pb.AttachDeviceBufferRequest, call: Call) -> pb.AttachDeviceBufferResponse:
        owner = self.auth.identity(call.metadata)  # any known token, as AttachArena
        return pb.AttachDeviceBufferResponse(buffer_id=self.device_arenas.attach(owner, request))

    def LoadSessionToDevice(self, request: pb.LoadSessionToDeviceRequest, call: Call
                            ) -> pb.LoadSessionToDeviceResponse:
        self._ns(call, request.namespace)
        owner = self.auth.identity(call.metadata)
        return self.device_arenas.load(owner, request.namespace, request.session_id, request.buffer_id)

    def DetachDeviceBuffer(self, request: pb.DetachArenaRequest, call: Call) -> pb.DetachArenaResponse:
        self.device_arenas.detach(self.auth.identity(call.metadata), request.arena_id)
        return pb.DetachArenaResponse()


def _chunk_data(piece: Piece) -> pb.ChunkData | fastpb.Encoded:
    """A LoadChunks message: a piece's handle, or its stream bytes encoded (one copy, while they are in hand)."""
    return piece.message() if piece.handle is not None else fastpb.Encoded(b"".join(piece.encoded()))


class _SessionMessages:
    """LoadSession's messages: the session in the first one only."""

    def __init__(self, session: pb.Session) -> None:
        self.session: pb.Session | None = session

    def encode(self, piece: Piece) -> pb.LoadSessionResponse | fastpb.Encoded:
        session, self.session = self.session, None
        if piece.handle is not None:
            r = pb.LoadSessionResponse(session=session) if session is not None else pb.LoadSessionResponse()
            piece.into(r.chunks)
            return r
        return fastpb.load_session_message(session.SerializeToString() if session is not None else None,
                                           piece.encoded())
