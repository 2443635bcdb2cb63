"""Corruption (issue 8, "What to build" 2): bit flips and truncations in the ssd tier's LMDB file
(values, B-tree pages, meta pages) and in Redis values are detected at open or on read, counted,
the bad copy dropped, a good copy or a miss served: never a wrong byte, never a crash.

Short mode of ``benchmarks/bench_corruption.py`` (same harness, fixed seed, a few dozen
injections; each LMDB one is checked in a forked child, so a crash fails the test instead of
killing it). The long mode publishes ``benchmarks/results/corruption.json``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from store_helpers import save

from benchmarks.bench_corruption import (
    LMDB_KINDS,
    REDIS_KINDS,
    Tally,
    check_dir,
    config,
    run_lmdb,
    run_redis,
    sessions_to_save,
)
from kvstore.store import open_store
from kvstore.tiers import TierError

BAD = ("served corrupt", "undetected loss", "crash")


def assert_clean(tally: Tally, kinds: tuple[str, ...], per_kind: int) -> None:
    for kind in kinds:
        c = tally.counts[kind]
        assert sum(c.values()) == per_kind
        assert all(c[o] == 0 for o in BAD), (kind, dict(c))
        assert c["detected"] > 0, (kind, dict(c))  # the harness really damaged something


def test_lmdb_flips_and_truncations_are_detected_never_served(tmp_path: Path) -> None:
    tally = Tally({})
    run_lmdb(8 * len(LMDB_KINDS), seed=0, work=tmp_path, tally=tally)
    assert_clean(tally, LMDB_KINDS, 8)
    assert tally.counts["truncate"]["detected"] == 8  # every truncation refuses to open


def test_redis_value_flips_and_truncations_are_detected_never_served(tmp_path: Path, redis_url: str) -> None:
    tally = Tally({})
    run_redis(6 * len(REDIS_KINDS), seed=0, work=tmp_path, redis_url=redis_url, tally=tally)
    assert_clean(tally, REDIS_KINDS, 6)
    assert all(c["detected"] == 6 for c in tally.counts.values())  # the only copy: every one is seen


@pytest.mark.parametrize("damage", ["one meta page", "both meta pages", "txn id", "truncated"])
def test_a_damaged_data_file_refuses_to_open_naming_it(tmp_path: Path, damage: str) -> None:
    saved = sessions_to_save()[:2]
    ss = open_store(config(tmp_path))
    for s in saved:
        save(ss, s)
    ss.store.close()
    data_file = tmp_path / "ssd" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        for page in (0, 1) if damage == "both meta pages" else (1,):
            offset = 16 if damage != "txn id" else 16 + 24 + 96 + 8 + 6  # the magic, or a high txnid byte
            data[page * 4096 + offset] ^= 0x40
    backup = bytes(data_file.read_bytes())
    data_file.write_bytes(bytes(data))
    with pytest.raises(TierError, match=f"{data_file}.*(damaged|truncated).*refusing to open"):
        open_store(config(tmp_path))
    data_file.write_bytes(backup)  # and the same directory, restored, opens with everything
    result = check_dir(tmp_path, saved)
    assert result == {"served_corrupt": 0, "missing": 0, "reported": 0, "refused": 0}
