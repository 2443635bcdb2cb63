from __future__ import annotations

from fractions import Fraction

import pytest

from kvstore.format.layout import PRESETS, CacheSpec, EntryFormat, get_layout, layout_by_id


def test_paper_numbers() -> None:
    v41 = get_layout("deepseek-v4.1-flash")
    assert v41.bytes_per_token == Fraction(890)
    assert v41.entries_per_token == Fraction(5, 1) and len(v41.caches) == 8
    assert v41.cache("main.L2").entry_bytes == 288 and v41.cache("index.L20").entry_bytes == 68
    assert v41.swa_state_bytes == 2_703_360 and not v41.persists_swa
    v4 = get_layout("deepseek-v4-flash")
    assert v4.bytes_per_token == Fraction(351425, 100)
    assert v4.swa_state_bytes == 3_214_336 and v4.persists_swa
    assert get_layout("tiny-16").bytes_per_token == Fraction(445, 2)
    assert get_layout("tiny-8").bytes_per_token == Fraction(267, 2)
    assert get_layout("tiny-16").swa_state_bytes == 270_336


def test_layout_ids_are_stable_and_distinct() -> None:
    ids = {lay.layout_id for lay in PRESETS.values()}
    assert len(ids) == len(PRESETS)
    # the id is a hash of the definition: pinned so an accidental change to a preset is caught
    assert get_layout("tiny-16").layout_hex == "5515dd537a5e2e58e471a303d771abc2"
    assert layout_by_id(get_layout("tiny-8").layout_id) is PRESETS["tiny-8"]


def test_bad_definitions_raise() -> None:
    with pytest.raises(ValueError, match="multiple"):
        CacheSpec("x", 0, 2, 100, EntryFormat.FP4_E4M3_16)
    with pytest.raises(ValueError, match="m must be"):
        CacheSpec("x", 0, 0, 128, EntryFormat.FP4_E4M3_16)
    with pytest.raises(ValueError, match="unknown layout 'nope'"):
        get_layout("nope")
