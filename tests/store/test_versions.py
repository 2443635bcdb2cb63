"""Session versions (issue 19): every stored version has a stamp (``Manifest.generation``); a save
names the version it replaces (its base) and fails whole with FAILED_PRECONDITION when that is no
longer the session's current one, as two daemons sharing Redis already did. Clients carry the base
themselves: the version they last saved or loaded. No base (a brand-new session) keeps last-writer-
wins. Also the clients' addresses: positional, and the default port when none is given."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore.client import Client, config
from kvstore.client.aio import AsyncClient
from kvstore.errors import FailedPrecondition
from kvstore.format.manifest import Retention
from kvstore.store import SessionStore, open_store
from tests.helpers.daemon import Daemon, make_session, running_daemon, status_of, two_daemons
from tests.helpers.store import build_session, save, store_config


# -- the store -----------------------------------------------------------------------------------------
def test_a_save_on_a_stale_base_fails_and_keeps_the_stored_version(sessions: SessionStore) -> None:
    s = build_session("ns", "s", np.arange(100, dtype=np.uint32))
    v1 = save(sessions, s)
    assert v1.generation > 0
    v2 = sessions.commit(dataclasses.replace(s.manifest(metadata={"v": "2"}), generation=v1.generation))
    assert v2.generation > v1.generation
    with pytest.raises(FailedPrecondition, match=f"based on version {v1.generation}, it is at version "
                                                 f"{v2.generation}.*load the session again and retry"):
        sessions.commit(dataclasses.replace(s.manifest(metadata={"v": "3"}), generation=v1.generation))
    with pytest.raises(FailedPrecondition):  # a turn save too
        sessions.save_session("ns", s.layout.layout_id, s.parent(0), 0, s.blobs,
                              dataclasses.replace(s.manifest(metadata={"v": "3"}), generation=v1.generation))
    assert sessions.get("ns", "s") == v2
    touched = sessions.touch("ns", "s", Retention(pinned=True))  # a touch is a version too
    assert touched.generation > v2.generation
    with pytest.raises(FailedPrecondition):
        sessions.commit(dataclasses.replace(s.manifest(), generation=v2.generation))
    assert save(sessions, s).generation > touched.generation  # no base: replaces whatever is stored
    gen = sessions.get("ns", "s").generation
    sessions.delete("ns", "s")
    with pytest.raises(FailedPrecondition, match="deleted since"):  # a turn bringing its chunks again
        sessions.save_session("ns", s.layout.layout_id, s.parent(0), 0, s.blobs,
                              dataclasses.replace(s.manifest(), generation=gen))
    again = save(sessions, s)  # saved again after the delete: a stamp the old incarnation never had
    assert again.generation > gen


def test_versions_survive_a_restart(tmp_path: Path) -> None:
    ss = open_store(store_config(tmp_path))
    s = build_session("ns", "s", np.arange(40, dtype=np.uint32))
    gen = save(ss, s).generation
    ss.close()
    ss = open_store(store_config(tmp_path))
    try:
        assert ss.get("ns", "s").generation == gen
        assert ss.commit(dataclasses.replace(s.manifest(), generation=gen)).generation > gen
    finally:
        ss.close()


# -- clients --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("versions") / "data") as d:
        yield d


def test_two_clients_on_one_daemon_get_the_generation_check(daemon: Daemon) -> None:
    s = make_session(session_id="two", tokens=600)
    with Client(daemon.address, shared_memory=False) as c1, Client(daemon.address) as c2:
        first = c1.save_session(s.manifest, s.blobs).manifest  # c1: no base, a new session
        m, _ = c2.get_session("ns", "two")  # c2 loaded version N
        assert m.generation == first.generation > 0
        second = c1.commit(dataclasses.replace(s.manifest, metadata={"by": "c1"}))  # c1 saved N, saves N+1
        assert second.generation > first.generation
        code, message = status_of(lambda: c2.commit(dataclasses.replace(s.manifest, metadata={"by": "c2"})))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "changed through another client" in message and "load the session again and retry" in message
        code, _ = status_of(lambda: c2.save_session(dataclasses.replace(s.manifest, metadata={"by": "c2"}), s.blobs))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert c1.get_session("ns", "two")[0] == second  # the previous version is intact
        c2.load_session("ns", "two")  # load again, retry: based on the current version
        assert c2.commit(dataclasses.replace(s.manifest, metadata={"by": "c2"})).metadata == {"by": "c2"}
        # a manifest read from one session and committed as another names no base for that one
        other = dataclasses.replace(c2.get_session("ns", "two")[0], session_id="two-copy")
        assert c2.commit(other).session_id == "two-copy"
        assert c2.commit(dataclasses.replace(s.manifest, metadata={"by": "c2 again"}), base=0).generation > 0
        c1.delete_session("ns", "two")
        assert c1.save_session(s.manifest, s.blobs).manifest.generation > 0  # deleted: saved anew, no base


def test_the_async_client_carries_the_base_too(daemon: Daemon) -> None:
    s = make_session(session_id="async", tokens=300, seed=3)

    async def run() -> tuple[grpc.StatusCode, str]:
        async with AsyncClient(daemon.address) as a, AsyncClient(daemon.address) as b:
            await a.save_session(s.manifest, s.blobs)
            await b.get_session("ns", "async")
            await a.commit(dataclasses.replace(s.manifest, metadata={"by": "a"}))
            try:
                await b.commit(dataclasses.replace(s.manifest, metadata={"by": "b"}))
            except FailedPrecondition as e:
                await b.load_session("ns", "async")
                m = await b.commit(dataclasses.replace(s.manifest, metadata={"by": "b"}))
                return grpc.StatusCode.FAILED_PRECONDITION, f"{e} / {m.metadata['by']}"
            return grpc.StatusCode.OK, ""

    code, message = asyncio.run(run())
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "changed through another client" in message
    assert message.endswith(" / b")


@pytest.mark.parametrize(("address", "target"), [
    ("localhost", "localhost:50151"), ("127.0.0.1:7000", "127.0.0.1:7000"), ("[::1]", "[::1]:50151"),
    ("[::1]:7000", "[::1]:7000"), ("::1", "[::1]:50151"), ("unix:/run/kvstore.sock", "unix:/run/kvstore.sock"),
    ("dns:///db.internal:7000", "dns:///db.internal:7000"), (" host.example ", "host.example:50151"),
])
def test_an_address_without_a_port_means_the_default_port(address: str, target: str) -> None:
    assert config.target(address) == target
    with Client(address=address) as c:
        assert c.address == target

    async def async_target() -> str:
        async with AsyncClient(address) as a:  # positionally, too
            return a.address

    assert asyncio.run(async_target()) == target


@pytest.mark.parametrize("address", ["host:", "host:http", "host:0", "host:70000", "[::1", "[::1]7000", ":7000"])
def test_a_malformed_address_is_a_value_error(address: str) -> None:
    with pytest.raises(ValueError, match="malformed daemon address"):
        Client(address=address)


def test_a_positional_address_is_the_address(daemon: Daemon) -> None:
    with Client(daemon.address) as c:
        assert c.address == daemon.address and c.health() == "SERVING"
    with pytest.raises(TypeError, match="given twice"):
        Client("127.0.0.1:1", address="127.0.0.1:2")
    with pytest.raises(TypeError, match="ClientConfig or an address"):
        Client(50151)  # type: ignore[arg-type]


def test_daemons_sharing_sessions_check_the_base_against_the_shared_version(tmp_path: Path, redis_url: str) -> None:
    """A base newer than a daemon's own version (loaded through the other daemon) catches up first
    and goes through; a stale one fails, wherever it was loaded."""
    ns = f"v-{uuid.uuid4().hex[:10]}"
    s = make_session(namespace=ns, session_id="shared", tokens=400, seed=9)
    with two_daemons(tmp_path, "--redis-url", redis_url, "--redis-share-sessions") as (a, b), \
            Client(a.address, shared_memory=False) as x, Client(b.address, shared_memory=False) as y, \
            Client(a.address, shared_memory=False) as z:
        g1 = x.save_session(s.manifest, s.blobs).manifest.generation  # x through A: version 1
        assert y.get_session(ns, "shared")[0].generation == g1  # y through B sees it
        g2 = y.commit(dataclasses.replace(s.manifest, metadata={"by": "y"})).generation  # y saves version 2 on B
        # z, on A, names version 2 (say it loaded it through B): A catches up and takes it
        g3 = z.commit(dataclasses.replace(s.manifest, metadata={"by": "z"}), base=g2).generation
        assert g3 > g2 > g1
        code, message = status_of(lambda: x.commit(dataclasses.replace(s.manifest, metadata={"by": "x"})))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and f"based on version {g1}" in message
        assert y.get_session(ns, "shared")[0].metadata == {"by": "z"}


def test_the_retry_of_a_save_that_was_applied_goes_through(sessions: SessionStore) -> None:
    """A save applied whose answer was lost (a daemon killed after its commit, a dropped connection)
    is retried with the same base: it stores nothing new, so it is no conflict."""
    s = build_session("ns", "retry", np.arange(60, dtype=np.uint32))
    v1 = save(sessions, s)
    turn = dataclasses.replace(s.manifest(metadata={"turn": "2"}), generation=v1.generation)
    v2 = sessions.commit(turn)  # applied; say its answer never reached the client
    again = sessions.commit(turn)  # the retry: same base, same content
    assert again.metadata == {"turn": "2"} and again.generation > v2.generation
    with pytest.raises(FailedPrecondition):  # anything else on that base is still stale
        sessions.commit(dataclasses.replace(turn, metadata={"turn": "3"}))
