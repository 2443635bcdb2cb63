"""Where a handler's blocking store call runs: a worker thread, or inline on a local-socket thread.

The gRPC listener runs every handler on the daemon's one event loop, so a blocking store call (an
fsync'd save, an LMDB read) goes to a worker thread and the loop moves on. A local-socket
connection has a thread of its own that serves one call at a time (server/local.py): there the
call runs inline, and the handler coroutine never suspends, so that thread drives it to the end
without an event loop (``run_inline``): no task, no selector, no wake-up between the store call
and the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

_T = TypeVar("_T")

#: Set for the handlers a local-socket connection thread runs.
INLINE: ContextVar[bool] = ContextVar("kvstore_inline", default=False)


def inline() -> bool:
    return INLINE.get()


async def offload(fn: Callable[..., _T], /, *args: Any) -> _T:
    """``fn(*args)``: inline on a local-socket thread, else in a worker thread."""
    if INLINE.get():
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


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
