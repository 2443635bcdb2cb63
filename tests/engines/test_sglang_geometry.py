"""The page geometry of SGLang's DeepSeek-V4.1 pools (kvstore/engines/sglang/geometry.py), without SGLang:
the byte accounting of both record families, the arrangement in the fingerprint, the SWA refusal and the
opaque fallback. What SGLang's own code builds is tests/engines/sglang_tier/'s business."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import pytest

from kvstore.engines.pages.records import Record
from kvstore.engines.sglang.geometry import Pool, SwaPoolRefused, derive, fit, indexer_records, main_record
from kvstore.format.page_layout import INTERLEAVED, SPLIT

PAGE = 256


@dataclass(frozen=True)
class FakeLayout:
    """The fields of SGLang's ``KVLayout`` (sglang/kernels/ops/attention/dsv4/kv_layout.py) the geometry reads."""

    value: str
    data_bytes: int
    scale_bytes: int
    page_align: int
    is_interleaved: bool = False


V41_FP4 = FakeLayout("v41_fp4", 256, 32, 256)
V41_FP4_NEW = FakeLayout("v41_fp4_new", 256, 32, 288, True)
V41 = FakeLayout("v41", 512, 16, 512)
V4 = FakeLayout("v4", 576, 8, 576)
#: the block-split layouts SGLang may pick without SGLANG_DSV4_KV_LAYOUT=v41_new, and the interleaved ones with it
SPLIT_MAINS = [r for r in map(main_record, (V41_FP4, V41, V4)) if r is not None]
NEW_MAINS = [r for r in map(main_record, (V41_FP4_NEW, FakeLayout("v41_new", 512, 16, 528, True))) if r is not None]


def _padded(states: int, rec: Record) -> int:
    return -(-states * rec.nbytes // rec.align) * rec.align


def pools(main: FakeLayout, indexer: str = "mxfp4", mains: list[Record] | None = None) -> list[Pool]:
    """The four V4.1 pools as SGLang sizes them for ``main`` and ``indexer``, each record then found by
    :func:`fit` from the item sizes alone, among the candidates SGLang's settings allow."""
    m = main_record(main)
    i = {r.name.split("-")[1]: r for r in indexer_records()}[indexer]
    assert m is not None
    cands = mains if mains is not None else (NEW_MAINS if main.is_interleaved else SPLIT_MAINS)
    out = []
    for name, layers, ratio in (("deepseek_v4_c2", 3, 2), ("deepseek_v4_c1", 1, 1)):
        states = PAGE // ratio
        out.append(fit(name, layers, _padded(states, m), PAGE, cands, indexer_records()))
        out.append(fit(f"{name}_indexer", layers, _padded(states, i), PAGE, cands, indexer_records()))
    return out


FP = {"tp_size": "1", "tp_rank": "replicated", "pp_rank": "0", "pp_size": "1"}


def test_the_v41_fp4_pools_are_890_bytes_a_token_block_split() -> None:
    g = derive("DeepSeek-V4.1-Flash", pools(V41_FP4), FP)
    assert g.layout.bytes_per_token == 890 and not g.opaque
    sizes = {n: p.page_bytes for n, p in g.pools.items()}
    assert sizes == {"deepseek_v4_c2": 110_592, "deepseek_v4_c2_indexer": 26_112, "deepseek_v4_c1": 73_728,
                     "deepseek_v4_c1_indexer": 17_408}
    c2 = g.layout.group(g.groups["deepseek_v4_c2"])
    assert c2 is not None and len(c2.pages) == 3 and c2.tokens == PAGE
    assert {(p.states, p.data, p.scale, p.arrangement) for p in c2.pages} == {(128, 256, 32, SPLIT)}


def test_hoppers_v4_records_are_padded_to_576_and_the_padding_is_kept() -> None:
    g = derive("DeepSeek-V4.1-Flash", pools(V4), FP)
    stored = Fraction(sum(p.page_bytes for p in g.pools.values()), PAGE)
    assert stored == Fraction(3265, 2)  # 1,632.5 B/token at rest: 584-B records, pages padded to 576 B
    assert g.layout.bytes_per_token == 1630  # the records themselves
    assert not g.opaque


def test_the_arrangement_is_in_the_fingerprint_so_same_sized_pages_are_never_shared() -> None:
    split = derive("m", pools(V41_FP4), FP)
    inter = derive("m", pools(V41_FP4_NEW), FP)
    assert split.pools["deepseek_v4_c2"].page_bytes == inter.pools["deepseek_v4_c2"].page_bytes
    assert split.layout.layout_id != inter.layout.layout_id
    c2 = inter.layout.group(inter.groups["deepseek_v4_c2"])
    assert c2 is not None and c2.pages[0].arrangement == INTERLEAVED
    fp8 = derive("m", pools(V41_FP4, "fp8"), FP)
    assert fp8.layout.layout_id != split.layout.layout_id
    assert derive("m", pools(V41_FP4), {**FP, "pp_rank": "1"}).layout.layout_id != split.layout.layout_id


def test_an_swa_pool_is_refused_naming_the_flag() -> None:
    swa = Pool("swa", 61, 5_400_000 // 61, PAGE, None)
    with pytest.raises(SwaPoolRefused, match="--enable-encoder-swa-bounded-replay"):
        derive("m", [*pools(V41_FP4), swa], FP)


def test_a_pool_whose_records_are_unknown_is_stored_whole_per_layer_and_named() -> None:
    known = pools(V41_FP4)
    unknown = [Pool(p.name, p.layers, p.item_bytes, p.page_tokens, None) if p.name == "deepseek_v4_c1" else p
               for p in known]
    g = derive("m", unknown, FP)
    assert g.opaque == ("deepseek_v4_c1",)
    c1 = g.layout.group(g.groups["deepseek_v4_c1"])
    assert c1 is not None and c1.block_bytes == 73_728 and c1.pages[0].scale == 0
    assert dict(g.layout.fingerprint)["pool.deepseek_v4_c1"].endswith("record=opaque")
    # a record that does not fill the item the way SGLang pads it is not trusted either
    off = [Pool(p.name, p.layers, p.item_bytes + 64, p.page_tokens, p.record) if p.name == "deepseek_v4_c2" else p
           for p in known]
    assert derive("m", off, FP).opaque == ("deepseek_v4_c2",)


def test_each_pools_record_is_found_from_its_size_among_the_arrangement_sglang_picks() -> None:
    g = derive("m", pools(V4), FP)
    assert {p.record.name for p in g.pools.values() if p.record} == {"v4", "indexer-mxfp4-128"}
    assert {p.name: p.record.name for p in pools(V41_FP4, "fp8") if p.record}["deepseek_v4_c2_indexer"] == \
        "indexer-fp8-128"
    # the interleaved arrangement of the same size is offered only when SGLang can pick it: never both
    both = pools(V41_FP4, mains=[*SPLIT_MAINS, *NEW_MAINS])
    assert {p.name for p in both if p.record is None} == {"deepseek_v4_c2", "deepseek_v4_c1"}
    assert derive("m", both, FP).opaque == ("deepseek_v4_c1", "deepseek_v4_c2")
