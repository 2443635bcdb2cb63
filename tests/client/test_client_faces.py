"""One client, two faces: ``AsyncClient`` is a facade over ``Client`` and must not drift from it.

``drift`` compares the two classes: every public method of Client has an async counterpart of the
same name and parameters whose result is the same (an iterator becomes an async iterator), every
public property is a property there too. It is checked against the real classes, and against
facades that drift on purpose (so the check itself can fail). The rest runs the facade against a
real daemon: off the event loop, many tasks sharing one arena, loads left early or cancelled.
"""

from __future__ import annotations

import asyncio
import collections.abc
import inspect
import threading
import types
import typing
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from kvstore.client import AsyncClient, Client
from kvstore.errors import NotFound
from tests.helpers.daemon import Daemon, make_session, running_daemon


# -- the faces cannot drift ---------------------------------------------------------------------------
def _public(cls: type) -> dict[str, Any]:
    return {n: v for n, v in vars(cls).items() if not n.startswith("_")}


def _as_async(hint: Any) -> Any:
    """What a sync result type is on the async face: each Iterator[...] within it an AsyncIterator[...]."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        return hint
    mapped = tuple(_as_async(a) for a in args)
    if origin is collections.abc.Iterator:
        return AsyncIterator[mapped]  # type: ignore[valid-type]
    if origin in (types.UnionType, typing.Union):
        return typing.Union[mapped]  # noqa: UP007 (a tuple of members)
    return origin[mapped]


def _returns_iterator(hint: Any) -> bool:
    return typing.get_origin(hint) is collections.abc.Iterator


def drift(sync: type, aio: type) -> list[str]:
    """How ``aio`` fails to be ``sync``'s async face (empty: it is one)."""
    problems = []
    faces = _public(aio)
    for name, member in _public(sync).items():
        other = faces.get(name)
        if isinstance(member, property):
            if not isinstance(other, property):
                problems.append(f"{name}: a property of {sync.__name__}, not of {aio.__name__}")
            elif typing.get_type_hints(member.fget) != typing.get_type_hints(other.fget):
                problems.append(f"{name}: the property's type differs")
            continue
        if not inspect.isfunction(member):
            continue
        if not inspect.isfunction(other):
            problems.append(f"{name}: missing from {aio.__name__}")
            continue
        mine, theirs = inspect.signature(member), inspect.signature(other)
        hints, other_hints = typing.get_type_hints(member), typing.get_type_hints(other)
        result, other_result = hints.pop("return", None), other_hints.pop("return", None)
        if [(p.name, p.kind, p.default) for p in mine.parameters.values()] != \
                [(p.name, p.kind, p.default) for p in theirs.parameters.values()] or hints != other_hints:
            problems.append(f"{name}: parameters {mine} vs {theirs}")
        if _as_async(result) != other_result:
            problems.append(f"{name}: result {result} vs {other_result}")
        want = inspect.isasyncgenfunction if _returns_iterator(result) else inspect.iscoroutinefunction
        if not want(other):
            problems.append(f"{name}: not an {'async generator' if _returns_iterator(result) else 'async'} function")
    extra = set(faces) - set(_public(sync))
    if extra:
        problems.append(f"{aio.__name__} has methods {sync.__name__} lacks: {sorted(extra)}")
    return problems


def test_the_async_client_is_the_clients_async_face() -> None:
    assert drift(Client, AsyncClient) == []
    assert [n for n, v in _public(Client).items() if inspect.isfunction(v)]  # the check checked something


class _Sync:
    def get(self, key: str, default: int = 0) -> int:
        return default

    def items(self, n: int) -> Iterator[tuple[int, bytes]]:
        yield from ()

    @property
    def ready(self) -> bool:
        return True


@pytest.mark.parametrize(("source", "problem"), [
    ("", "get: missing from"),
    ("async def get(self, key: str, default: int = 1) -> int: ...", "get: parameters"),
    ("async def get(self, key: str, default: int = 0) -> str: ...", "get: result"),
    ("def get(self, key: str, default: int = 0) -> int: ...", "get: not an async function"),
    ("async def get(self, key: str, default: int = 0) -> int: ...\n"
     "async def items(self, n: int) -> Iterator[tuple[int, bytes]]: ...", "items: result"),
    ("async def get(self, key: str, default: int = 0) -> int: ...\n"
     "async def items(self, n: int) -> AsyncIterator[tuple[int, bytes]]: ...", "items: not an async generator"),
    ("async def get(self, key: str, default: int = 0) -> int: ...\nready = True", "ready: a property"),
    ("async def get(self, key: str, default: int = 0) -> int: ...\nasync def more(self) -> None: ...",
     "Drifted has methods _Sync lacks: ['more']"),
])
def test_drift_is_caught(source: str, problem: str) -> None:
    body = "    " + "\n    ".join(source.splitlines()) if source else "    pass"
    ns: dict[str, Any] = {"Iterator": Iterator, "AsyncIterator": AsyncIterator}
    exec(f"class Drifted:\n{body}\n", ns)  # a facade as someone might have written it
    assert any(p.startswith(problem) for p in drift(_Sync, ns["Drifted"])), drift(_Sync, ns["Drifted"])


# -- the facade against a real daemon ---------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("faces") / "data") as d:
        yield d


@pytest.fixture
def ns() -> str:
    return f"f-{uuid.uuid4().hex[:12]}"


def test_calls_run_off_the_event_loop(daemon: Daemon) -> None:
    threads: list[int] = []

    class Recording(Client):
        def info(self) -> Any:
            threads.append(threading.get_ident())
            return super().info()

    async def go() -> None:
        async with AsyncClient(client=Recording(daemon.address)) as c:
            assert not c.uses_shared_memory and c.carrier_chosen is None  # a property never connects
            with pytest.raises(RuntimeError, match="not connected yet"):
                c.carrier  # noqa: B018
            await c.info()
            assert c.carrier is c.client.carrier and c.uses_shared_memory

    asyncio.run(go())
    assert threads and threading.get_ident() not in threads


def test_many_tasks_share_one_client_and_its_arena(daemon: Daemon, ns: str) -> None:
    sessions = [make_session(namespace=ns, session_id=f"s{i}", tokens=900, seed=i) for i in range(6)]

    async def task(c: AsyncClient, i: int) -> None:
        s = sessions[i % len(sessions)]
        for _ in range(3):
            await c.save_session(s.manifest, s.blobs, base=0)
            _, pairs = await c.load_session(ns, s.session_id)
            assert {j: bytes(b) async for j, b in pairs} == dict(enumerate(s.blobs))
            assert {j: bytes(b) async for j, b in c.load_chunks(ns, s.keys)} == dict(enumerate(s.blobs))
            assert sum((await c.get_session(ns, s.session_id))[1].values()) == len(s.blobs)

    async def go() -> None:
        async with AsyncClient(daemon.address, arena_bytes=1 << 20) as c:
            await asyncio.gather(*(task(c, i) for i in range(24)))
            assert c.uses_shared_memory

    asyncio.run(go())


def test_a_load_left_early_or_cancelled_leaves_the_client_usable(daemon: Daemon, ns: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.client import aio

    monkeypatch.setattr(aio, "PULL_BYTES", 1)  # one pair a hop: a load is left between hops
    s = make_session(namespace=ns, tokens=2000)
    want = dict(enumerate(s.blobs))

    async def go() -> None:
        async with AsyncClient(daemon.address, arena_bytes=1 << 20) as c:
            await c.save_session(s.manifest, s.blobs)
            async for _ in c.load_chunks(ns, s.keys):
                break
            _, pairs = await c.load_session(ns, s.session_id)
            assert (await anext(pairs))[0] == 0
            await pairs.aclose()  # type: ignore[attr-defined]
            started = asyncio.Event()

            async def slow_reader() -> None:
                async for _ in c.load_chunks(ns, s.keys):
                    started.set()
                    await asyncio.sleep(3600)

            reader = asyncio.create_task(slow_reader())
            await started.wait()
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            _, pairs = await c.load_session(ns, s.session_id)
            assert {i: bytes(b) async for i, b in pairs} == want
            with pytest.raises(NotFound):
                await c.get_session(ns, "missing")

    asyncio.run(go())


def test_an_async_client_over_a_given_client(daemon: Daemon, ns: str) -> None:
    s = make_session(namespace=ns, tokens=600)
    with Client(daemon.address) as sync:
        sync.save_session(s.manifest, s.blobs)

        async def go() -> int:
            c = AsyncClient(client=sync)
            m, _ = await c.get_session(ns, s.session_id)
            return m.generation

        # one Client under both faces: the async face names the version the sync one saved
        assert asyncio.run(go()) == sync.get_session(ns, s.session_id)[0].generation
    with pytest.raises(TypeError, match="not both"):
        AsyncClient(daemon.address, client=sync)
