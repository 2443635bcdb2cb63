"""The daemon's side of the carriers (kvstore/transport/carrier.py): the carrier of each call, built from
the arena id it names (the caller's own, from the pool in arenas.py, or none: the stream), the
arenas clients attach, and counts of how each call's chunks travelled (Stats: TransportStats)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import InvalidArgument
from kvstore.server import arena_attach
from kvstore.server.arenas import Arenas
from kvstore.transport import shm, slots
from kvstore.transport.carrier import (
    ARENA,
    STREAM,
    ArenaCarrier,
    CallerMemoryCarrier,
    CallerSlotsCarrier,
    Carrier,
    StreamCarrier,
)
from kvstore.transport.sender import Sender
from kvstore.v1 import kvstore_pb2 as pb


@dataclass
class _Counts:
    arena_calls: int = 0
    overflow_calls: int = 0
    stream_calls: int = 0
    attaches: int = 0
    detaches: int = 0
    local_calls: int = 0
    caller_memory_calls: int = 0


class Carriers:
    def __init__(self, shm_dir: Path | None, message_bytes: int, arenas: Arenas | None = None) -> None:
        self.shm_dir = shm_dir
        self.message_bytes = message_bytes
        self.arenas = arenas or Arenas()
        self._counts = _Counts()
        self._lock = threading.Lock()  # counted from worker and connection threads at once

    @property
    def offered(self) -> list[str]:
        return [STREAM, ARENA] if self.shm_dir is not None else [STREAM]

    def for_call(self, owner: str, arena_id: str, into: pb.CallerMemory | None = None,
                 sender: Sender | None = None, n_keys: int | None = None) -> Carrier:
        """The carrier a call asked for: the caller's own memory ``into`` (a load over the local
        socket, whose ``sender`` the kernel named: kvstore/transport/sender.py; with slots, a
        LoadChunks of ``n_keys`` engine pages scattered into them), ``owner``'s arena ``arena_id``,
        or the stream. Another identity's arena id is as unknown as a made-up one (arenas.py)."""
        if into is not None:
            if sender is None:
                raise InvalidArgument("CallerMemory names memory of the calling process: only a call over the "
                                      "daemon's local socket can (the kernel names its process)")
            if not into.address or not into.size:
                raise InvalidArgument("CallerMemory needs an address and a size")
            if not into.slot_offsets and not into.slot_bytes:
                return CallerMemoryCarrier(sender, into.address, into.size)
            if n_keys is None:
                raise InvalidArgument("CallerMemory.slot_offsets: only LoadChunks scatters engine pages into slots")
            offsets = slots.check(into.slot_offsets, into.slot_bytes, into.size, n_keys)
            return CallerSlotsCarrier(sender, into.address, into.size, offsets, into.slot_bytes)
        if not arena_id:
            return StreamCarrier(self.message_bytes)
        return ArenaCarrier(self.arenas.get(owner, arena_id), arena_id, self.message_bytes)

    def count(self, carrier: Carrier, streamed: bool = False) -> None:
        """After a call: which way its chunks went (``streamed``: a save's data part was non-empty)."""
        c = self._counts
        with self._lock:
            if isinstance(carrier, ArenaCarrier):
                c.arena_calls += 1
                c.overflow_calls += carrier.overflowed or streamed
            elif isinstance(carrier, CallerMemoryCarrier):
                c.caller_memory_calls += 1
            else:
                c.stream_calls += 1

    def attach(self, owner: str, request: pb.AttachArenaRequest, fds: list[int]) -> str:
        """Attach the caller's arena: the sealed memfd it passed with the call (``fds``: only the local
        socket passes any; this closes them), or the ``/dev/shm`` file it names (arena_attach.py says
        how each is held without SIGBUS risk)."""
        try:
            if self.shm_dir is None:
                raise InvalidArgument("shared memory is disabled on this daemon")
            if len(fds) > 1:
                raise InvalidArgument(f"AttachArena passes one memfd, not {len(fds)} fds")
            nonce = bytes(request.nonce)
            if fds and request.path:
                raise InvalidArgument("AttachArena names a path and passes a memfd: one or the other")
            if fds:
                fd = fds.pop()
                arena: shm.ArenaMemory = arena_attach.attach_sealed(fd, request.size, nonce)
            elif request.path:
                arena = arena_attach.attach_file(request.path, self.shm_dir, request.size, nonce)
            else:
                raise InvalidArgument("AttachArena names no arena: a kvstore-cli-* file in the shm directory, "
                                      "or (over the local socket) a sealed memfd passed with the call")
        finally:
            for fd in fds:
                os.close(fd)
        with self._lock:
            self._counts.attaches += 1
        return self.arenas.add(owner, arena)

    def detach(self, owner: str, arena_id: str) -> None:
        removed = self.arenas.remove(owner, arena_id)
        with self._lock:
            self._counts.detaches += removed

    def count_caller_memory(self) -> None:
        """A save whose engine pages the daemon read from the caller's memory (CallerPages)."""
        with self._lock:
            self._counts.caller_memory_calls += 1

    def count_local(self) -> None:
        """A call made over the local socket (server/local.py)."""
        with self._lock:
            self._counts.local_calls += 1

    def stats(self) -> pb.TransportStats:
        c = self._counts
        return pb.TransportStats(arenas=len(self.arenas), arena_calls=c.arena_calls, overflow_calls=c.overflow_calls,
                                 stream_calls=c.stream_calls, attaches=c.attaches, detaches=c.detaches,
                                 local_calls=c.local_calls, caller_memory_calls=c.caller_memory_calls)
