"""kvstore's own rules for laying out SGLang's HiCache pools (kvstore/engines/sglang/geometry.py), on pools and
records of kvstore's own types, without SGLang: which record a pool's item size admits, the opaque fallback,
the SWA refusal, and what goes into the layout's fingerprint. The records and pools SGLang really builds
(its ``KVLayout``s, its DeepSeek-V4.1 pools on SM100 and Hopper, the interleaved arrangement) are tested
under SGLang's own stack: tests/engines/sglang_tier/test_kvstore_backend.py."""

from __future__ import annotations

import pytest

from kvstore.engines.pages.records import Record
from kvstore.engines.sglang.geometry import Pool, SwaPoolRefused, derive
from kvstore.format.page_layout import INTERLEAVED, SPLIT
from tests.helpers.pages import INTERLEAVED_288, POOL_PAGE_TOKENS, RANKS, SPLIT_288, padded_item, pool_shapes


def test_a_pool_takes_the_one_record_its_item_size_admits_and_pages_per_layer() -> None:
    g = derive("m", pool_shapes(), RANKS)
    assert not g.opaque and {n: p.record.name for n, p in g.pools.items() if p.record} == {
        "deepseek_v4_c2": "split-288", "deepseek_v4_c1": "split-288", "deepseek_v4_c2_indexer": "indexer-68",
        "deepseek_v4_c1_indexer": "indexer-68"}
    c2 = g.layout.group(g.groups["deepseek_v4_c2"])
    assert c2 is not None and len(c2.pages) == 3 and c2.tokens == POOL_PAGE_TOKENS
    assert {(p.states, p.data, p.scale, p.arrangement) for p in c2.pages} == {(128, 256, 32, SPLIT)}
    assert g.layout.bytes_per_token == sum(p.page_bytes for p in g.pools.values()) / POOL_PAGE_TOKENS


def test_the_record_layout_and_the_ranks_are_in_the_fingerprint() -> None:
    split, inter = derive("m", pool_shapes(SPLIT_288), RANKS), derive("m", pool_shapes(INTERLEAVED_288), RANKS)
    assert split.pools["deepseek_v4_c2"].page_bytes == inter.pools["deepseek_v4_c2"].page_bytes
    assert split.layout.layout_id != inter.layout.layout_id  # same sizes, other bytes: never shared
    assert dict(inter.layout.fingerprint)["pool.deepseek_v4_c2"].endswith("record=interleaved-288")
    assert derive("m", pool_shapes(), {**RANKS, "pp_rank": "1"}).layout.layout_id != split.layout.layout_id
    assert derive("other", pool_shapes(), RANKS).layout.layout_id != split.layout.layout_id


def test_an_swa_pool_is_refused_naming_the_flag() -> None:
    swa = Pool("swa", 61, 88_525, POOL_PAGE_TOKENS, None)
    with pytest.raises(SwaPoolRefused, match="--enable-encoder-swa-bounded-replay"):
        derive("m", [*pool_shapes(), swa], RANKS)


def test_a_pool_whose_record_is_unknown_or_ambiguous_is_stored_whole_per_layer_and_named() -> None:
    known = pool_shapes()
    unknown = [Pool(p.name, p.layers, p.item_bytes, p.page_tokens, None) if p.name == "deepseek_v4_c1" else p
               for p in known]
    g = derive("m", unknown, RANKS)
    assert g.opaque == ("deepseek_v4_c1",)
    c1 = g.layout.group(g.groups["deepseek_v4_c1"])
    item_bytes = padded_item(POOL_PAGE_TOKENS, SPLIT_288)
    assert c1 is not None and c1.block_bytes == item_bytes and c1.pages[0].scale == 0
    assert dict(g.layout.fingerprint)["pool.deepseek_v4_c1"].endswith("record=opaque")
    # a record that does not fill the item the way it is padded is not trusted either
    off = [Pool(p.name, p.layers, p.item_bytes + 64, p.page_tokens, p.record) if p.name == "deepseek_v4_c2" else p
           for p in known]
    assert derive("m", off, RANKS).opaque == ("deepseek_v4_c2",)
    # two arrangements admitting the same item: no guess
    both = pool_shapes(SPLIT_288, mains=(SPLIT_288, Record(256, 32, INTERLEAVED, 256, "interleaved-256")))
    assert {p.name for p in both if p.record is None} == {"deepseek_v4_c2", "deepseek_v4_c1"}
    assert derive("m", both, RANKS).opaque == ("deepseek_v4_c1", "deepseek_v4_c2")
