"""SSD tier specifics: reopening, compression framing, map growth, durability, corruption."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import lmdb
import pytest
import zstandard

from kvstore.tiers import SsdTierConfig, TierError
from kvstore.tiers.ssd.migrate import LegacyMeta
from kvstore.tiers.ssd.record import HEADER, RAW, ZSTD
from kvstore.tiers.ssd.tier import DB_NAME, SsdTier

ROOT = Path(__file__).resolve().parents[2]
COMPRESSIBLE = bytes(range(256)) * 1024  # 256 KiB that zstd shrinks a lot


def _random(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _open(path: Path, **kwargs: object) -> SsdTier:
    return SsdTier(SsdTierConfig(path=str(path), **kwargs))  # type: ignore[arg-type]


def _records(path: Path) -> dict[bytes, bytes]:
    """The raw stored records, read with lmdb directly (the tier must be closed)."""
    env = lmdb.open(str(path), max_dbs=8, readonly=True)
    with env.begin(db=env.open_db(DB_NAME, create=False)) as txn:
        records = dict(txn.cursor())
    env.close()
    return records


def _poke(path: Path, key: bytes, record: bytes) -> None:
    """Write a record behind the tier's back (the tier must be closed)."""
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True, db=env.open_db(DB_NAME)) as txn:
        txn.put(key, record)
    env.close()


def test_reopen_finds_everything_with_the_same_usage(tmp_path: Path) -> None:
    values = {b"random": _random(1, 100_000), b"zip": COMPRESSIBLE, b"empty": b"", b"m:s1": b"manifest"}
    with _open(tmp_path, capacity_bytes=1 << 30) as tier:
        tier.put_many(values.items())
        tier.put_many([(b"gone", b"deleted before close")])
        tier.delete_many([b"gone"])
        before = tier.stats().usage
        sizes = {key: tier.size_of(key) for key in values}
    with _open(tmp_path, capacity_bytes=1 << 30) as tier:
        assert tier.stats().usage == before
        assert before.items == 4 and before.raw_bytes == sum(map(len, values.values()))
        assert set(tier.keys()) == set(values)
        assert {key: tier.size_of(key) for key in values} == sizes
        for key, value in values.items():
            assert tier.get_many([key])[0] == value


def test_compression_shrinks_compressible_and_stores_random_raw(tmp_path: Path) -> None:
    noise = _random(2, len(COMPRESSIBLE))
    with _open(tmp_path, zstd_level=3) as tier:
        tier.put_many([(b"zip", COMPRESSIBLE)])
        tier.put_many([(b"noise", noise)])
        assert tier.size_of(b"zip") < len(COMPRESSIBLE) // 10  # type: ignore[operator]
        assert tier.size_of(b"noise") == len(noise) + HEADER.size
        usage = tier.stats().usage
        assert usage.raw_bytes == 2 * len(COMPRESSIBLE)
        assert usage.used_bytes == tier.size_of(b"zip") + len(noise) + HEADER.size  # type: ignore[operator]
        assert tier.get_many([b"zip"])[0] == COMPRESSIBLE and tier.get_many([b"noise"])[0] == noise
    records = _records(tmp_path)
    assert HEADER.unpack_from(records[b"zip"]) == (ZSTD, len(COMPRESSIBLE), 0)
    assert HEADER.unpack_from(records[b"noise"]) == (RAW, len(noise), len(noise))


def test_compression_off_and_on_read_each_other(tmp_path: Path) -> None:
    with _open(tmp_path, zstd_level=0) as tier:
        tier.put_many([(b"plain", COMPRESSIBLE)])
        assert tier.size_of(b"plain") == len(COMPRESSIBLE) + HEADER.size
    with _open(tmp_path, zstd_level=19) as tier:
        assert tier.get_many([b"plain"])[0] == COMPRESSIBLE
        tier.put_many([(b"packed", COMPRESSIBLE)])
    with _open(tmp_path, zstd_level=0) as tier:
        assert tier.get_many([b"plain"])[0] == COMPRESSIBLE
        assert tier.get_many([b"packed"])[0] == COMPRESSIBLE
        assert tier.stats().usage.raw_bytes == 2 * len(COMPRESSIBLE)


def test_compressible_from_keeps_the_prefix_raw(tmp_path: Path) -> None:
    codes = _random(3, 8192)  # incompressible FP4 codes first, compressible scales last
    value = codes + bytes(100_000)
    with SsdTier(SsdTierConfig(path=str(tmp_path), zstd_level=1), compressible_from=lambda v: 8192) as tier:
        tier.put_many([(b"chunk", value)])
        tier.put_many([(b"codes", codes)])  # all prefix: nothing left to compress
        assert tier.size_of(b"chunk") < 8192 + 1000  # type: ignore[operator]
        assert tier.get_many([b"chunk"])[0] == value
        assert tier.get_many([b"codes"])[0] == codes
    records = _records(tmp_path)
    assert HEADER.unpack_from(records[b"codes"]) == (RAW, 8192, 8192)
    record = records[b"chunk"]
    assert HEADER.unpack_from(record) == (ZSTD, len(value), 8192)
    assert record[HEADER.size : HEADER.size + 8192] == codes


def test_compressible_from_rejects_bad_offsets(tmp_path: Path) -> None:
    with SsdTier(SsdTierConfig(path=str(tmp_path), zstd_level=1), compressible_from=lambda v: len(v) + 1) as tier:
        with pytest.raises(ValueError, match="compressible_from"):
            tier.put_many([(b"k", b"value")])
        assert not tier.contains_many([b"k"])[0]


@pytest.mark.timeout(60)  # an abort starved by readers (see SsdTier._abort) would hang for minutes
def test_map_grows_from_1_mib_to_hold_20_mib(tmp_path: Path) -> None:
    values = {bytes([i]): _random(i, 1 << 20) for i in range(20)}  # incompressible: 20 MiB stored
    stop = threading.Event()
    errors: list[BaseException] = []
    with _open(tmp_path, map_size=1 << 20) as tier:

        def read() -> None:  # readers run through every resize: none may see a torn map
            try:
                while not stop.is_set():
                    for key in list(tier.keys()):
                        assert tier.get_many([key])[0] == values[key]
            except BaseException as exc:
                errors.append(exc)

        readers = [threading.Thread(target=read) for _ in range(3)]
        for reader in readers:
            reader.start()
        for i in range(10):
            tier.put_many([(bytes([i]), values[bytes([i])])])
        tier.put_many((bytes([i]), values[bytes([i])]) for i in range(10, 20))  # one big transaction
        stop.set()
        for reader in readers:
            reader.join()
        assert errors == []
        assert tier.stats(pages=True).pages.map_size >= 20 << 20  # type: ignore[union-attr]
    with _open(tmp_path, map_size=1 << 20) as tier:
        assert tier.stats().usage.items == 20
        for key, value in values.items():
            assert tier.get_many([key])[0] == value


def test_lmdb_stats(tmp_path: Path) -> None:
    with _open(tmp_path) as tier:
        tier.put_many([(b"k", _random(4, 50_000))])
        stats = tier.stats(pages=True).pages
        assert tier.stats().pages is None  # a capacity check does not pay for a read transaction
    assert stats is not None
    assert stats.entries == 1
    assert stats.overflow_pages * stats.psize >= 50_000
    assert stats.map_size == 1 << 30
    assert stats.file_bytes == (stats.last_pgno + 1) * stats.psize
    assert {"leaf_pages", "branch_pages", "depth"} <= {f.name for f in dataclasses.fields(stats)}


def test_unsynced_writes_survive_flush_and_close(tmp_path: Path) -> None:
    with _open(tmp_path, sync=False) as tier:
        tier.put_many([(b"a", b"1")])
        tier.flush()
        tier.put_many([(b"b", b"2")])
    with _open(tmp_path) as tier:
        assert tier.get_many([b"a"])[0] == b"1" and tier.get_many([b"b"])[0] == b"2"


CHILD = """
import random, sys
from kvstore.tiers.config import SsdTierConfig
from kvstore.tiers.ssd.tier import SsdTier
tier = SsdTier(SsdTierConfig(path=sys.argv[1]))
for i in range(100_000):
    rng = random.Random(i)
    tier.put_many([(b"key-%d" % i, rng.randbytes(5000) + bytes(5000 + i))])
    print(i, flush=True)
"""


def test_every_acknowledged_put_survives_sigkill(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    assert child.stdout is not None
    acked = [int(child.stdout.readline()) for _ in range(30)]
    child.send_signal(signal.SIGKILL)
    acked += [int(line) for line in child.stdout]  # acks already in the pipe count too
    assert child.wait() == -signal.SIGKILL
    with _open(tmp_path) as tier:
        for i in acked:
            rng = random.Random(i)
            assert tier.get_many([b"key-%d" % i])[0] == rng.randbytes(5000) + bytes(5000 + i)
        # Beyond the acked puts, at most the one in flight when the kill landed.
        extra = set(tier.keys()) - {b"key-%d" % i for i in acked}
        assert extra <= {b"key-%d" % (max(acked) + 1)}
        assert tier.stats().usage.items == len(acked) + len(extra)


GOOD = b"good value"
CORRUPT = {
    "short": b"\x01\x02",
    "bad flag": HEADER.pack(7, 4, 4) + b"abcd",
    "raw length": HEADER.pack(RAW, 100, 100) + b"x" * 50,
    "raw prefix": HEADER.pack(RAW, 4, 0) + b"abcd",
    "zstd garbage": HEADER.pack(ZSTD, 1000, 0) + b"garbage!" * 10,
    "zstd length": HEADER.pack(ZSTD, 999, 0) + zstandard.compress(b"a" * 1000),
    "zstd prefix": HEADER.pack(ZSTD, 10, 50) + b"z" * 60,
    "zstd bomb": HEADER.pack(ZSTD, 10, 0) + zstandard.compress(bytes(50 << 20)),
}


@pytest.mark.parametrize("record", CORRUPT.values(), ids=CORRUPT.keys())
def test_invalid_framing_raises_tier_error(tmp_path: Path, record: bytes) -> None:
    with _open(tmp_path) as tier:
        tier.put_many([(b"bad", COMPRESSIBLE)])
        tier.put_many([(b"good", GOOD)])
    _poke(tmp_path, b"bad", record)
    with _open(tmp_path) as tier:  # opening still works: the scan reads headers only
        assert tier.contains_many([b"bad"])[0]
        assert tier.size_of(b"bad") == len(record)
        with pytest.raises(TierError, match="ssd tier: key 626164"):
            tier.get_many([b"bad"])[0]
        with pytest.raises(TierError):
            tier.get_many([b"good", b"bad"])
        assert tier.get_many([b"good"])[0] == GOOD
        assert tier.delete_many([b"bad"]) == 1  # the store drops what it cannot read
        assert tier.stats().usage.items == 1


def test_valid_framing_with_wrong_contents_is_returned_as_is(tmp_path: Path) -> None:
    # Contents are the store's to verify (chunk checksums); the tier checks only its framing.
    with _open(tmp_path) as tier:
        tier.put_many([(b"k", b"abcd")])
    _poke(tmp_path, b"k", HEADER.pack(RAW, 4, 4) + b"abXd")
    with _open(tmp_path) as tier:
        assert tier.get_many([b"k"])[0] == b"abXd"


def test_an_open_moves_the_first_formats_meta_records_out_of_the_values(tmp_path: Path) -> None:
    """The first format kept meta records among the values: an open given ``legacy_meta`` moves the
    ones it recognises to the meta sub-database, in one transaction; the others stay values, and a
    damaged one stays where it is. The next open finds nothing to move."""
    legacy = LegacyMeta(b"m:", lambda key, value: bytes(value).startswith(b"KVMF"))
    with _open(tmp_path, zstd_level=3) as tier:
        tier.put_many([(b"m:old", b"KVMF manifest"), (b"m:old-2", b"KVMF" + COMPRESSIBLE),
                       (b"m:not-one", b"a value under the prefix"), (b"c" * 16, b"value"), (b"n:", b"KVMF")])
    _poke(tmp_path, b"m:damaged", HEADER.pack(ZSTD, 100, 0) + b"not zstd")
    txns = []
    for _ in range(2):
        tier = SsdTier(SsdTierConfig(path=str(tmp_path)), legacy_meta=legacy)
        with tier:
            txns.append(tier.stats(pages=True).pages.last_txnid)  # type: ignore[union-attr]
            meta = tier.meta()
            assert sorted(meta.keys()) == [b"m:old", b"m:old-2"]
            assert meta.get(b"m:old") == b"KVMF manifest" and meta.get(b"m:old-2") == b"KVMF" + COMPRESSIBLE
            assert set(tier.keys()) == {b"m:not-one", b"c" * 16, b"n:", b"m:damaged"}
            assert tier.stats().usage.items == 4 and tier.get_many([b"m:not-one"])[0] == b"a value under the prefix"
    assert txns[1] == txns[0]  # the second open wrote nothing


def test_open_failure_is_a_tier_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"not a directory")
    with pytest.raises(TierError, match="ssd tier"):
        _open(tmp_path / "file" / "db")


def test_records_are_raw_by_default_and_compact_ones_compressed(tmp_path: Path) -> None:
    """The default stores values raw (an ssd load copies them straight out of the map); compact
    records asked for without a level are compressed at level 1, not silently stored raw."""
    value = _random(3, 8192) + bytes(100_000)
    assert SsdTierConfig().zstd_level == 0
    assert SsdTierConfig(compact_records=True).record_level == 1
    assert SsdTierConfig(compact_records=True, zstd_level=5).record_level == 5
    with SsdTier(SsdTierConfig(path=str(tmp_path / "default")), compressible_from=lambda v: 8192) as tier:
        tier.put_many([(b"chunk", value)])
        assert tier.get_many([b"chunk"])[0] == value
    assert HEADER.unpack_from(_records(tmp_path / "default")[b"chunk"]) == (RAW, len(value), len(value))


def _sizes(tier: SsdTier) -> dict[bytes, tuple[int, int]]:
    return dict(tier._sizes)


def test_an_open_takes_each_records_size_from_its_header_page_as_lmdb_would(tmp_path: Path) -> None:
    """The open's sizes come from the structural check's walk (one page per record), not from a
    cursor over every value: they must be exactly what LMDB's own view gives, for inline values,
    values on overflow pages, compressed ones and a record too short to hold a header."""
    values = {b"small": b"x" * 100, b"big": _random(1, 300_000), b"squeezed": COMPRESSIBLE, b"empty": b""}
    with _open(tmp_path, zstd_level=1) as tier:
        tier.put_many(values.items())
    env = lmdb.open(str(tmp_path), max_dbs=8)
    with env.begin(write=True, db=env.open_db(DB_NAME)) as txn:
        txn.put(b"stub", b"\x00\x01")  # shorter than a header: counted, unreadable
    env.close()
    with _open(tmp_path, zstd_level=1) as tier:
        from_heads = _sizes(tier)
        tier._sizes.clear()
        tier._scan()  # LMDB's view: a cursor over every record
        assert from_heads == _sizes(tier)
        assert set(from_heads) == {*values, b"stub"}
        assert from_heads[b"stub"] == (2, 0) and from_heads[b"big"][1] == 300_000
        assert from_heads[b"squeezed"][0] < len(COMPRESSIBLE) == from_heads[b"squeezed"][1]
        assert [tier.get_many([k])[0] for k in values] == list(values.values())


def test_an_open_reads_one_page_per_record_not_the_whole_file(tmp_path: Path) -> None:
    """A store bigger than RAM must open without reading all of it: after its pages are dropped
    from the page cache, an open (the check, the sizes) brings back a few percent of the file."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import drop_page_cache
    from benchmarks.resume.geometry_raw import resident_fraction

    with _open(tmp_path) as tier:
        for i in range(8):
            tier.put_many((f"{i}-{j}".encode(), _random(i * 100 + j, 256 << 10)) for j in range(16))
    data = tmp_path / "data.mdb"
    left = None if drop_page_cache(data) else resident_fraction(data)
    if left is None or left > 0.05:
        pytest.skip(f"cannot drop {data}'s pages from the page cache here (mincore: {left})")
    with _open(tmp_path) as tier:
        assert len(_sizes(tier)) == 128
        after = resident_fraction(data)
        assert after is not None and after < 0.25  # 1 page of each 65-page record, and the trees
