"""The ssd tier's readahead advice: off on its map (a lookup reads only what it asked for), on while
a batch read of many keys runs (a whole-session load after a page-cache drop reads its runs of
chunks ahead), off again once the last concurrent batch ends. Read back from /proc/self/smaps, where
the kernel lists a mapping's advice (``rr``: MADV_RANDOM)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvstore.tiers import SsdTierConfig
from kvstore.tiers.ssd.readahead import READAHEAD_KEYS, MapAdvice, mappings
from kvstore.tiers.ssd.tier import SsdTier

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")


def _random_advice(path: Path) -> list[bool]:
    """For each mapping of ``path`` in this process, whether it is advised MADV_RANDOM."""
    want, out, inside = os.path.realpath(path), [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = len(head) == 6 and head[5].strip() == want
            elif inside and line.startswith("VmFlags:"):
                out.append("rr" in line.split())
    return out


def _tier(tmp_path: Path) -> SsdTier:
    tier = SsdTier(SsdTierConfig(path=str(tmp_path)))
    tier.put_many((f"k{i:03}".encode(), bytes([i]) * 70_000) for i in range(READAHEAD_KEYS * 2))
    return tier


def test_the_map_reads_ahead_only_while_a_batch_read_runs(tmp_path: Path) -> None:
    data = tmp_path / "data.mdb"
    with _tier(tmp_path) as tier:
        keys = [f"k{i:03}".encode() for i in range(READAHEAD_KEYS * 2)]
        assert mappings(str(data)) and _random_advice(data) == [True]  # LMDB's map, readahead off
        with tier.read_views(keys[:2]) as few:  # a lookup-sized read: no readahead
            assert _random_advice(data) == [True] and bytes(few.values[1]) == bytes([1]) * 70_000
        with tier.read_views(keys) as many:
            assert _random_advice(data) == [False]
            assert [bytes(v)[:1] for v in many.values] == [bytes([i]) for i in range(len(keys))]
        assert _random_advice(data) == [True]


def test_the_last_of_overlapping_batches_turns_readahead_off(tmp_path: Path) -> None:
    data = tmp_path / "data.mdb"
    with _tier(tmp_path):
        advice = MapAdvice(str(data))
        first_in, second_done = threading.Event(), threading.Event()

        def second() -> None:
            first_in.wait(10)
            with advice.reading_ahead(READAHEAD_KEYS):
                pass
            second_done.set()

        t = threading.Thread(target=second)
        t.start()
        with advice.reading_ahead(READAHEAD_KEYS):
            first_in.set()
            assert second_done.wait(10)
            assert _random_advice(data) == [False]  # the other batch ended; this one still reads ahead
        t.join()
        assert _random_advice(data) == [True]


def test_mappings_of_a_file_not_mapped_are_none(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    assert mappings(str(tmp_path / "f")) == []
    assert mappings(str(tmp_path / "f"), maps=str(tmp_path / "no-such-maps")) == []
