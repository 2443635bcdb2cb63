"""Record flag 3 (tiers/ssd/runs_record.py): a page blob's scale rows, gathered by its layout's runs
(``format.page.scale_runs``), compressed with its tail. Bit-exact round trips of SGLang-like split
pages and vLLM-like interleaved ones, records that need no layout to read, a damaged record that is
a CorruptValue or bytes the blob's checksum rejects (never other data passed as good), and a store
written compact that reads back with compact off (and the other way)."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest

from kvstore.format import page
from kvstore.format.page_layout import PageLayout
from kvstore.tiers import SsdTierConfig
from kvstore.tiers.base import CorruptValue
from kvstore.tiers.ssd import runs_record
from kvstore.tiers.ssd.record import RUNS, ZSTD, RecordCodec
from kvstore.tiers.ssd.tier import SsdTier
from tests.helpers.pages import INTERLEAVED_288, SPLIT_288, SPLIT_528, pooled_layout, scaled_block, v41_layout

#: page layouts of SGLang's pool shapes and of vLLM's groups, built by hand (tests/helpers/pages.py)
LAYOUTS = {"sglang-split-288": pooled_layout(SPLIT_288), "sglang-split-528": pooled_layout(SPLIT_528),
           "sglang-interleaved-288": pooled_layout(INTERLEAVED_288),
           "vllm-nvfp4": v41_layout(), "vllm-fp8": v41_layout("fp8_ds_mla")}



def blob_of(layout: PageLayout, group: int, seed: int = 0) -> bytes:
    """A page blob of a block whose scale bytes are in a narrow range (``scaled_block``)."""
    h = f"block-{seed}".encode()
    return page.encode(layout, group, h, page.page_key(layout.layout_id, "ns", group, h),
                       scaled_block(layout, group, seed))


def runs_of(*layouts: PageLayout) -> page.ScaleRuns:
    by_id = {lay.layout_id: lay for lay in layouts}
    return page.ScaleRuns(by_id.get)


def compact(*layouts: PageLayout, level: int = 1) -> RecordCodec:
    return RecordCodec(level, page.compressible_offset, True, runs_of(*layouts))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_group_round_trips_bit_exact_and_smaller_than_flag_1(name: str) -> None:
    lay = LAYOUTS[name]
    codec, plain = compact(lay), RecordCodec(1, page.compressible_offset, False)
    reader = RecordCodec(0, None, False)  # no layout, no runs, compression off: reads every flag
    for g in lay.groups:
        blob = blob_of(lay, g.group, g.group)
        rec = codec.encode(memoryview(blob))
        runs = page.scale_runs(g, page.read_header(blob).header_bytes)
        assert rec[0] == (RUNS if runs else ZSTD)
        assert bytes(reader.decode(b"k", rec)) == blob
        out = bytearray(len(blob) + 7)
        assert reader.decode_into(b"k", rec, memoryview(out)) == len(blob) and out[: len(blob)] == blob
        page.check(bytes(reader.view(b"k", rec)), lay, "ns")
        if runs:
            assert len(rec) < len(plain.encode(memoryview(blob)))


def test_the_runs_are_the_scale_rows_merged_across_pages() -> None:
    """SGLang's 3-layer c2 pool (split): one run over its layers' scale rows but the last (in the
    tail); vLLM's interleaved main page: one strided run of every record's scales (its split indexer
    page after it holds the block's last codes: its scale rows are the tail)."""
    lay = LAYOUTS["sglang-split-288"]
    c2 = lay.group(2)
    assert c2 is not None and [p.states for p in c2.pages] == [128] * 3
    hb = 112
    item = c2.pages[0].page_bytes
    assert page.scale_runs(c2, hb) == ((hb + 128 * 256, 128 * 32, item, 2),)
    v = LAYOUTS["vllm-nvfp4"].group(1)
    assert v is not None
    assert page.scale_runs(v, hb) == ((hb + 256, 32, 288, 256),)


def test_a_value_that_is_no_known_page_blob_is_flag_1() -> None:
    lay = LAYOUTS["sglang-split-288"]
    blob = blob_of(lay, 2)
    other = compact(LAYOUTS["vllm-nvfp4"])  # the blob's layout is not known to it
    assert other.encode(memoryview(blob))[0] == ZSTD
    assert compact(lay).encode(memoryview(b"x" * 5000 + bytes(5000)))[0] != RUNS


def test_runs_that_do_not_fit_are_refused_by_the_writer() -> None:
    blob = blob_of(LAYOUTS["vllm-nvfp4"], 1)
    start = page.compressible_offset(blob)
    cases: list[list[runs_record.Run]] = [[(start - 10, 32, 32, 1)], [(100, 32, 16, 4)],
                                          [(200, 8, 8, 1), (100, 8, 8, 1)], []]
    for runs in cases:
        codec = RecordCodec(1, page.compressible_offset, True, lambda v, r=runs: r)  # type: ignore[misc]
        rec = codec.encode(memoryview(blob))
        assert rec[0] == ZSTD and bytes(codec.decode(b"k", rec)) == blob


def test_a_damaged_record_is_a_miss_never_wrong_data() -> None:
    """Every damage of a flag 3 record reads as CorruptValue, or as bytes whose checksum (or header)
    the store's check rejects: never as a blob that passes."""
    lay = LAYOUTS["vllm-nvfp4"]
    blob = blob_of(lay, 0)
    rec = compact(lay).encode(memoryview(blob))
    reader = RecordCodec(0, None, False)
    rnd = random.Random(0)
    table_end = 9 + 2 + 16 * rec[9]
    spots = list(range(table_end + 8)) + rnd.sample(range(table_end, len(rec)), 300)
    for at in spots:
        bad = bytearray(rec)
        bad[at] ^= 1 << rnd.randrange(8)
        try:
            got = bytes(reader.decode(b"k", bytes(bad)))
        except CorruptValue:
            continue
        with pytest.raises(page.PageError):
            page.check(got, lay, "ns")
    for cut in (5, 10, table_end - 1, table_end + 100, len(rec) - 1):
        with pytest.raises(CorruptValue):
            reader.decode(b"k", rec[:cut])


def test_the_reader_checks_the_runs_table() -> None:
    for runs, prefix in (([(0, 0, 1, 1)], 10), ([(0, 4, 3, 2)], 10), ([(0, 4, 4, 3)], 11),
                         ([(8, 2, 2, 1), (9, 1, 1, 1)], 20), ([(0, 1, 1, 0)], 10), ([], 10)):
        assert runs_record.check(runs, prefix) is None
    assert runs_record.check([(0, 4, 4, 3)], 12) == 12
    assert runs_record.gaps([(2, 4, 6, 3)], 30) == [(0, 2, 2, 1), (6, 2, 6, 2), (18, 12, 12, 1)]


def test_a_store_written_compact_reads_with_compact_off_and_back(tmp_path: Path) -> None:
    lays = list(LAYOUTS.values())
    blobs = {bytes([i]) * 16: blob_of(lay, g.group, i) for i, (lay, g) in
             enumerate((lay, g) for lay in lays for g in lay.groups)}
    cfg = SsdTierConfig(path=str(tmp_path), compact_records=True)
    with SsdTier(cfg, compressible_from=page.compressible_offset, compressible_runs=runs_of(*lays)) as tier:
        tier.put_many(blobs.items())
        compact_bytes = tier.stats().usage.used_bytes
    for off in (SsdTierConfig(path=str(tmp_path)), SsdTierConfig(path=str(tmp_path), zstd_level=3)):
        with SsdTier(off, compressible_from=page.compressible_offset) as tier:
            assert _all(tier, blobs) == blobs
            tier.put_many(list(blobs.items())[:3])  # rewritten under this setting, read back compact below
    with SsdTier(cfg, compressible_from=page.compressible_offset, compressible_runs=runs_of(*lays)) as tier:
        assert _all(tier, blobs) == blobs
    with SsdTier(SsdTierConfig(path=str(tmp_path / "flag1"), zstd_level=1),
                 compressible_from=page.compressible_offset) as tier:
        tier.put_many(blobs.items())
        assert compact_bytes < tier.stats().usage.used_bytes


def _all(tier: SsdTier, blobs: dict[bytes, bytes]) -> dict[bytes, bytes]:
    return {k: bytes(v) for k, v in zip(blobs, tier.get_many(list(blobs))) if v is not None}  # type: ignore[arg-type]


def test_the_independent_reader_reads_flag_3() -> None:
    """docs/format_example.py (no kvstore import) decodes flag 3 records as FORMAT.md section 5 says."""
    import importlib.util

    where = Path(__file__).parents[2] / "docs" / "format_example.py"
    spec = importlib.util.spec_from_file_location("format_example", where)
    assert spec is not None and spec.loader is not None
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    for lay in LAYOUTS.values():
        for g in lay.groups:
            blob = blob_of(lay, g.group, 3)
            rec = compact(lay).encode(memoryview(blob))
            if rec[0] == RUNS:
                _, raw_len, prefix = struct.unpack_from("<BII", rec)
                assert ex._runs_record(rec, raw_len, prefix) == blob
