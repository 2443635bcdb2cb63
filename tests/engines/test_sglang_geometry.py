"""kvstore's own rules for laying out SGLang's HiCache pools (kvstore/engines/sglang/geometry.py), on pools and
records of kvstore's own types, without SGLang: which record a pool's item size admits, the opaque fallback,
the SWA refusal, and what goes into the layout's fingerprint. The records and pools SGLang really builds
(its ``KVLayout``s, its DeepSeek-V4.1 pools on SM100 and Hopper, the interleaved arrangement) are tested
under SGLang's own stack: tests/engines/sglang_tier/test_kvstore_backend.py."""

from __future__ import annotations

import pytest

from kvstore.engines.pages.records import Record
from kvstore.engines.sglang.geometry import Pool, SwaPoolRefused, derive, fit
from kvstore.format.page_layout import INTERLEAVED, SPLIT

PAGE = 256
#: two records of one size in two arrangements (padded to different alignments), and an indexer's
SPLIT_REC = Record(256, 32, SPLIT, 256, "split-288")
INTER_REC = Record(256, 32, INTERLEAVED, 288, "interleaved-288")
INDEXER = Record(64, 4, SPLIT, 1, "indexer-68")
FP = {"tp_size": "1", "tp_rank": "replicated", "pp_rank": "0", "pp_size": "1"}


def item(states: int, rec: Record) -> int:
    """An item of ``states`` records padded to the record's alignment (what ``fit`` admits)."""
    return -(-states * rec.nbytes // rec.align) * rec.align


def pools(main: Record = SPLIT_REC, mains: tuple[Record, ...] | None = None) -> list[Pool]:
    """Pools named as SGLang's are (their ratio in the name: 256 / ratio records a page), each record then
    found by ``fit`` from the item size alone, among ``mains`` (default: ``main`` only)."""
    cands = mains if mains is not None else (main,)
    out = []
    for name, layers, ratio in (("deepseek_v4_c2", 3, 2), ("deepseek_v4_c1", 1, 1)):
        states = PAGE // ratio
        out.append(fit(name, layers, item(states, main), PAGE, cands, [INDEXER]))
        out.append(fit(f"{name}_indexer", layers, item(states, INDEXER), PAGE, cands, [INDEXER]))
    return out


def test_a_pool_takes_the_one_record_its_item_size_admits_and_pages_per_layer() -> None:
    g = derive("m", pools(), FP)
    assert not g.opaque and {n: p.record.name for n, p in g.pools.items() if p.record} == {
        "deepseek_v4_c2": "split-288", "deepseek_v4_c1": "split-288", "deepseek_v4_c2_indexer": "indexer-68",
        "deepseek_v4_c1_indexer": "indexer-68"}
    c2 = g.layout.group(g.groups["deepseek_v4_c2"])
    assert c2 is not None and len(c2.pages) == 3 and c2.tokens == PAGE
    assert {(p.states, p.data, p.scale, p.arrangement) for p in c2.pages} == {(128, 256, 32, SPLIT)}
    assert g.layout.bytes_per_token == sum(p.page_bytes for p in g.pools.values()) / PAGE


def test_the_record_layout_and_the_ranks_are_in_the_fingerprint() -> None:
    split, inter = derive("m", pools(SPLIT_REC), FP), derive("m", pools(INTER_REC), FP)
    assert split.pools["deepseek_v4_c2"].page_bytes == inter.pools["deepseek_v4_c2"].page_bytes
    assert split.layout.layout_id != inter.layout.layout_id  # same sizes, other bytes: never shared
    assert dict(inter.layout.fingerprint)["pool.deepseek_v4_c2"].endswith("record=interleaved-288")
    assert derive("m", pools(), {**FP, "pp_rank": "1"}).layout.layout_id != split.layout.layout_id
    assert derive("other", pools(), FP).layout.layout_id != split.layout.layout_id


def test_an_swa_pool_is_refused_naming_the_flag() -> None:
    swa = Pool("swa", 61, 88_525, PAGE, None)
    with pytest.raises(SwaPoolRefused, match="--enable-encoder-swa-bounded-replay"):
        derive("m", [*pools(), swa], FP)


def test_a_pool_whose_record_is_unknown_or_ambiguous_is_stored_whole_per_layer_and_named() -> None:
    known = pools()
    unknown = [Pool(p.name, p.layers, p.item_bytes, p.page_tokens, None) if p.name == "deepseek_v4_c1" else p
               for p in known]
    g = derive("m", unknown, FP)
    assert g.opaque == ("deepseek_v4_c1",)
    c1 = g.layout.group(g.groups["deepseek_v4_c1"])
    item_bytes = item(PAGE, SPLIT_REC)
    assert c1 is not None and c1.block_bytes == item_bytes and c1.pages[0].scale == 0
    assert dict(g.layout.fingerprint)["pool.deepseek_v4_c1"].endswith("record=opaque")
    # a record that does not fill the item the way it is padded is not trusted either
    off = [Pool(p.name, p.layers, p.item_bytes + 64, p.page_tokens, p.record) if p.name == "deepseek_v4_c2" else p
           for p in known]
    assert derive("m", off, FP).opaque == ("deepseek_v4_c2",)
    # two arrangements admitting the same item: no guess
    both = pools(SPLIT_REC, mains=(SPLIT_REC, Record(256, 32, INTERLEAVED, 256, "interleaved-256")))
    assert {p.name for p in both if p.record is None} == {"deepseek_v4_c2", "deepseek_v4_c1"}
    assert derive("m", both, FP).opaque == ("deepseek_v4_c1", "deepseek_v4_c2")
