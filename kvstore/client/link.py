"""How a client reaches its daemon: the gRPC channel, the daemon's local socket, and the carrier.

The carrier is chosen once, at the first call (``connect``): on the daemon's host, an arena (a sealed
memfd) handed to it over its local socket, and every call made over that socket from then on; else
the gRPC stream. The arena is re-attached when the daemon forgot it, and grows to fit a load the
daemon says is too large for it (``grow``). ``Client`` makes its calls through ``stubs``, which follow
the channel the link is on.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import grpc

from kvstore.client import calls as rq
from kvstore.client.config import ClientConfig, channel_options
from kvstore.errors import InvalidArgument
from kvstore.transport import fastpb, local_channel, shm
from kvstore.transport.carrier import ArenaCarrier, Carrier
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

#: The client's call with retries and a deadline: call(rpc, request) -> answer.
Call = Callable[[Callable[..., Any], Any], Any]


class Stubs(NamedTuple):
    """The KVStore calls over one channel (gRPC's, or the local socket's)."""

    kvstore: pb_grpc.KVStoreStub
    load_chunks: Any  # the loads, read without copying their chunk bytes (kvstore/transport/fastpb.py)
    load_session: Any


def stubs(channel: Any) -> Stubs:
    return Stubs(
        pb_grpc.KVStoreStub(channel),
        channel.unary_stream("/kvstore.v1.KVStore/LoadChunks",
                             request_serializer=pb.LoadChunksRequest.SerializeToString,
                             response_deserializer=fastpb.parse_chunk_data, _registered_method=True),
        channel.unary_stream("/kvstore.v1.KVStore/LoadSession",
                             request_serializer=pb.LoadSessionRequest.SerializeToString,
                             response_deserializer=fastpb.parse_load_session, _registered_method=True))


class Link:
    def __init__(self, config: ClientConfig, address: str, call: Call, metadata: Any) -> None:
        self.config = config
        opts = channel_options(config)
        self.channel = (grpc.secure_channel(address, config.tls.credentials(), opts) if config.tls
                        else grpc.insecure_channel(address, opts))
        self.local: local_channel.LocalChannel | None = None
        self.stubs = stubs(self.channel)
        self.conn: rq.Connection | None = None
        self.chosen: Carrier | None = None
        self._call = call
        self._metadata = metadata
        self._used = 0.0  # when the arena last carried a batch
        self._arena_bytes = config.arena_bytes  # grows to fit a load (``grow``)
        self.lock = threading.Lock()  # one batch in the arena at a time
        self._connecting = threading.Lock()  # one connect or re-attach at a time

    def _bind(self, channel: Any) -> None:
        self.stubs = stubs(channel)

    def connect(self) -> Carrier:
        """Ask the daemon what it is and pick the carrier (once; later calls return it)."""
        with self._connecting:
            if self.chosen is None:
                info = self._call(self.stubs.kvstore.GetServerInfo, pb.GetServerInfoRequest())
                self.conn = rq.connection(info, self.config)
                self.chosen = self._attach(self.conn)
            return self.chosen

    def close(self) -> None:
        """Detach the arena (best effort: the daemon unmaps an arena after 300 s idle anyway), close
        the channels."""
        if self.chosen is not None and self.chosen.arena_id:
            with self.lock, contextlib.suppress(grpc.RpcError):
                self.stubs.kvstore.DetachArena(pb.DetachArenaRequest(arena_id=self.chosen.arena_id),
                                               timeout=rq.DETACH_TIMEOUT_S, metadata=self._metadata)
        self._drop_arena()
        if self.local is not None:
            self.local.close()
        self.channel.close()

    def _attach(self, conn: rq.Connection) -> Carrier:
        """Same host, and the daemon's local socket answers from here: a fresh sealed arena handed to the
        daemon over that socket, and every call made over it from now on (kvstore/transport/local_channel.py).
        Otherwise, or if the daemon refuses the arena or the memory for it is not there: the stream, over gRPC."""
        path = conn.info.local_socket if conn.arena_dir is not None else ""
        local = (self.local if self.local is not None and self.local.path == path
                 else local_channel.reachable(path) if path else None)
        try:
            carrier = self._attach_sealed(local, conn) if local is not None else None
        except BaseException:
            if local is not None and local is not self.local:
                local.close()
            raise
        if carrier is None:
            if local is not None and local is not self.local:
                local.close()
            self._on_grpc()
            return conn.stream()
        if local is not self.local:
            self._on_grpc()
            self.local = local
            self._bind(local)
        return carrier

    def _attach_sealed(self, local: local_channel.LocalChannel, conn: rq.Connection) -> Carrier | None:
        """A sealed memfd arena (kvstore/transport/shm.py), its fd passed with AttachArena; None if the memory is
        not there or the daemon refuses it. Other failures (the daemon is down) raise."""
        try:
            arena = shm.Arena.create_sealed(self._arena_bytes)
        except OSError:
            return None
        attach = local.unary_with_fds(local_channel.ATTACH_ARENA, pb.AttachArenaRequest.SerializeToString,
                                      pb.AttachArenaResponse.FromString)
        try:
            req = pb.AttachArenaRequest(path=arena.path, size=arena.size, nonce=arena.nonce)
            r = self._call(lambda req, **kw: attach(req, [arena.fd], **kw), req)
        except InvalidArgument:
            arena.close()
            return None
        except BaseException:
            arena.close()
            raise
        arena.release_fd()  # the daemon holds its own; the mapping keeps the memory
        self._used = time.monotonic()
        return ArenaCarrier(arena, r.arena_id, conn.message_bytes)

    def _on_grpc(self) -> None:
        """Calls over gRPC again (a daemon that no longer takes our arena)."""
        if self.local is not None:
            self.local.close()
            self.local = None
            self._bind(self.channel)

    def _drop_arena(self) -> None:
        if isinstance(self.chosen, ArenaCarrier):
            self.chosen.arena.close()

    def reattach(self) -> Carrier:
        """The daemon forgot our arena (it restarted, or unmapped it when idle): a new one. If that
        fails (the daemon is down again), the client is left unconnected, never holding a closed
        arena: its next call connects afresh, by the same rule."""
        assert self.conn is not None
        with self._connecting:
            self._drop_arena()
            self.chosen = None
            self.chosen = self._attach(self.conn)
            return self.chosen

    def grow(self, need: int) -> Carrier:
        """An arena large enough for a load of ``need`` bytes (doubling, up to ``max_arena_bytes``), or
        the stream for a load larger than that."""
        assert self.conn is not None
        if need > self.config.max_arena_bytes:
            return self.conn.stream()
        self._arena_bytes = min(self.config.max_arena_bytes, max(need, 2 * self._arena_bytes))
        return self.reattach()

    @contextlib.contextmanager
    def batch(self) -> Iterator[Carrier]:
        """The carrier for one batch, held for it: an arena carries one batch at a time (threads
        sharing this client wait), and is re-attached here, not under another thread's batch."""
        with self.lock if self.connect().arena_id else contextlib.nullcontext():
            carrier = self.connect()
            if carrier.arena_id and time.monotonic() - self._used > rq.ARENA_REATTACH_S:
                carrier = self.reattach()  # the daemon unmaps arenas idle for 300 s
            self._used = time.monotonic()
            yield carrier
