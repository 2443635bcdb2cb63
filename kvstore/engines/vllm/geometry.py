"""The page geometry of vLLM's DeepSeek-V4.1 blocks, as a kvstore page layout.

What vLLM 0.33 offloads for V4.1 is exactly its prefix-cacheable KV cache groups: the compressed
main KV and indexer K of the kv-source layers (2, 8, 14 at ratio m=2; 20 at m=1). One physical
block of a group holds a page of each of its layers, packed by spec (``kv_cache_planning``:
layers of one spec side by side, main pages then indexer pages), padded to the block stride; a
CPU-tier chunk holds ``blocks_per_chunk`` such blocks. Records, from
``vllm/models/deepseek_v41/common/ops/cache_utils.py`` and ``indexer_k_store.py``:

- ``nvfp4_ds_mla``: main 288 B = 256 e2m1 + 32 e4m3, interleaved (each state's scales after its data);
- ``fp8_ds_mla`` with V4.1's MXFP8 record (SM100): main 528 B = 512 e4m3 + 16 UE8M0, interleaved;
- ``fp8_ds_mla`` elsewhere (H100/H200): main 584 B = 576 (448 e4m3 + 64 bf16) + 8 UE8M0, split
  (data rows, then scale rows);
- indexer: MXFP4 68 B = 64 + 4 UE8M0, or FP8 132 B = 128 + an fp32 scale.

Indexer pages are split (values first, then scales). A page holds ``block_size / m`` states and is
padded to the engine's alignment (512 B, or 576 for the V4 record). The geometry decides only
which bytes the store compresses (scale rows) and how it counts them: every byte of a chunk is
kept and round-trips bit-exact whatever the arrangement really is, and a chunk whose size does
not match the derived pages is stored as one opaque page (verified all the same).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.format.page_layout import INTERLEAVED, SPLIT, GroupSpec, PageLayout, PageSpec

#: main record by (cache dtype, V4.1 MXFP8 record): (data, scale, arrangement, page alignment)
MAIN_RECORDS = {
    ("nvfp4_ds_mla", True): (256, 32, INTERLEAVED, 512),
    ("nvfp4_ds_mla", False): (256, 32, INTERLEAVED, 512),
    ("fp8_ds_mla", True): (512, 16, INTERLEAVED, 512),
    ("fp8_ds_mla", False): (576, 8, SPLIT, 576),
}
INDEXER_RECORDS = {"mxfp4": (64, 4), "fp8": (128, 4)}
#: kv-source layers of DeepSeek-V4.1-Flash and their compression ratio
V41_SOURCES = {2: 2, 8: 2, 14: 2, 20: 1}
_LAYER = re.compile(r"layers\.(\d+)\.")


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class EngineGroup:
    """One offloaded KV cache group as vLLM's OffloadingConfig describes it."""

    group: int  # the group index in vLLM's OffloadKey
    tokens_per_block: int
    layer_names: tuple[str, ...]


def layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def is_indexer(name: str) -> bool:
    return "indexer" in name or name.endswith("k_cache")


def group_pages(g: EngineGroup, kv_cache_dtype: str, indexer_dtype: str, mxfp8_record: bool,
                blocks_per_chunk: int, ratios: dict[int, int], block_stride: int = 0) -> list[PageSpec]:
    """The pages of one chunk of group ``g``: per block (``block_stride`` apart; 0 = packed back to
    back), the main pages of its layers, then their indexer pages (vLLM packs layers by spec from
    byte 0 of the block: ``kv_cache_planning.get_kv_cache_config_from_groups``), each padded to
    the engine's alignment."""
    data, scale, arrangement, align = MAIN_RECORDS[(kv_cache_dtype, mxfp8_record)]
    idata, iscale = INDEXER_RECORDS[indexer_dtype]
    ialign = 576 if kv_cache_dtype == "fp8_ds_mla" and not mxfp8_record else 512
    mains = [n for n in g.layer_names if not is_indexer(n)]
    idxs = [n for n in g.layer_names if is_indexer(n)]
    pages: list[PageSpec] = []
    off = 0
    for b in range(blocks_per_chunk):
        if block_stride:
            off = b * block_stride
        for names, indexer in ((mains, False), (idxs, True)):
            for n in names:
                layer = layer_of(n)
                m = ratios.get(layer, 1) if layer is not None else 1
                states = g.tokens_per_block // m
                if indexer:
                    size = _round_up(states * (idata + iscale), ialign)
                    p = PageSpec(f"index.L{layer}.b{b}", off, states, idata, iscale, SPLIT, size)
                else:
                    size = _round_up(states * (data + scale), align)
                    p = PageSpec(f"main.L{layer}.b{b}", off, states, data, scale, arrangement, size)
                pages.append(p)
                off += size
    return pages


def page_layout(model: str, kv_cache_dtype: str, indexer_dtype: str, groups: Sequence[EngineGroup],
                block_bytes: int, blocks_per_chunk: int, fingerprint: dict[str, str],
                mxfp8_record: bool = False, ratios: dict[int, int] | None = None) -> PageLayout:
    """The kvstore page layout of vLLM chunks of ``block_bytes`` (the CPU tier's chunk, without
    the alignment padding of its slot).

    vLLM offloads DeepSeek-V4's packed blocks whole, for every group (``offloading/worker.py``:
    "Offload the whole packed block as a single transfer region"), and the groups alias from byte 0
    of a block, so the bytes past a smaller group's pages are no page of that group's: only the
    largest group fills the block. When the derived pages of the largest group fill the block
    exactly (the geometry agrees with the engine's own numbers), each group's blob keeps just the
    span of its own pages; otherwise every group is kept whole as one opaque page."""
    ratios = V41_SOURCES if ratios is None else ratios
    stride = block_bytes // blocks_per_chunk
    derived: list[list[PageSpec]] = []
    if (kv_cache_dtype, mxfp8_record) in MAIN_RECORDS and indexer_dtype in INDEXER_RECORDS:
        derived = [group_pages(g, kv_cache_dtype, indexer_dtype, mxfp8_record, blocks_per_chunk, ratios, stride)
                   for g in groups]
    extents = [p[-1].offset + p[-1].page_bytes for p in derived if p]
    exact = len(extents) == len(groups) and max(extents) == block_bytes
    specs: list[GroupSpec] = []
    for i, g in enumerate(groups):
        tokens = g.tokens_per_block * blocks_per_chunk
        if exact:
            specs.append(GroupSpec(g.group, tokens, extents[i], tuple(derived[i])))
        else:
            specs.append(GroupSpec(g.group, tokens, block_bytes,
                                   (PageSpec("opaque", 0, 1, block_bytes, 0, SPLIT, block_bytes),)))
    fp = {"model": model, "kv_cache_dtype": kv_cache_dtype, "indexer_dtype": indexer_dtype,
          "mxfp8_record": str(mxfp8_record).lower(), "blocks_per_chunk": str(blocks_per_chunk), **fingerprint}
    return PageLayout(model, "vllm", tuple(sorted(fp.items())), tuple(specs))


def v41_groups(tokens_per_block: int = 256) -> list[EngineGroup]:
    """DeepSeek-V4.1-Flash's two prefix-cacheable groups as vLLM names their layers (the m=2 sources,
    then the m=1 one)."""
    def names(layers: Sequence[int]) -> tuple[str, ...]:
        return tuple(n for L in layers for n in (f"model.layers.{L}.self_attn.mla_attn",
                                                  f"model.layers.{L}.self_attn.indexer.k_cache"))
    return [EngineGroup(0, tokens_per_block, names((2, 8, 14))), EngineGroup(1, tokens_per_block, names((20,)))]
