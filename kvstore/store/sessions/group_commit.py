"""Group commit: concurrent callers' writes committed together, one durable transaction (one
fsync) per group, without weakening what a return means (a caller returns once its own write is
durable, or with its own error).

Callers queue their item, then take the commit lock; whoever holds it (the leader) takes the whole
queue and commits it as one group. Items queued while a group commits form the next group, so the
more callers wait on an fsync, the more one fsync serves. A caller whose item a leader committed
finds it done when it gets the lock, and returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

_I = TypeVar("_I")
_R = TypeVar("_R")


@dataclass
class Pending(Generic[_I, _R]):
    """One caller's item and, once its group is committed, its result or its error."""

    item: _I
    result: _R | None = None
    error: BaseException | None = None
    done: bool = False

    def succeed(self, result: _R) -> None:
        self.result, self.done = result, True

    def fail(self, error: BaseException) -> None:
        self.error, self.done = error, True


#: Commits a group: settles (succeed / fail) each item it takes, returns those it leaves for the
#: next group (e.g. a second write to the same session).
CommitGroup = Callable[[list[Pending[_I, _R]]], list[Pending[_I, _R]]]


class GroupCommit(Generic[_I, _R]):
    def __init__(self, lock: threading.RLock, commit: CommitGroup[_I, _R]) -> None:
        self._lock = lock  # the commit lock: whoever holds it commits everything queued
        self._commit = commit
        self._queue: list[Pending[_I, _R]] = []
        self._queue_lock = threading.Lock()

    def submit(self, item: _I) -> _R:
        """Queue ``item``, wait until a group holding it is committed; its result (or raise its error)."""
        mine: Pending[_I, _R] = Pending(item)
        with self._queue_lock:
            self._queue.append(mine)
        while not mine.done:
            with self._lock:
                if mine.done:  # a leader committed it while this caller waited for the lock
                    break
                with self._queue_lock:
                    group, self._queue = self._queue, []
                try:
                    left = self._commit(group)
                except BaseException as e:  # a bug in the commit: every caller of the group hears of it
                    for p in group:
                        if not p.done:
                            p.fail(e)
                    raise
                with self._queue_lock:
                    self._queue[:0] = left
        if mine.error is not None:
            raise mine.error
        assert mine.result is not None
        return mine.result
