"""The daemon's side of the carriers (kvstore/transport/carrier.py): the carrier of each call, built from
the arena id it names (the caller's own, from the pool of arenas below, or none: the stream), the
arenas clients attach, and counts of how each call's chunks travelled (Stats: TransportStats).

The arenas: the same-host arenas the daemon keeps mapped, each bound to the identity that attached it.

An arena id is a capability only for its owner: another identity naming it gets exactly the
answer an unknown id gets, so ids learned from a log or a shared process reveal and allow nothing.
Each identity keeps at most ``per_owner`` arenas (the least recently used goes first), so one
tenant attaching many cannot unmap another's.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import InvalidArgument, Retry
from kvstore.server import arena_attach
from kvstore.transport import shm, slots
from kvstore.transport.carrier import (
    ARENA,
    STREAM,
    UNKNOWN_ARENA,
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
                 sender: Sender | None = None, n_keys: int | None = None,
                 more_into: Sequence[pb.CallerMemory] = ()) -> Carrier:
        """The carrier a call asked for: the caller's own memory ``into`` (a load over the local
        socket, whose ``sender`` the kernel named: kvstore/transport/sender.py; with slots, a
        LoadChunks of ``n_keys`` engine pages scattered into them, and into the slots of the further
        regions ``more_into``), ``owner``'s arena ``arena_id``, or the stream. Another identity's
        arena id is as unknown as a made-up one (below). ``more_into``'s shape (each region's address,
        size and slot size, into named first, a slot per key) was checked with the request
        (request_checks.py)."""
        if into is not None:
            if sender is None:
                raise InvalidArgument("CallerMemory names memory of the calling process: only a call over the "
                                      "daemon's local socket can (the kernel names its process)")
            if not into.address or not into.size:
                raise InvalidArgument("CallerMemory needs an address and a size")
            if not into.slot_offsets and not into.slot_bytes and not more_into:
                return CallerMemoryCarrier(sender, into.address, into.size)
            if n_keys is None:
                raise InvalidArgument("CallerMemory.slot_offsets: only LoadChunks scatters engine pages into slots")
            prefix = "LoadChunksRequest." if more_into else ""
            return CallerSlotsCarrier(sender, slots.scatter([into, *more_into], n_keys, prefix))
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


# A bound on mappings (each arena is one mmap in the daemon), not on memory: the pages belong to the
# client's shm file either way. Above the clients one token typically runs on a host (a soak of 64
# clients under one token thrashed at 16: each attach evicted another client's arena).
MAX_ARENAS_PER_OWNER = 256
ARENA_IDLE_S = 300.0


@dataclass
class _Attached:
    arena: shm.ArenaMemory
    owner: str
    used: float


class Arenas:
    def __init__(self, per_owner: int = MAX_ARENAS_PER_OWNER,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_owner = per_owner
        self.clock = clock
        self._by_id: OrderedDict[str, _Attached] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # calls run in worker and local-socket threads at once

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, owner: str, arena: shm.ArenaMemory) -> str:
        """Register ``arena`` for ``owner``; returns its new id."""
        arena_id = uuid.uuid4().hex
        with self._lock:
            self._by_id[arena_id] = _Attached(arena, owner, self.clock())
            mine = [a for a, e in self._by_id.items() if e.owner == owner]
            evicted = [self._by_id.pop(old) for old in mine[: max(0, len(mine) - self.per_owner)]]
        for e in evicted:
            e.arena.close()
        return arena_id

    def get(self, owner: str, arena_id: str) -> shm.ArenaMemory:
        """The arena ``owner`` attached under ``arena_id``; anyone else's is unknown."""
        with self._lock:
            entry = self._by_id.get(arena_id)
            if entry is None or entry.owner != owner:
                # the id is not echoed: the answer is the same text for every id that is not the caller's
                raise InvalidArgument(f"{UNKNOWN_ARENA}: attach it (again) with AttachArena",
                                      reason=Retry.UNKNOWN_ARENA)
            self._by_id.move_to_end(arena_id)
            entry.used = self.clock()
            return entry.arena

    def remove(self, owner: str, arena_id: str) -> bool:
        """Unmap ``owner``'s arena ``arena_id``; anyone else's, or an unknown id, is left alone."""
        with self._lock:
            entry = self._by_id.get(arena_id)
            if entry is None or entry.owner != owner:
                return False
            del self._by_id[arena_id]
        entry.arena.close()
        return True

    def close_idle(self, idle_s: float = ARENA_IDLE_S) -> int:
        """Unmap arenas nobody used for ``idle_s`` (their clients are gone or idle; a client whose
        arena was closed is told it is unknown, and attaches a new one)."""
        now = self.clock()
        with self._lock:
            idle = [self._by_id.pop(a) for a, e in list(self._by_id.items()) if now - e.used > idle_s]
        for e in idle:
            e.arena.close()
        return len(idle)

    def close_all(self) -> None:
        with self._lock:
            entries, self._by_id = list(self._by_id.values()), OrderedDict()
        for e in entries:
            e.arena.close()
