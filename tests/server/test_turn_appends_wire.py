"""Turn saves through a real daemon: a session grown turn by turn goes as appends (only the new keys on
the wire, the version, not the manifest, in the answer), reads back whole after a restart, a whole
manifest save still works, a stale base is FAILED_PRECONDITION, and a daemon SIGKILLed mid-append
leaves the old version or the new one, never a mix."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import Client
from kvstore.errors import FailedPrecondition, KvstoreError
from kvstore.server.process import DaemonProcess
from kvstore.v1 import kvstore_pb2 as pb
from tests.helpers.store import CHUNK_TOKENS, Session, build_session, token_stream

PER = 2  # chunks a turn
ARGS = ["--store-chunk-tokens", str(CHUNK_TOKENS)]


def grown(turns: int, sid: str = "a") -> list[Session]:
    ids = token_stream(11, turns * PER * CHUNK_TOKENS + 3)
    return [build_session("ns", sid, ids[: (t + 1) * PER * CHUNK_TOKENS + 3]) for t in range(turns)]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path / "data", ARGS).start()
    try:
        yield d
    finally:
        if not d.exited():
            d.stop()


def recorded(client: Client) -> list[tuple[pb.SaveHeader, pb.SaveChunksResponse]]:
    """Every save header the client sends and the daemon's answer to it."""
    seen: list[tuple[pb.SaveHeader, pb.SaveChunksResponse]] = []
    send = client._save

    def spy(header: pb.SaveHeader, blobs: Any) -> pb.SaveChunksResponse:
        r = send(header, blobs)
        seen.append((header, r))
        return r

    client._save = spy  # type: ignore[method-assign]
    return seen


def test_turns_go_as_appends_and_read_back_whole_after_a_restart(daemon: DaemonProcess, tmp_path: Path) -> None:
    versions = grown(12)
    with Client(daemon.address) as c:
        seen = recorded(c)
        for prev, s in zip([None, *versions], versions):
            n = len(s.keys) - (len(prev.keys) if prev is not None else 0)
            got = c.save_session(s.manifest(), list(s.blobs[-n:]))
            assert got.manifest is not None and got.manifest.chunk_keys == s.keys
        whole, *appends = seen
        assert whole[0].HasField("commit") and not whole[0].HasField("append")
        for header, answer in appends:  # only what the turn adds travels, both ways
            assert header.HasField("append") and not header.HasField("commit")
            assert len(header.append.chunk_keys) == PER
            assert not answer.HasField("session") and answer.generation and answer.chunk_count
        sizes = [h.ByteSize() for h, _ in appends]
        # the turn's size, not the session's: flat while the session grew 12-fold (the ids' varints aside)
        assert max(sizes[2:]) - min(sizes[2:]) <= 32
        assert [a.chunk_count for _, a in appends] == [len(s.keys) for s in versions[1:]]
        last = c.get_session("ns", "a")[0]
    daemon.stop()
    d2 = DaemonProcess(tmp_path / "data", ARGS).start()
    try:
        with Client(d2.address) as c:
            m, pairs = c.load_session("ns", "a")
            assert (m.chunk_keys, m.tail, m.token_count, m.generation) == (last.chunk_keys, last.tail,
                                                                         last.token_count, last.generation)
            assert {i: bytes(b) for i, b in pairs} == dict(enumerate(versions[-1].blobs))
    finally:
        d2.stop()


def test_a_whole_save_still_works_and_a_stale_base_is_failed_precondition(daemon: DaemonProcess) -> None:
    a, b, c3 = grown(3)
    with Client(daemon.address) as one, Client(daemon.address) as two:
        m = one.save_session(a.manifest(), list(a.blobs)).manifest
        assert m is not None
        two.get_session("ns", "a")
        two.save_session(b.manifest(), list(b.blobs[len(a.keys):]))  # an append through another client
        seen = recorded(one)
        with pytest.raises(FailedPrecondition, match="changed through another client"):
            one.save_session(c3.manifest(), list(c3.blobs[len(a.keys):]), base=m.generation)
        assert seen == [] or seen[0][0].HasField("append")
        got = two.get_session("ns", "a")[0]
        assert got.chunk_keys == b.keys  # unchanged by the refused append
        # a whole manifest with no base (another client, the Node client): replaces whatever is stored
        fresh = Client(daemon.address)
        try:
            seen = recorded(fresh)
            m3 = fresh.save_session(c3.manifest(), list(c3.blobs), base=0).manifest
            assert seen[0][0].HasField("commit") and seen[0][1].HasField("session")
            assert m3 is not None and m3.chunk_keys == c3.keys
        finally:
            fresh.close()


def test_a_daemon_killed_mid_append_keeps_the_old_version_or_the_new(daemon: DaemonProcess, tmp_path: Path) -> None:
    versions = grown(60)
    acked: list[int] = []  # chunk counts of acknowledged versions
    stop = threading.Event()

    def writer() -> None:
        with Client(daemon.address, retries=0) as c:
            prev = 0
            for s in versions:
                if stop.is_set():
                    return
                try:
                    c.save_session(s.manifest(), list(s.blobs[prev:]))
                except KvstoreError:
                    return
                prev = len(s.keys)
                acked.append(prev)

    t = threading.Thread(target=writer)
    t.start()
    while len(acked) < 25 and t.is_alive():
        threading.Event().wait(0.005)
    daemon.kill()
    stop.set()
    t.join(timeout=60)
    d2 = DaemonProcess(tmp_path / "data", ARGS).start()
    try:
        with Client(d2.address) as c:
            m, pairs = c.load_session("ns", "a")
            n = len(m.chunk_keys)
            assert n in (acked[-1], acked[-1] + PER), (n, acked[-1])  # the last acknowledged, or the one in flight
            s = versions[n // PER - 1]
            assert (m.chunk_keys, m.tail, m.token_count) == (s.keys, s.tail, len(s.token_ids))
            assert len(dict(pairs)) == n  # every chunk it names is there
    finally:
        d2.stop()
