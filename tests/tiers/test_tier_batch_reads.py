"""Batch reads (``Tier.read_views``): the same values as ``get_many`` on every tier; on the ssd tier,
one read transaction, raw records handed out as views into the memory map, compressed ones
decoded, and a damaged record an
unreadable one, never data: real LMDB, with chunk blobs checked by kvstore.format.chunk_batch."""

from __future__ import annotations

import random
from pathlib import Path

import lmdb
import numpy as np
import pytest
import zstandard

from kvstore.format import chunk, chunk_batch
from kvstore.format.chunk_batch import Expected, Status
from kvstore.format.keys import chain_keys
from kvstore.format.layout import get_layout
from kvstore.tiers import SsdTierConfig, Tier
from kvstore.tiers.ssd.record import HEADER, RAW, ZSTD
from kvstore.tiers.ssd.tier import DB_NAME, SsdTier

LAYOUT = get_layout("tiny-16")
CT, N, NS = 16, 8, "ns"


def _values() -> dict[bytes, bytes]:
    rng = random.Random(7)
    return {bytes([i]) * 16: (bytes(range(256)) * 40 if i % 2 else rng.randbytes(1000 * (i + 1))) for i in range(6)}


def test_read_views_agree_with_get_many(tier: Tier) -> None:
    values = _values()
    tier.put_many(values.items())
    keys = [*values, b"absent" * 2, next(iter(values))]  # a miss, and a key asked for twice
    want = [None if v is None else bytes(v) for v in tier.get_many(keys)]
    with tier.read_views(keys) as views:
        assert [None if v is None else bytes(v) for v in views.values] == want
        assert views.unreadable == frozenset()


# -- the ssd tier ------------------------------------------------------------------------------------------
def _session() -> tuple[list[bytes], Expected]:
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 50_000, N * CT)
    keys = chain_keys(LAYOUT.layout_id, NS, ids, CT)
    blobs = []
    for i, k in enumerate(keys):
        ents = {}
        for c in LAYOUT.caches:
            n = c.entries_for(CT)
            # random codes; scales from a few values (so zstd shrinks them, as it does real E4M3 scales)
            ents[c.name] = chunk.Entries(rng.integers(0, 256, (n, c.code_bytes), dtype=np.uint8),
                                         rng.integers(50, 54, (n, c.scale_bytes), dtype=np.uint8))
        blobs.append(chunk.encode(LAYOUT, key=k, start=i * CT, token_ids=ids[i * CT : (i + 1) * CT], entries=ents))
    return blobs, Expected.chain(keys, LAYOUT.layout_id, NS, CT)


BLOBS, EXPECTED = _session()
SIZE = len(BLOBS[0])
OFFSETS = [i * SIZE for i in range(N)]
CODECS = {"raw": {}, "zstd": {"zstd_level": 1}, "transformed": {"compact_records": True}}  # raw: the default


def _open(path: Path, **kwargs: object) -> SsdTier:
    return SsdTier(SsdTierConfig(path=str(path), **kwargs), compressible_from=chunk.compressible_offset)  # type: ignore[arg-type]


def _flags(path: Path) -> set[int]:
    env = lmdb.open(str(path), max_dbs=8, readonly=True)
    with env.begin(db=env.open_db(DB_NAME, create=False)) as txn:
        flags = {bytes(r)[0] for _, r in txn.cursor()}
    env.close()
    return flags


def _poke(path: Path, records: dict[bytes, bytes]) -> None:
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True, db=env.open_db(DB_NAME)) as txn:
        for key, record in records.items():
            txn.put(key, record)
    env.close()


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_a_session_read_in_one_batch_checks_and_copies_whole(tmp_path: Path, codec: str) -> None:
    with _open(tmp_path, **CODECS[codec]) as tier:
        tier.put_many(zip(EXPECTED.keys, BLOBS))
    assert _flags(tmp_path) == {"raw": {RAW}, "zstd": {ZSTD}, "transformed": {2}}[codec]
    with _open(tmp_path, **CODECS[codec]) as tier:
        dest = np.zeros(N * SIZE, np.uint8)
        with tier.read_views(EXPECTED.keys) as views:
            if codec == "raw":  # views into the memory map, no copy
                assert all(isinstance(v, memoryview) and v.readonly for v in views.values)
            r = chunk_batch.check(views.values, EXPECTED, dest=dest.data, dest_offsets=OFFSETS)
        assert r.all_valid and dest.tobytes() == b"".join(BLOBS)


GOOD_KEY = b"g" * 16
DAMAGED = {
    "short": b"\x01\x02",
    "bad flag": HEADER.pack(7, 4, 4) + b"abcd",
    "raw length": HEADER.pack(RAW, SIZE, SIZE) + b"x" * 50,
    "zstd garbage": HEADER.pack(ZSTD, SIZE, 0) + b"garbage!" * 10,
    "zstd length": HEADER.pack(ZSTD, SIZE, 0) + zstandard.compress(b"a" * 1000),
    "zstd bomb": HEADER.pack(ZSTD, SIZE, 0) + zstandard.compress(bytes(50 << 20)),
}


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_damaged_records_are_unreadable_and_the_rest_is_served(tmp_path: Path, codec: str) -> None:
    with _open(tmp_path, **CODECS[codec]) as tier:
        tier.put_many(zip(EXPECTED.keys, BLOBS))
    damaged = dict(zip(EXPECTED.keys[1::2], DAMAGED.values()))  # chunks 1, 3, 5, 7
    _poke(tmp_path, damaged)
    bad = {i for i, k in enumerate(EXPECTED.keys) if k in damaged}
    with _open(tmp_path, **CODECS[codec]) as tier:
        dest = np.full(N * SIZE, 0xAB, np.uint8)
        with tier.read_views(EXPECTED.keys) as views:
            assert views.unreadable == bad
            assert [v is None for v in views.values] == [i in bad for i in range(N)]
            r = chunk_batch.check(views.values, EXPECTED, dest=dest.data, dest_offsets=OFFSETS)
        assert r.failures() == {i: Status.MISSING for i in bad}
        for i in range(N):
            slot = dest[i * SIZE : (i + 1) * SIZE]
            assert (slot == 0xAB).all() if i in bad else slot.tobytes() == BLOBS[i]


def test_a_raw_record_with_damaged_contents_is_served_as_stored_and_fails_its_check(tmp_path: Path) -> None:
    """The tier checks its framing only; the chunk's checksum catches the rest: a miss, never wrong data."""
    with _open(tmp_path, zstd_level=0) as tier:
        tier.put_many(zip(EXPECTED.keys, BLOBS))
    flipped = bytearray(BLOBS[2])
    flipped[SIZE // 2] ^= 0x10
    _poke(tmp_path, {EXPECTED.keys[2]: HEADER.pack(RAW, SIZE, SIZE) + bytes(flipped)})
    with _open(tmp_path, zstd_level=0) as tier, tier.read_views(EXPECTED.keys) as views:
        assert views.unreadable == frozenset() and bytes(views.values[2]) == bytes(flipped)  # type: ignore[arg-type]
        assert chunk_batch.check(views.values, EXPECTED).failures() == {2: Status.CHECKSUM}


def test_a_key_the_tier_holds_but_cannot_find_is_unreadable(tmp_path: Path) -> None:
    with _open(tmp_path) as tier:
        tier.put_many(zip(EXPECTED.keys, BLOBS))
        # what a damaged branch page does: the key is in the tier's index, a lookup misses it
        # (deleted behind the tier's back, through its own environment: one per process)
        with tier._env.begin(write=True, db=tier._db) as txn:
            txn.delete(EXPECTED.keys[4])
        with tier.read_views(EXPECTED.keys) as views:
            assert views.unreadable == {4} and views.values[4] is None


def test_views_are_a_snapshot_while_writers_go_on(tmp_path: Path) -> None:
    with _open(tmp_path, zstd_level=0) as tier:
        tier.put_many(zip(EXPECTED.keys, BLOBS))
        with tier.read_views(EXPECTED.keys) as views:
            tier.put_many([(EXPECTED.keys[0], BLOBS[1])])  # a commit while the batch's transaction is open
            tier.delete_many([EXPECTED.keys[3]])
            assert chunk_batch.check(views.values, EXPECTED).all_valid
        assert tier.get_many([EXPECTED.keys[0]])[0] == BLOBS[1] and tier.get_many([EXPECTED.keys[3]])[0] is None
