"""asyncio client for the kvstore daemon, over grpc.aio, built on the same wire helpers as
:class:`kvstore.client.Client` (same methods, awaitable; no same-host arena: saves stream, loads
from the same host come back in a shared-memory file the daemon writes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import grpc

from kvstore import convert, transport
from kvstore.client import (
    ClientConfig,
    _Base,
    _channel_options,
    _ChunkReader,
    _domain_error,
    _lookup_result,
    _retention,
    _save_requests,
)
from kvstore.manifest import Manifest, Retention
from kvstore.results import LookupResult, SaveResult
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc


class AsyncClient(_Base):
    """asyncio client over grpc.aio, with the same methods as :class:`Client` (awaitable)."""

    def __init__(self, config: ClientConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        opts = _channel_options(self.config)
        self._channel = (grpc.aio.secure_channel(self.address, self.config.tls.credentials(), opts)
                         if self.config.tls else grpc.aio.insecure_channel(self.address, opts))
        self._stub = pb_grpc.KVStoreStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, fn: Callable[..., Any], request: Any) -> Any:
        for attempt in range(self.config.retries + 1):
            try:
                return await fn(request, timeout=self.config.timeout_s, metadata=self._metadata)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == self.config.retries:
                    raise _domain_error(e) from None
                await asyncio.sleep(self._delay(attempt))
        raise AssertionError("unreachable")

    async def info(self) -> pb.ServerInfo:
        if self._info is None:
            self._negotiate(await self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest()))
        return self._info  # type: ignore[return-value]

    async def save_chunks(self, namespace: str, layout_id: bytes, parent: bytes, first_index: int,
                          blobs: Iterable[transport.Blob]) -> SaveResult:
        """Saves take the stream: the daemon no longer opens per-call shared-memory files a request
        names (one tenant could name another's), and this client keeps no arena."""
        info = await self.info()
        header = pb.SaveHeader(namespace=namespace, layout_id=layout_id, parent_key=parent, first_index=first_index)
        try:
            reqs = _save_requests(header, blobs, min(transport.DEFAULT_MESSAGE_BYTES, info.max_message_bytes // 2))
            r = await self._stub.SaveChunks(reqs, timeout=self.config.timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise _domain_error(e) from None
        return SaveResult(list(r.keys), r.written)

    async def load_chunks(self, namespace: str, keys: Sequence[bytes]) -> AsyncIterator[tuple[int, transport.Blob]]:
        await self.info()
        req = pb.LoadChunksRequest(namespace=namespace, keys=list(keys), shared_memory=self.uses_shared_memory)
        reader = _ChunkReader(self._shm_dir)
        try:
            async for msg in self._stub.LoadChunks(req, timeout=self.config.timeout_s, metadata=self._metadata):
                for item in reader.feed(msg):
                    yield item
        except grpc.aio.AioRpcError as e:
            raise _domain_error(e) from None
        reader.assembler.finish()

    async def load_session(self, namespace: str, session_id: str
                           ) -> tuple[Manifest, AsyncIterator[tuple[int, transport.Blob]]]:
        """The manifest, and an async iterator of (chunk index, blob) for the chunks still stored."""
        await self.info()
        req = pb.LoadSessionRequest(namespace=namespace, session_id=session_id, shared_memory=self.uses_shared_memory)
        # one iterator for the whole call: grpc.aio refuses read() and iteration on the same RPC
        stream = aiter(self._stub.LoadSession(req, timeout=self.config.timeout_s, metadata=self._metadata))
        try:
            first = await anext(stream)
        except grpc.aio.AioRpcError as e:
            raise _domain_error(e) from None
        reader = _ChunkReader(self._shm_dir)

        async def chunks() -> AsyncIterator[tuple[int, transport.Blob]]:
            try:
                async for msg in stream:
                    for item in reader.feed(msg.chunks):
                        yield item
            except grpc.aio.AioRpcError as e:
                raise _domain_error(e) from None
            reader.assembler.finish()

        return convert.session_from_pb(first.session), chunks()

    async def lookup(self, namespace: str, layout_id: bytes, token_ids: Sequence[int]) -> LookupResult:
        r = await self._call(self._stub.Lookup, pb.LookupRequest(namespace=namespace, layout_id=layout_id,
                                                                 token_ids=list(map(int, token_ids))))
        return _lookup_result(r)

    async def commit(self, manifest: Manifest) -> Manifest:
        r = await self._call(self._stub.CommitSession,
                             pb.CommitSessionRequest(session=convert.session_to_pb(manifest)))
        return convert.session_from_pb(r.session)

    async def get_session(self, namespace: str, session_id: str) -> tuple[Manifest, dict[str, int]]:
        r = await self._call(self._stub.GetSession, pb.GetSessionRequest(namespace=namespace, session_id=session_id))
        return convert.session_from_pb(r.session), {t.tier: t.chunks for t in r.tiers}

    async def list_sessions(self, namespace: str = "") -> list[pb.SessionSummary]:
        return list((await self._call(self._stub.ListSessions, pb.ListSessionsRequest(namespace=namespace))).sessions)

    async def delete_session(self, namespace: str, session_id: str) -> int:
        req = pb.DeleteSessionRequest(namespace=namespace, session_id=session_id)
        return (await self._call(self._stub.DeleteSession, req)).freed_chunks

    async def touch_session(self, namespace: str, session_id: str, retention: Retention) -> Manifest:
        req = pb.TouchSessionRequest(namespace=namespace, session_id=session_id, retention=_retention(retention))
        return convert.session_from_pb((await self._call(self._stub.TouchSession, req)).session)

    async def stats(self) -> pb.StatsResponse:
        return await self._call(self._stub.Stats, pb.StatsRequest())

    async def evict(self, namespace: str, session_id: str, tier: str) -> int:
        req = pb.EvictSessionRequest(namespace=namespace, session_id=session_id, tier=tier)
        return (await self._call(self._stub.EvictSession, req)).moved_chunks
