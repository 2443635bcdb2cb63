"""The same-host arenas the daemon keeps mapped, each bound to the identity that attached it.

An arena id is a capability only for its owner: another identity naming it gets exactly the
answer an unknown id gets, so ids learned from a log or a shared process reveal and allow nothing.
Each identity keeps at most ``per_owner`` arenas (the least recently used goes first), so one
tenant attaching many cannot unmap another's.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.errors import InvalidArgument, Retry
from kvstore.transport import shm
from kvstore.transport.carrier import UNKNOWN_ARENA

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
