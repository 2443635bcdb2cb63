"""Corruption (issue 8, "What to build" 2): bit flips and truncations in the ssd tier's LMDB file
(values, B-tree pages, meta pages) and in Redis values are detected at open or on read, counted,
the bad copy dropped, a good copy or a miss served: never a wrong byte, never a crash. Damage to
the file's structure is repaired at open (the sound records kept, the rest reported and set aside).

Short mode of ``benchmarks/reliability/bench_corruption.py`` (same harness, fixed seed, a few dozen
injections; each LMDB one is checked in a forked child, so a crash fails the test instead of
killing it). The long mode publishes ``benchmarks/results/corruption.json``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.reliability.bench_corruption import (
    LMDB_KINDS,
    OUTCOMES,
    REDIS_KINDS,
    Tally,
    check,
    check_dir,
    config,
    page_regions,
    run_lmdb,
    run_redis,
    sessions_to_save,
)
from kvstore.store import open_store
from kvstore.tiers import TierError
from tests.helpers.store import save

BAD = ("served corrupt", "undetected loss", "crash")


def assert_clean(tally: Tally, kinds: tuple[str, ...], per_kind: int) -> None:
    for kind in kinds:
        c = tally.counts[kind]
        assert sum(c[o] for o in OUTCOMES) == per_kind
        assert all(c[o] == 0 for o in BAD), (kind, dict(c))
        assert c["detected"] > 0, (kind, dict(c))  # the harness really damaged something


def test_lmdb_flips_and_truncations_are_detected_never_served(tmp_path: Path) -> None:
    tally = Tally({})
    run_lmdb(8 * len(LMDB_KINDS), seed=0, work=tmp_path, tally=tally)
    assert_clean(tally, LMDB_KINDS, 8)
    assert tally.counts["truncate"]["detected"] == 8  # every truncation is found at open


def test_redis_value_flips_and_truncations_are_detected_never_served(tmp_path: Path, redis_url: str) -> None:
    tally = Tally({})
    run_redis(6 * len(REDIS_KINDS), seed=0, work=tmp_path, redis_url=redis_url, tally=tally)
    assert_clean(tally, REDIS_KINDS, 6)
    assert all(c["detected"] == 6 for c in tally.counts.values())  # the only copy: every one is seen


@pytest.mark.parametrize("damage", ["one meta page", "txn id", "truncated", "branch page", "both meta pages"])
def test_a_damaged_data_file_is_salvaged_at_open_or_refused_naming_it(tmp_path: Path, damage: str) -> None:
    """What LMDB cannot survive (its own assertion, a SIGBUS) is caught before it opens the file:
    the sound records are kept, the damage reported and set aside; with no sound meta page the
    open is refused, naming the file."""
    saved = sessions_to_save()
    ss = open_store(config(tmp_path))
    for s in saved:
        save(ss, s)
    ss.store.close()
    data_file = tmp_path / "ssd" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "branch page":
        offset = page_regions(bytes(data))["branch"][0][0]
        data[offset] ^= 0x40  # its page number: LMDB would follow it anyway
    else:
        for page in (0, 1) if damage == "both meta pages" else (1,):
            offset = 16 if damage != "txn id" else 16 + 24 + 96 + 8 + 6  # the magic, or a high txnid byte
            data[page * 4096 + offset] ^= 0x40
    data_file.write_bytes(bytes(data))
    if damage == "both meta pages":
        with pytest.raises(TierError, match=f"{data_file} is damaged .*refusing to open it"):
            open_store(config(tmp_path))
        return
    ss = open_store(config(tmp_path))
    try:
        assert str(data_file) in ss.store.counters["ssd"].last_error
        result = check(ss, saved)
        assert result["served_corrupt"] == 0 and result["reported"] > 0
    finally:
        ss.store.close()
    assert list((tmp_path / "ssd").glob("data.mdb.damaged-*"))  # kept for a post-mortem
    assert check_dir(tmp_path, saved)["refused"] == 0  # and the repaired file opens again
