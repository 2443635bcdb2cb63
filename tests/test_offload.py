"""Handlers driven without an event loop on a local-socket thread (kvstore/server/offload.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator

import pytest

from kvstore.server.offload import INLINE, Suspended, Turns, iterate_inline, offload, run_inline


def test_offload_runs_inline_on_a_local_socket_thread_and_in_a_worker_otherwise() -> None:
    async def where() -> str:
        return await offload(lambda: threading.current_thread().name)

    seen: list[str] = []

    def local_thread() -> None:
        turns = Turns()
        INLINE.set(turns)
        with turns.taken():
            seen.append(run_inline(where()))

    t = threading.Thread(target=local_thread, name="conn")
    t.start()
    t.join()
    assert seen == ["conn"]
    assert asyncio.run(where()) != threading.current_thread().name  # the event loop hands it to a worker


class _Pending:
    """What awaiting an unfinished future does: hand control back to whoever drives the coroutine."""

    def __await__(self):  # type: ignore[no-untyped-def]
        yield None


def test_a_thread_waiting_in_a_store_call_gives_up_its_turn() -> None:
    """A save parked on its fsync must not stop the other connections' calls."""
    turns, inside, ran = Turns(), threading.Event(), threading.Event()
    release = threading.Event()

    def blocking() -> None:
        inside.set()
        assert release.wait(10)

    async def saves() -> None:
        await offload(blocking)

    def saver() -> None:
        INLINE.set(turns)
        with turns.taken():
            run_inline(saves())

    def other() -> None:
        with turns.taken():
            ran.set()

    t = threading.Thread(target=saver)
    t.start()
    assert inside.wait(10)
    o = threading.Thread(target=other)
    o.start()
    assert ran.wait(10)  # took the turn while the saver waited
    release.set()
    t.join(10)
    o.join(10)


def test_a_handler_that_suspends_is_an_error_not_a_hang() -> None:
    async def waits() -> None:
        await _Pending()

    with pytest.raises(Suspended):
        run_inline(waits())
    with pytest.raises(RuntimeError):  # what needs a running loop fails at once, too
        run_inline(asyncio.sleep(0.01))


def test_an_abandoned_stream_runs_its_finally() -> None:
    closed: list[bool] = []

    async def stream() -> AsyncGenerator[int, None]:
        try:
            for i in range(10):
                yield i
        finally:
            closed.append(True)

    it = iterate_inline(stream())
    assert [next(it), next(it)] == [0, 1]
    it.close()
    assert closed == [True]
    assert list(iterate_inline(stream())) == list(range(10))
    assert closed == [True, True]


def test_errors_propagate_as_raised() -> None:
    async def fails() -> None:
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        run_inline(fails())
