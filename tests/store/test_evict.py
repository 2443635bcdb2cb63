"""SessionStore.evict counts what really moved: chunks already in the tier are left alone and not
counted (nor counted as demotions), a move up is refused before anything moves, and a repeated
evict moves nothing. Real stores (host memory + LMDB, and a Redis tier below them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.errors import InvalidArgument
from kvstore.store import SessionStore, open_store
from tests.helpers.store import build_session, load, save, store_config, token_stream

CT = 16


@pytest.fixture
def sessions(tmp_path: Path) -> Iterator[SessionStore]:
    ss = open_store(store_config(tmp_path))
    yield ss
    ss.close()


def demotions(ss: SessionStore) -> dict[str, int]:
    return {name: c.demotions for name, c in ss.store.counters.items()}


def tiers_of(ss: SessionStore, keys: tuple[bytes, ...]) -> list[str]:
    return [ss.store.where(k)[0] for k in keys]


def test_a_repeated_evict_moves_nothing_and_counts_nothing(sessions: SessionStore) -> None:
    s = build_session("ns", "s", token_stream(0, 3 * CT + 5))
    save(sessions, s)
    assert sessions.evict("ns", "s", "host") == 0  # already there: the host tier is the fastest holder
    assert demotions(sessions) == {"host": 0, "ssd": 0}
    assert sessions.evict("ns", "s", "ssd") == 3
    assert demotions(sessions) == {"host": 3, "ssd": 0}
    assert sessions.evict("ns", "s", "ssd") == 0
    assert demotions(sessions) == {"host": 3, "ssd": 0}
    assert tiers_of(sessions, s.keys) == ["ssd"] * 3


def test_a_move_up_is_refused_and_moves_nothing(sessions: SessionStore) -> None:
    s = build_session("ns", "s", token_stream(1, 4 * CT))
    save(sessions, s)
    sessions.evict("ns", "s", "ssd")
    list(load(sessions, "ns", s.keys[:1]))  # chunk 0 read back: promoted to host memory again
    assert tiers_of(sessions, s.keys) == ["host", "ssd", "ssd", "ssd"]
    before = demotions(sessions)
    with pytest.raises(InvalidArgument, match=r"evict moves chunks down; use prefetch to move them up \(3 of 4 "
                                              r"chunks of ns/s are below host: ssd 3\)"):
        sessions.evict("ns", "s", "host")
    assert tiers_of(sessions, s.keys) == ["host", "ssd", "ssd", "ssd"]  # nothing moved, nothing counted
    assert demotions(sessions) == before
    assert sessions.evict("ns", "s", "ssd") == 1  # the one chunk above ssd; the other three were there


def test_chunks_shared_with_another_session_count_where_they_are(sessions: SessionStore) -> None:
    ids = token_stream(2, 4 * CT)
    a, b = build_session("ns", "a", ids[: 2 * CT]), build_session("ns", "b", ids)
    save(sessions, a)
    save(sessions, b)
    assert sessions.evict("ns", "a", "ssd") == 2
    assert sessions.evict("ns", "b", "ssd") == 2  # its first two chunks are a's, already on ssd


def test_below_the_durable_tier_its_copy_stays_and_a_repeat_moves_nothing(tmp_path: Path, redis_url: str) -> None:
    ss = open_store(store_config(tmp_path, redis_url=redis_url, redis_namespace=f"evict-{tmp_path.name}"))
    try:
        s = build_session("ns", "s", token_stream(3, 2 * CT))
        save(ss, s)
        assert ss.evict("ns", "s", "redis") == 2
        assert [ss.store.where(k) for k in s.keys] == [["ssd", "redis"]] * 2  # the durable copy is kept
        before = demotions(ss)
        assert ss.evict("ns", "s", "redis") == 0
        assert demotions(ss) == before
    finally:
        ss.close()


def test_a_chunk_a_load_holds_stays_and_the_next_evict_moves_it(sessions: SessionStore) -> None:
    s = build_session("ns", "s", token_stream(4, 3 * CT))
    save(sessions, s)
    sessions.store.pin(s.keys[:1])  # what a load in progress does to the chunks it reads
    try:
        assert sessions.evict("ns", "s", "ssd") == 2
        assert tiers_of(sessions, s.keys) == ["host", "ssd", "ssd"]
    finally:
        sessions.store.unpin(s.keys[:1])
    assert sessions.evict("ns", "s", "ssd") == 1
    assert demotions(sessions) == {"host": 3, "ssd": 0}
