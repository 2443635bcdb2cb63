"""The page geometry of SGLang's DeepSeek-V4.1 pools (kvstore/engines/sglang/geometry.py), without SGLang:
the byte accounting of both record families, the arrangement in the fingerprint, the SWA refusal and the
opaque fallback. What SGLang's own code builds is tests/engines/sglang_tier/'s business."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import pytest

from kvstore.engines.sglang.geometry import Pool, Record, SwaPoolRefused, derive, indexer_record, main_record
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
V4 = FakeLayout("v4", 576, 8, 576)


@dataclass(frozen=True)
class FakeIndexer:
    index_head_dim: int = 128
    use_fp4_indexer: bool = True
    index_k_with_scale_buffer: object = ()


def _padded(states: int, rec: Record) -> int:
    return -(-states * rec.nbytes // rec.align) * rec.align


def pools(main: FakeLayout, indexer: FakeIndexer) -> list[Pool]:
    m, i = main_record(main), indexer_record(indexer)
    assert m is not None and i is not None
    out = []
    for name, layers, ratio in (("deepseek_v4_c2", 3, 2), ("deepseek_v4_c1", 1, 1)):
        states = PAGE // ratio
        out.append(Pool(name, layers, _padded(states, m), PAGE, m))
        out.append(Pool(f"{name}_indexer", layers, _padded(states, i), PAGE, i))
    return out


FP = {"tp_size": "1", "tp_rank": "replicated", "pp_rank": "0", "pp_size": "1"}


def test_the_v41_fp4_pools_are_890_bytes_a_token_block_split() -> None:
    g = derive("DeepSeek-V4.1-Flash", pools(V41_FP4, FakeIndexer()), FP)
    assert g.layout.bytes_per_token == 890 and not g.opaque
    sizes = {n: p.page_bytes for n, p in g.pools.items()}
    assert sizes == {"deepseek_v4_c2": 110_592, "deepseek_v4_c2_indexer": 26_112, "deepseek_v4_c1": 73_728,
                     "deepseek_v4_c1_indexer": 17_408}
    c2 = g.layout.group(g.groups["deepseek_v4_c2"])
    assert c2 is not None and len(c2.pages) == 3 and c2.tokens == PAGE
    assert {(p.states, p.data, p.scale, p.arrangement) for p in c2.pages} == {(128, 256, 32, SPLIT)}


def test_hoppers_v4_records_are_padded_to_576_and_the_padding_is_kept() -> None:
    g = derive("DeepSeek-V4.1-Flash", pools(V4, FakeIndexer()), FP)
    stored = Fraction(sum(p.page_bytes for p in g.pools.values()), PAGE)
    assert stored == Fraction(3265, 2)  # 1,632.5 B/token at rest: 584-B records, pages padded to 576 B
    assert g.layout.bytes_per_token == 1630  # the records themselves
    assert not g.opaque


def test_the_arrangement_is_in_the_fingerprint_so_same_sized_pages_are_never_shared() -> None:
    split = derive("m", pools(V41_FP4, FakeIndexer()), FP)
    inter = derive("m", pools(V41_FP4_NEW, FakeIndexer()), FP)
    assert split.pools["deepseek_v4_c2"].page_bytes == inter.pools["deepseek_v4_c2"].page_bytes
    assert split.layout.layout_id != inter.layout.layout_id
    c2 = inter.layout.group(inter.groups["deepseek_v4_c2"])
    assert c2 is not None and c2.pages[0].arrangement == INTERLEAVED
    fp8 = derive("m", pools(V41_FP4, FakeIndexer(use_fp4_indexer=False)), FP)
    assert fp8.layout.layout_id != split.layout.layout_id
    assert derive("m", pools(V41_FP4, FakeIndexer()), {**FP, "pp_rank": "1"}).layout.layout_id != split.layout.layout_id


def test_an_swa_pool_is_refused_naming_the_flag() -> None:
    swa = Pool("swa", 61, 5_400_000 // 61, PAGE, None)
    with pytest.raises(SwaPoolRefused, match="--enable-encoder-swa-bounded-replay"):
        derive("m", [*pools(V41_FP4, FakeIndexer()), swa], FP)


def test_a_pool_whose_records_are_unknown_is_stored_whole_per_layer_and_named() -> None:
    known = pools(V41_FP4, FakeIndexer())
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


def test_amds_row_grouped_fp4_indexer_is_not_read_as_fused_rows() -> None:
    @dataclass(frozen=True)
    class Aiter(FakeIndexer):
        uses_aiter_fp4_layout: bool = True

    assert indexer_record(Aiter()) is None
    assert indexer_record(FakeIndexer(index_k_with_scale_buffer=None)) is None
