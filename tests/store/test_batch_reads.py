"""A load's batch read (SessionStore.read, kvstore/store/tiered/reads.py) serves exactly what the windowed
read a stream makes (SessionStore.windows, a batch per window) serves: the same verified bytes, the same
misses, a damaged copy dropped from its tier and read from the next one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import lmdb
import pytest

from kvstore.errors import InvalidArgument
from kvstore.store import SessionStore, open_store
from kvstore.tiers.base import Views
from kvstore.tiers.ssd.tier import DB_NAME
from tests.helpers.store import SSD_HEADER, Session, build_session, check_chunk, load, save, store_config, token_stream

HOST, SSD = 0, 1


def session(sid: str, tokens: int, seed: int = 0, ns: str = "ns") -> Session:
    return build_session(ns, sid, token_stream(seed, tokens))


def read_all(ss: SessionStore, ns: str, keys: list[bytes]) -> list[bytes | None]:
    with ss.read(ns, keys) as got:
        return [None if v is None else bytes(v) for v in got]


def load_all(ss: SessionStore, ns: str, keys: list[bytes]) -> list[bytes | None]:
    return [v for _, v in load(ss, ns, keys)]


@pytest.mark.parametrize("zstd_level", [0, 3])  # raw records are views into the map; compressed ones decoded
def test_read_serves_what_load_serves(tmp_path: Path, zstd_level: int) -> None:
    ss = open_store(store_config(tmp_path, zstd_level=zstd_level))
    try:
        s = session("a", 16 * 12 + 5)
        save(ss, s)
        for k in s.keys[::3]:  # some chunks on the ssd tier only, the rest in memory too
            assert ss.store.evict([k], "ssd", "a test") == 1
        keys = list(s.keys)
        got = read_all(ss, "ns", keys)
        assert got == load_all(ss, "ns", keys)
        for i, (k, blob) in enumerate(zip(keys, got)):
            check_chunk(blob, s.layout, k, s.chunk_ids(i))
        ss.store.settle()  # promoted behind the load
        assert all(ss.store.where(k)[0] == "host" for k in keys)  # what the ssd tier served was promoted
        assert read_all(ss, "other", keys) == [None] * len(keys)  # another namespace's: a miss, like absent
        assert read_all(ss, "ns", [bytes(16), *keys[:2]])[0] is None
    finally:
        ss.close()


def test_promotion_runs_behind_the_load_and_evict_waits_for_it(tmp_path: Path) -> None:
    ss = open_store(store_config(tmp_path, zstd_level=3))
    try:
        s = session("a", 16 * 8)
        save(ss, s)
        keys = list(s.keys)
        assert ss.evict("ns", "a", "ssd") == len(keys)
        hits = ss.store.counters["ssd"].hits
        with ss.read("ns", keys) as got:
            assert all(g is not None for g in got)
            assert not any(ss.store.where(k)[0] == "host" for k in keys)  # nothing copied up inside the load
        assert ss.evict("ns", "a", "ssd") == len(keys)  # waits for the promotion, then moves it all down again
        assert ss.store.counters["ssd"].hits == hits + len(keys)  # the second read behind is not a hit
        assert read_all(ss, "ns", keys) == list(s.blobs)
    finally:
        ss.close()


def test_a_damaged_copy_is_dropped_and_the_next_tier_serves(tmp_path: Path) -> None:
    cfg = store_config(tmp_path)
    ss = open_store(cfg)
    s = session("a", 16 * 6)
    save(ss, s)
    keys = list(s.keys)
    bad = bytearray(s.blobs[1])
    bad[200] ^= 1
    ss.store.tiers[HOST].put_many([(keys[1], bytes(bad))])  # the memory copy damaged: the ssd one is served
    assert read_all(ss, "ns", keys) == list(s.blobs)
    assert ss.store.counters["host"].verify_failures == 1
    ss.store.settle()
    assert ss.store.where(keys[1]) == ["host", "ssd"]  # the good copy promoted back
    ss.close()

    path = str(Path(cfg.tiers[SSD].path))  # type: ignore[attr-defined]
    env = lmdb.open(path, max_dbs=8)
    with env.begin(write=True, db=env.open_db(DB_NAME)) as txn:
        record = bytearray(txn.get(keys[2]))
        record[SSD_HEADER.size + 300] ^= 0x40  # inside the chunk: its checksum fails
        txn.put(keys[2], bytes(record))
        txn.put(keys[3], b"\x07garbage")  # damaged framing: unreadable
        txn.put(keys[4], txn.get(keys[0]))  # a valid chunk under another chunk's key
    env.close()
    ss = open_store(cfg)  # a fresh host tier: every read comes from the ssd tier
    try:
        got = read_all(ss, "ns", keys)
        assert [g is None for g in got] == [False, False, True, True, True, False]
        assert got[0] == s.blobs[0] and got[5] == s.blobs[5]
        assert ss.store.counters["ssd"].verify_failures == 3
        assert not any(ss.store.where(k) for k in keys[2:5])  # dropped: never served, gone from the tier
        assert load_all(ss, "ns", keys) == got
    finally:
        ss.close()


@pytest.mark.parametrize("bad", [b"", b"x" * 65536], ids=["0 bytes", "65,536 bytes"])
def test_the_stores_read_entry_refuses_a_key_no_tier_can_hold(tmp_path: Path, bad: bytes) -> None:
    """Issue 28: an in-process read (the store's own entry, not a front end's) of a 0-byte or a 65,536-byte
    key is InvalidArgument naming it, before any tier is asked (a tier's guard would be a ValueError:
    INTERNAL); a key of another length names nothing stored and is a miss; what is stored is unaffected."""
    ss = open_store(store_config(tmp_path))
    try:
        s = session("a", 16 * 4)
        save(ss, s)
        keys = [*s.keys[:2], bad]
        hits = {n: (c.hits, c.errors) for n, c in ss.store.counters.items()}
        message = rf"keys\[2\] is {len(bad)} bytes long; a key is 1 to 256 bytes"
        with pytest.raises(InvalidArgument, match=message):
            read_all(ss, "ns", keys)
        with pytest.raises(InvalidArgument, match=message):
            load_all(ss, "ns", keys)
        with pytest.raises(InvalidArgument, match=message):
            ss.lookup_keys("ns", keys)
        with pytest.raises(InvalidArgument, match=message):
            ss.held_in_memory("ns", keys, 1 << 20)
        assert {n: (c.hits, c.errors) for n, c in ss.store.counters.items()} == hits  # no tier was asked
        assert read_all(ss, "ns", [*s.keys[:2], b"short"]) == [*s.blobs[:2], None]
        assert read_all(ss, "ns", list(s.keys)) == list(s.blobs)
    finally:
        ss.close()


def test_a_stream_holds_no_read_open_while_its_caller_drains_and_keeps_its_keys_pinned(tmp_path: Path) -> None:
    """Issue 28: the stream's answer is read in windows (SessionStore.windows), each a batch read whose read
    (the ssd tier's read transaction, its views) has ended before its messages are handed on; the keys
    stay pinned from the first window to the last, and closing the stream early unpins them."""
    ss = open_store(store_config(tmp_path, promote_on_read=False))  # no second read behind, on another thread
    try:
        s = session("a", 16 * 40)  # 40 chunks: several windows
        save(ss, s)
        keys = list(s.keys)
        assert ss.evict("ns", "a", "ssd") == len(keys)  # every read goes to the ssd tier's memory map
        ssd = ss.store.tiers[SSD]
        real, open_reads, windows = ssd.read_views, [0], []

        @contextlib.contextmanager
        def counted(asked: Sequence[bytes]) -> Iterator[Views]:
            open_reads[0] += 1
            try:
                with real(asked) as views:
                    yield views
            finally:
                open_reads[0] -= 1

        ssd.read_views = counted  # type: ignore[method-assign]

        def copies(start: int, values: list[bytes | memoryview | None]) -> list[tuple[int, bytes | None]]:
            assert open_reads[0] == 1  # inside the window's read
            windows.append(start)
            return [(start + i, None if v is None else bytes(v)) for i, v in enumerate(values)]

        got = []
        for item in ss.windows("ns", keys, copies):
            assert open_reads[0] == 0  # handed on with no read open
            assert all(k in ss.store._pins for k in keys)  # pinned across the windows
            got.append(item)
        assert [b for _, b in got] == list(s.blobs) and [i for i, _ in got] == list(range(len(keys)))
        assert len(windows) > 1
        assert not any(k in ss.store._pins for k in keys)
        stream = ss.windows("ns", keys, copies)
        next(stream)
        stream.close()  # a caller gone mid-stream
        assert not any(k in ss.store._pins for k in keys) and open_reads[0] == 0
    finally:
        ss.close()
