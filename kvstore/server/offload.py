"""Where a handler's blocking store call runs: a worker thread, or inline on a local-socket thread.

The gRPC listener runs every handler on the daemon's one event loop, so a blocking store call (an
fsync'd save, an LMDB read) goes to a worker thread and the loop moves on. A local-socket
connection has a thread of its own that serves one call at a time (server/local.py): there the
call runs inline, and the handler coroutine never suspends, so that thread drives it to the end
without an event loop (``run_inline``): no task, no selector, no wake-up between the store call
and the answer.

Connection threads take turns (``Turns``): one at a time runs handler code, as the event loop would,
and gives the turn up while it waits (a store call that may block, the socket). Without turns, the
threads of eight clients calling at once fought over the GIL at every read and send, and eight
concurrent 1 MiB loads took 25-40% longer than on the event loop; with them, as long as there.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

_T = TypeVar("_T")


class Turns:
    """The turn to run handler code, among a daemon's local-socket connection threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def taken(self) -> Iterator[None]:
        with self._lock:
            yield

    @contextlib.contextmanager
    def given_up(self) -> Iterator[None]:
        """Around a wait (a blocking store call, a send): others run meanwhile."""
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()


#: The turns of the local-socket thread running this handler (holding its turn); None elsewhere.
INLINE: ContextVar[Turns | None] = ContextVar("kvstore_inline", default=None)


def inline() -> bool:
    return INLINE.get() is not None


async def offload(fn: Callable[..., _T], /, *args: Any) -> _T:
    """``fn(*args)``: inline on a local-socket thread (its turn given up meanwhile), else in a worker
    thread."""
    turns = INLINE.get()
    if turns is not None:
        with turns.given_up():
            return fn(*args)
    return await asyncio.to_thread(fn, *args)


def given_up() -> contextlib.AbstractContextManager[None]:
    """On a local-socket thread, around a wait: its turn given up; elsewhere nothing."""
    turns = INLINE.get()
    return turns.given_up() if turns is not None else contextlib.nullcontext()


class Suspended(RuntimeError):
    """A handler awaited something only an event loop can finish, on a thread that runs none."""


def run_inline(coro: Coroutine[Any, Any, _T]) -> _T:
    """Drive a coroutine that never suspends to its result (its exception propagates)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise Suspended("a handler suspended on a local-socket thread")


def iterate_inline(agen: AsyncGenerator[_T, None]) -> Iterator[_T]:
    """An async generator that never suspends, as a plain iterator; closed however it ends (its
    ``finally`` blocks run: no event loop is there to finalize it later)."""
    try:
        while True:
            try:
                item = run_inline(agen.__anext__())  # type: ignore[arg-type]
            except StopAsyncIteration:
                return
            yield item
    finally:
        run_inline(agen.aclose())  # type: ignore[arg-type]
