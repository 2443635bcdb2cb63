"""SessionStore.save_session: a turn (its new chunks and its manifest) in one durable transaction,
validated whole before anything is written, over a real host + LMDB store in a tmp dir."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest

from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from kvstore.format.keys import ROOT
from kvstore.format.manifest import Manifest, Retention
from kvstore.results import SaveResult
from kvstore.store import SessionStore, open_store
from kvstore.tiers.base import TierError, WriteBatch
from tests.helpers.store import TINY8, Session, build_session, load, save, store_config, token_stream

HOST, SSD = 0, 1
HANG_GUARD_S = 60.0  # only ever reached if something deadlocks


def txns(ss: SessionStore) -> int:
    """LMDB write transactions committed so far (each one fsync)."""
    return ss.store.tiers[SSD].stats(pages=True).pages.last_txnid  # type: ignore[union-attr]


def turn(ss: SessionStore, s: Session, first: int = 0, **manifest_kw: object) -> tuple[Manifest, SaveResult]:
    return ss.save_session(s.namespace, s.layout.layout_id, s.parent(first), first, s.blobs[first:],
                           s.manifest(**manifest_kw))  # type: ignore[arg-type]


def loads_whole(ss: SessionStore, s: Session) -> bool:
    m = ss.get(s.namespace, s.session_id)
    got = list(load(ss, s.namespace, m.chunk_keys))
    return m.chunk_keys == s.keys and m.tail == s.tail and all(b is not None for _, b in got)


def test_a_turn_is_one_transaction(sessions: SessionStore) -> None:
    ids = token_stream(1, 5 * 16 + 3)
    first, second = build_session("ns", "a", ids[: 2 * 16 + 5]), build_session("ns", "a", ids)
    before = txns(sessions)
    m, res = turn(sessions, first)
    assert txns(sessions) == before + 1
    assert (res.keys, res.written) == (list(first.keys), 2)
    assert m.updated_at > 0 and loads_whole(sessions, first)
    before = txns(sessions)
    m2, res = turn(sessions, second, first=2)  # incremental: only the chunks past the saved prefix
    assert txns(sessions) == before + 1
    assert (res.keys, res.written) == (list(second.keys[2:]), 3)
    assert m2.created_at == m.created_at and loads_whole(sessions, second)


def test_a_turn_resending_stored_chunks_writes_only_the_manifest(sessions: SessionStore) -> None:
    s = build_session("ns", "a", token_stream(2, 3 * 16))
    save(sessions, build_session("ns", "b", token_stream(2, 3 * 16)))  # same prefix, other session
    before = sessions.store.tiers[SSD].stats().usage.items
    _, res = turn(sessions, s)
    assert res.written == 0 and sessions.store.tiers[SSD].stats().usage.items == before
    assert loads_whole(sessions, s)


def test_a_turn_with_no_chunks_is_a_commit(sessions: SessionStore) -> None:
    s = build_session("ns", "a", token_stream(3, 2 * 16 + 1))
    sessions.save_chunks("ns", TINY8.layout_id, ROOT, 0, list(s.blobs))
    m, res = sessions.save_session("ns", TINY8.layout_id, s.parent(2), 2, [], s.manifest())
    assert res.keys == [] and m.chunk_keys == s.keys and loads_whole(sessions, s)


def bad_turns(s: Session, other: Session) -> dict[str, tuple[tuple, type[Exception], str]]:
    corrupt = bytearray(s.blobs[1])
    corrupt[300] ^= 1
    lid, m = TINY8.layout_id, s.manifest()
    return {
        "manifest names other chunks": (("ns", lid, ROOT, 0, list(other.blobs), m), InvalidArgument,
                                        "does not name the saved chunks"),
        "corrupt chunk": (("ns", lid, ROOT, 0, [s.blobs[0], bytes(corrupt)], m), InvalidArgument, "chunk 1"),
        "other namespace": (("zz", lid, ROOT, 0, list(s.blobs), m), InvalidArgument, "namespace and layout"),
        "earlier chunk missing": (("ns", lid, s.keys[0], 1, list(s.blobs[1:]), m), FailedPrecondition,
                                  "not stored"),
    }


@pytest.mark.parametrize("case", ["manifest names other chunks", "corrupt chunk", "other namespace",
                                  "earlier chunk missing"])
def test_a_bad_turn_changes_nothing(sessions: SessionStore, case: str) -> None:
    old = build_session("ns", "a", token_stream(4, 16 + 2))
    save(sessions, old)
    s = build_session("ns", "a", token_stream(5, 2 * 16 + 2))
    other = build_session("ns", "x", token_stream(6, 2 * 16 + 2))
    args, error, message = bad_turns(s, other)[case]
    before = (txns(sessions), sessions.store.chunk_keys())
    with pytest.raises(error, match=message):
        sessions.save_session(*args)
    assert (txns(sessions), sessions.store.chunk_keys()) == before
    assert loads_whole(sessions, old)


def test_a_failed_durable_write_keeps_the_previous_version(sessions: SessionStore) -> None:
    old = build_session("ns", "a", token_stream(7, 16 + 2))
    save(sessions, old)
    s = build_session("ns", "a", token_stream(8, 3 * 16 + 2))

    def broken(*_: object) -> None:
        raise TierError("disk on fire")

    sessions.store.tiers[SSD].write = broken  # type: ignore[method-assign]
    with pytest.raises(Unavailable):
        turn(sessions, s)
    assert not any(sessions.store.tiers[HOST].contains_many([k])[0] for k in s.keys)  # nothing left half-saved
    assert loads_whole(sessions, old)


def test_a_turn_in_write_back_mode_is_durable_at_once(tmp_path: Path) -> None:
    ss = open_store(store_config(tmp_path, write_mode="back"))
    s = build_session("ns", "a", token_stream(9, 3 * 16 + 2))
    ss.save_chunks("ns", TINY8.layout_id, ROOT, 0, [s.blobs[0]])  # chunk 0 waits in the fast tier
    ss.save_session("ns", TINY8.layout_id, s.keys[0], 1, list(s.blobs[1:]), s.manifest())
    ss.store.close()
    again = open_store(store_config(tmp_path, write_mode="back"))
    try:
        assert loads_whole(again, s)
    finally:
        again.store.close()


# -- deletes: one transaction per call ----------------------------------------------------------------
def test_deleting_a_session_is_one_transaction(sessions: SessionStore) -> None:
    shared = token_stream(10, 4 * 16 + 1)
    a, b = build_session("ns", "a", shared), build_session("ns", "b", shared[: 2 * 16 + 1])
    save(sessions, a)
    save(sessions, b)
    before = txns(sessions)
    assert sessions.delete("ns", "a") == 2  # only a's own chunks go; the shared two stay for b
    assert txns(sessions) == before + 1
    assert {k for k in a.keys[2:] if sessions.store.contains(k)} == set()
    assert loads_whole(sessions, b)


def test_replacing_a_version_frees_its_chunks_in_the_same_transaction(sessions: SessionStore) -> None:
    old = build_session("ns", "a", token_stream(11, 3 * 16 + 1))
    turn(sessions, old)
    new = build_session("ns", "a", token_stream(12, 2 * 16 + 1))
    before = txns(sessions)
    turn(sessions, new)
    assert txns(sessions) == before + 1
    assert not any(sessions.store.contains(k) for k in old.keys)
    assert loads_whole(sessions, new)


def test_garbage_and_expired_sessions_go_in_one_transaction_each(tmp_path: Path) -> None:
    ss = open_store(store_config(tmp_path))
    for n in range(3):
        s = build_session("ns", f"t{n}", token_stream(20 + n, 2 * 16 + 1))
        ss.clock = lambda: 100.0
        save(ss, s, retention=Retention(ttl_s=10.0))
    orphan = build_session("ns", "o", token_stream(30, 3 * 16))
    ss.save_chunks("ns", TINY8.layout_id, ROOT, 0, list(orphan.blobs))  # never committed
    before = txns(ss)
    assert ss.collect_garbage() == 3
    assert txns(ss) == before + 1
    ss.clock = lambda: 1000.0
    before = txns(ss)
    assert ss.expire() == 3
    assert txns(ss) == before + 1
    assert ss.list_sessions() == [] and ss.store.chunk_keys() == set()
    ss.store.close()


# -- locks ---------------------------------------------------------------------------------------------
def test_reads_never_wait_behind_a_saves_durable_commit(sessions: SessionStore) -> None:
    """A save parked inside its durable commit (where the fsync happens) holds no lock that a load,
    a lookup, a listing or a pin needs."""
    old = build_session("ns", "old", token_stream(40, 2 * 16 + 1))
    save(sessions, old)
    ssd = sessions.store.tiers[SSD]
    inside, release = threading.Event(), threading.Event()
    real_write = ssd.write

    def parked_write(batch: WriteBatch) -> int:
        inside.set()
        release.wait()
        return real_write(batch)

    ssd.write = parked_write  # type: ignore[method-assign]
    saver = threading.Thread(target=turn, args=(sessions, build_session("ns", "new", token_stream(41, 3 * 16))))
    saver.start()
    try:
        assert inside.wait(HANG_GUARD_S)
        reader = threading.Thread(target=lambda: (
            loads_whole(sessions, old),
            sessions.lookup("ns", TINY8.layout_id, old.token_ids),
            sessions.list_sessions("ns"),
        ))
        reader.start()
        reader.join(HANG_GUARD_S)  # a hang guard, not a timing: the reader needs no lock the saver holds
        assert not reader.is_alive(), "a read waited behind a save's durable commit"
    finally:
        release.set()
        saver.join(HANG_GUARD_S)
    assert loads_whole(sessions, build_session("ns", "new", token_stream(41, 3 * 16)))


def test_concurrent_turns_and_loads_over_a_full_fast_tier(tmp_path: Path) -> None:
    """Savers and loaders at once, with the host tier small enough to evict all the time: no
    deadlock between the tiers' locks, and every session loads whole afterwards."""
    chunk_bytes = len(build_session("ns", "x", token_stream(0, 16)).blobs[0])
    ss = open_store(store_config(tmp_path, host_capacity=6 * chunk_bytes))
    made = [[build_session("ns", f"w{w}-{n}", token_stream(100 * w + n, 3 * 16 + 1)) for n in range(4)]
            for w in range(4)]
    errors: list[BaseException] = []

    def work(sessions_of_one_worker: list[Session]) -> None:
        try:
            for s in sessions_of_one_worker:
                turn(ss, s)
                for other in made[0][:2]:
                    with contextlib.suppress(NotFound):  # not saved yet by worker 0
                        loads_whole(ss, other)
        except BaseException as e:  # reported below, with the thread's traceback
            errors.append(e)

    threads = [threading.Thread(target=work, args=(m,)) for m in made]
    for th in threads:
        th.start()
    for th in threads:
        th.join(HANG_GUARD_S)
    assert not any(th.is_alive() for th in threads), "deadlock"
    assert errors == []
    assert all(loads_whole(ss, s) for m in made for s in m)
    ss.store.close()


# -- group commit --------------------------------------------------------------------------------------
def test_concurrent_turns_share_one_transaction_and_fail_alone(sessions: SessionStore) -> None:
    """While one turn commits, four more queue: they go in one transaction (one fsync) together.
    One of them names a chunk nobody stored: it fails alone; a second turn of one session waits
    for the next group."""
    ssd = sessions.store.tiers[SSD]
    inside, release = threading.Event(), threading.Event()
    real_write = ssd.write

    def first_write_parks(batch: WriteBatch) -> int:
        if not inside.is_set():
            inside.set()
            release.wait()
        return real_write(batch)

    ssd.write = first_write_parks  # type: ignore[method-assign]
    first = build_session("ns", "first", token_stream(50, 2 * 16 + 1))
    good = [build_session("ns", f"g{n}", token_stream(51 + n, 2 * 16 + 1)) for n in range(2)]
    again = build_session("ns", "g0", token_stream(60, 3 * 16 + 1))  # g0's next version
    bad = build_session("ns", "bad", token_stream(61, 2 * 16 + 1))
    outcome: dict[str, object] = {}

    def run(name: str, s: Session, first_index: int = 0) -> None:
        try:
            outcome[name] = turn(sessions, s, first_index)
        except Exception as e:  # the error this caller gets
            outcome[name] = e

    threads = [threading.Thread(target=run, args=("first", first))]
    threads[0].start()
    assert inside.wait(HANG_GUARD_S)
    before = txns(sessions)
    threads += [threading.Thread(target=run, args=(f"g{n}", s)) for n, s in enumerate(good)]
    threads += [threading.Thread(target=run, args=("bad", bad, 1)),  # chunk 0 was never stored
                threading.Thread(target=run, args=("again", again))]
    for th in threads[1:]:
        th.start()
    guard = threading.Event()
    while len(sessions._turns._queue) < 4:  # all four queued behind the parked commit
        assert not guard.wait(0.01) and all(th.is_alive() for th in threads[1:]), outcome
    release.set()
    for th in threads:
        th.join(HANG_GUARD_S)
    assert isinstance(outcome["bad"], FailedPrecondition)
    assert all(isinstance(outcome[n], tuple) for n in ("first", "g0", "g1", "again"))
    # first's own transaction, then one for g0, g1 and bad's failure, then g0's second version
    assert txns(sessions) == before + 3
    assert loads_whole(sessions, first) and loads_whole(sessions, good[1])
    assert sessions.get("ns", "g0").chunk_keys in (good[0].keys, again.keys)


def test_a_turn_on_a_grown_session_still_finds_a_lost_chunk_of_its_prefix(sessions: SessionStore) -> None:
    """A turn checks owner and place only of the chunks it changes, but whether every chunk it names is
    still stored of all of them: a prefix chunk lost from the durable tier since (a damaged copy the
    store deleted) fails the turn instead of being named by a new version."""
    ids = token_stream(3, 5 * 16 + 3)
    first, second = build_session("ns", "a", ids[: 3 * 16]), build_session("ns", "a", ids)
    turn(sessions, first)
    for tier in sessions.store.tiers:
        tier.delete_many([first.keys[1]])
    with pytest.raises(FailedPrecondition, match="1 referenced chunks are not stored"):
        turn(sessions, second, first=3)
    assert sessions.get("ns", "a").chunk_keys == first.keys


def test_a_turn_that_reorders_the_prefix_is_checked_from_where_it_differs(sessions: SessionStore) -> None:
    ids = token_stream(4, 4 * 16)
    s = build_session("ns", "a", ids)
    turn(sessions, s)
    swapped = list(s.keys)
    swapped[1], swapped[2] = swapped[2], swapped[1]
    m = s.manifest()
    bad = Manifest(m.session_id, m.namespace, m.layout_id, m.token_count, m.chunk_tokens, tuple(swapped), m.tail,
                   m.last_token_ids)
    with pytest.raises(InvalidArgument, match=r"chunk 1 .* is out of place"):
        sessions.commit(bad)
    assert sessions.get("ns", "a").chunk_keys == s.keys
