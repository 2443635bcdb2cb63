"""asyncio client for the kvstore daemon, over grpc.aio: the same methods as
:class:`kvstore.client.Client` (awaitable), the same requests and answers (``kvstore.client.messages``) and the
same carrier, chosen once when it connects. Blobs read through the arena are copied out before the
call returns: tasks sharing one client must not see each other's batches."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import grpc

from kvstore.client import messages
from kvstore.client.config import ClientConfig
from kvstore.client.messages import SavedSession
from kvstore.errors import InvalidArgument, KvstoreError
from kvstore.format.manifest import Manifest, Retention
from kvstore.results import LookupResult, SaveResult
from kvstore.transport import convert, local_channel, shm
from kvstore.transport.carrier import ARENA, ArenaCarrier, Carrier, Receiver
from kvstore.transport.framing import Blob
from kvstore.transport.local_channel_aio import AsyncLocalChannel
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc


class AsyncClient:
    """asyncio client over grpc.aio, with the same methods as :class:`Client` (awaitable)."""

    def __init__(self, config: ClientConfig | str | None = None, **kwargs: Any) -> None:
        self.config = messages.client_config(config, kwargs)  # as Client: a positional address, default port 50151
        self.address = messages.target(self.config.address)
        self._versions = messages.Versions()  # as Client: the base version of each session's next save
        self._metadata = messages.metadata(self.config)
        opts = messages.channel_options(self.config)
        self._channel = (grpc.aio.secure_channel(self.address, self.config.tls.credentials(), opts)
                         if self.config.tls else grpc.aio.insecure_channel(self.address, opts))
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._local: AsyncLocalChannel | None = None
        self._conn: messages.Connection | None = None
        self._carrier: Carrier | None = None
        self._used = 0.0
        self._lock = asyncio.Lock()  # one batch in the arena at a time
        self._connecting = asyncio.Lock()  # one connect or re-attach at a time

    async def close(self) -> None:
        """As Client.close: detach the arena (best effort), close the channel."""
        if self._carrier is not None and self._carrier.arena_id:
            async with self._lock:
                with contextlib.suppress(grpc.RpcError):
                    await self._stub.DetachArena(pb.DetachArenaRequest(arena_id=self._carrier.arena_id),
                                                 timeout=messages.DETACH_TIMEOUT_S, metadata=self._metadata)
        self._drop_arena()
        if self._local is not None:
            await self._local.close()
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- connecting: the carrier, chosen once ---------------------------------------------------------
    async def connect(self) -> Carrier:
        async with self._connecting:
            if self._carrier is None:
                info = await self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest())
                conn = self._conn = messages.connection(info, self.config)
                self._carrier = await self._attach(conn)
            return self._carrier

    @property
    def uses_shared_memory(self) -> bool:
        """Which carrier the client chose (False before it connected)."""
        return self._carrier is not None and self._carrier.name == ARENA

    async def _attach(self, conn: messages.Connection) -> Carrier:
        """As Client._attach: a sealed arena handed over the daemon's local socket, which then carries
        every call; else the stream over gRPC."""
        path = conn.info.local_socket if conn.arena_dir is not None else ""
        local = self._local if self._local is not None and self._local.path == path else None
        if local is None and path:
            local = AsyncLocalChannel(path)
            try:
                await local.probe()
            except grpc.RpcError:
                await local.close()
                local = None
        try:
            carrier = await self._attach_sealed(path, conn) if local is not None else None
        except BaseException:
            if local is not None and local is not self._local:
                await local.close()
            raise
        if carrier is None:
            if local is not None and local is not self._local:
                await local.close()
            await self._on_grpc()
            return conn.stream()
        if local is not self._local:
            await self._on_grpc()
            self._local = local
            self._stub = pb_grpc.KVStoreStub(local)
        return carrier

    async def _attach_sealed(self, path: str, conn: messages.Connection) -> Carrier | None:
        """As Client._attach_sealed. The memfd is passed on a blocking connection of its own, in a
        worker thread (asyncio's streams cannot pass fds); the arena id is the caller's whichever
        connection attached it."""
        try:
            arena = shm.Arena.create_sealed(self.config.arena_bytes)
        except OSError:
            return None
        channel = local_channel.LocalChannel(path)
        attach = channel.unary_with_fds(local_channel.ATTACH_ARENA, pb.AttachArenaRequest.SerializeToString,
                                        pb.AttachArenaResponse.FromString)

        async def call(req: pb.AttachArenaRequest, **kw: Any) -> pb.AttachArenaResponse:
            return await asyncio.to_thread(attach, req, [arena.fd], **kw)

        try:
            r = await self._call(call, messages.attach_request(arena))
        except InvalidArgument:
            arena.close()
            return None
        except BaseException:
            arena.close()
            raise
        finally:
            channel.close()
        arena.release_fd()
        self._used = time.monotonic()
        return ArenaCarrier(arena, r.arena_id, conn.message_bytes)

    async def _on_grpc(self) -> None:
        if self._local is not None:
            await self._local.close()
            self._local = None
            self._stub = pb_grpc.KVStoreStub(self._channel)

    def _drop_arena(self) -> None:
        if isinstance(self._carrier, ArenaCarrier):
            self._carrier.arena.close()

    async def _reattach(self) -> Carrier:
        """As Client._reattach: never left holding a closed arena."""
        assert self._conn is not None
        async with self._connecting:
            self._drop_arena()
            self._carrier = None
            self._carrier = await self._attach(self._conn)
            return self._carrier

    @contextlib.asynccontextmanager
    async def _batch(self) -> AsyncIterator[Carrier]:
        """The carrier for one batch, held for it (tasks sharing this client wait for the arena)."""
        async with self._lock if (await self.connect()).arena_id else contextlib.nullcontext():
            carrier = await self.connect()
            if carrier.arena_id and time.monotonic() - self._used > messages.ARENA_REATTACH_S:
                carrier = await self._reattach()
            self._used = time.monotonic()
            yield carrier

    # -- calls ----------------------------------------------------------------------------------------
    async def _call(self, fn: Callable[..., Any], request: Any) -> Any:
        for attempt in range(self.config.retries + 1):
            try:
                return await fn(request, timeout=self.config.timeout_s, metadata=self._metadata)
            except grpc.RpcError as e:
                if not messages.retryable(e) or attempt == self.config.retries:
                    raise messages.domain_error(e) from None
                await asyncio.sleep(messages.backoff(self.config, attempt))
        raise AssertionError("unreachable")

    async def info(self) -> pb.ServerInfo:
        await self.connect()
        assert self._conn is not None
        return self._conn.info

    async def _save(self, header: pb.SaveHeader, blobs: Iterable[Blob]) -> pb.SaveChunksResponse:
        if (await self.connect()).arena_id:
            blobs = list(blobs)
        async with self._batch() as carrier:
            for attempt in range(2):
                try:
                    reqs = messages.save_requests(header, carrier.send(enumerate(blobs)))
                    return await self._stub.SaveChunks(reqs, timeout=self.config.timeout_s, metadata=self._metadata)
                except grpc.RpcError as e:
                    if attempt == 0 and carrier.arena_id and messages.unknown_arena(e):
                        carrier = await self._reattach()
                        continue
                    raise messages.domain_error(e) from None
        raise AssertionError("unreachable")

    async def save_chunks(self, namespace: str, layout_id: bytes, parent: bytes, first_index: int,
                          blobs: Iterable[Blob]) -> SaveResult:
        header = messages.save_header(namespace, layout_id, parent, first_index)
        return messages.save_result(await self._save(header, blobs))

    async def save_session(self, manifest: Manifest, new_blobs: Sequence[Blob], base: int | None = None
                           ) -> SavedSession:
        """As :meth:`Client.save_session`: the new chunks and the manifest's commit in one call, based
        on the version this client last saved or loaded (or ``base``)."""
        m = self._versions.based(manifest, base)
        saved = messages.saved_session(await self._save(messages.turn_header(m, len(new_blobs)), new_blobs))
        self._versions.saw(saved.manifest)
        return saved

    async def _open(self, rpc: Callable[..., Any], build: Callable[[Carrier], Any],
                    chunks_of: Callable[[Any], pb.ChunkData | None]
                    ) -> tuple[Any, list[tuple[int, Blob]], Receiver, AsyncIterator[Any]]:
        """Start a load: its first message, the pairs in it (copied out of the arena), the receiver
        and the rest of the stream (which never touches the arena: its part comes first)."""
        async with self._batch() as carrier:
            for attempt in range(2):
                receiver = carrier.receiver(copy=True)
                try:
                    # one iterator for the whole call: grpc.aio refuses read() and iteration on the same RPC
                    stream = aiter(rpc(build(carrier), timeout=self.config.timeout_s, metadata=self._metadata))
                    first = await anext(stream, None)
                except grpc.RpcError as e:
                    if attempt == 0 and carrier.arena_id and messages.unknown_arena(e):
                        carrier = await self._reattach()
                        continue
                    raise messages.domain_error(e) from None
                c = chunks_of(first) if first is not None else None
                return first, receiver.feed(c) if c is not None else [], receiver, stream
        raise AssertionError("unreachable")

    async def load_chunks(self, namespace: str, keys: Sequence[bytes]) -> AsyncIterator[tuple[int, Blob]]:
        keys = list(keys)
        _, head, receiver, stream = await self._open(
            self._stub.LoadChunks, lambda c: pb.LoadChunksRequest(namespace=namespace, keys=keys, arena_id=c.arena_id),
            lambda m: m)
        async for item in _pairs(head, stream, receiver, lambda m: m):
            yield item

    async def load_session(self, namespace: str, session_id: str
                           ) -> tuple[Manifest, AsyncIterator[tuple[int, Blob]]]:
        """The manifest, and an async iterator of (chunk index, blob) for the chunks still stored."""
        first, head, receiver, stream = await self._open(
            self._stub.LoadSession,
            lambda c: pb.LoadSessionRequest(namespace=namespace, session_id=session_id, arena_id=c.arena_id),
            messages.session_chunks)
        if first is None:
            raise KvstoreError("the daemon ended LoadSession without the manifest")
        return self._versions.saw(convert.session_from_pb(first.session)), _pairs(head, stream, receiver,
                                                                                 messages.session_chunks)

    async def lookup(self, namespace: str, layout_id: bytes, token_ids: Sequence[int]) -> LookupResult:
        return messages.lookup_result(await self._call(self._stub.Lookup,
                                                   messages.lookup_request(namespace, layout_id, token_ids)))

    async def commit(self, manifest: Manifest, base: int | None = None) -> Manifest:
        req = pb.CommitSessionRequest(session=convert.session_to_pb(self._versions.based(manifest, base)))
        return self._versions.saw(convert.session_from_pb((await self._call(self._stub.CommitSession, req)).session))

    async def get_session(self, namespace: str, session_id: str) -> tuple[Manifest, dict[str, int]]:
        r = await self._call(self._stub.GetSession, pb.GetSessionRequest(namespace=namespace, session_id=session_id))
        return self._versions.saw(convert.session_from_pb(r.session)), messages.tier_counts(r.tiers)

    async def list_sessions(self, namespace: str = "") -> list[pb.SessionSummary]:
        return list((await self._call(self._stub.ListSessions, pb.ListSessionsRequest(namespace=namespace))).sessions)

    async def delete_session(self, namespace: str, session_id: str) -> int:
        req = pb.DeleteSessionRequest(namespace=namespace, session_id=session_id)
        freed = (await self._call(self._stub.DeleteSession, req)).freed_chunks
        self._versions.forget(namespace, session_id)
        return freed

    async def touch_session(self, namespace: str, session_id: str, retention: Retention) -> Manifest:
        req = pb.TouchSessionRequest(namespace=namespace, session_id=session_id,
                                     retention=convert.retention_to_pb(retention))
        return self._versions.saw(convert.session_from_pb((await self._call(self._stub.TouchSession, req)).session))

    async def stats(self) -> pb.StatsResponse:
        return await self._call(self._stub.Stats, pb.StatsRequest())

    async def evict(self, namespace: str, session_id: str, tier: str) -> int:
        req = pb.EvictSessionRequest(namespace=namespace, session_id=session_id, tier=tier)
        return (await self._call(self._stub.EvictSession, req)).moved_chunks

    async def prefetch_session(self, namespace: str, session_id: str) -> pb.PrefetchSessionResponse:
        """As Client.prefetch_session: a background promotion to the fastest tier, answered at once."""
        return await self._call(self._stub.PrefetchSession, messages.prefetch_request(namespace, session_id))

    async def prefetch(self, namespace: str, session_id: str) -> int:
        """As Client.prefetch: how many chunks were queued."""
        return (await self.prefetch_session(namespace, session_id)).queued


async def _pairs(head: list[tuple[int, Blob]], stream: AsyncIterator[Any], receiver: Receiver,
                 chunks_of: Callable[[Any], pb.ChunkData | None]) -> AsyncIterator[tuple[int, Blob]]:
    for item in head:
        yield item
    try:
        async for msg in stream:
            c = chunks_of(msg)
            if c is not None:
                for item in receiver.feed(c):
                    yield item
    except grpc.RpcError as e:
        raise messages.domain_error(e) from None
    receiver.finish()
