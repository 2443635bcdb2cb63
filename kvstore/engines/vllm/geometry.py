"""The page geometry of vLLM's DeepSeek-V4.1 blocks, derived from what vLLM's planner made.

What vLLM 0.33 offloads for V4.1 is its prefix-cacheable KV cache group(s): the compressed main KV
and indexer K of the kv-source layers. The tier sees vLLM's ``OffloadingConfig``: per offloaded
group its id, tokens per block and layer names, and the engine's block stride
(``worker_kv_bytes_per_block``). It does not see the per-layer specs, so they are rebuilt here
from the same inputs V4.1's cache modules use (``vllm/models/deepseek_v41/attention.py``
``get_kv_cache_spec``): a page holds ``tokens_per_block / m`` records of the layer's compression
ratio ``m`` (the model's ``compress_ratios``), padded to the page alignment. Pages are packed
the way vLLM's planner packs a group (``kv_cache_planning.get_kv_cache_config_from_groups``):
the layers of one spec side by side, specs in the order their first layer appears in the group,
from byte 0 of the block; the stride is then padded (an lcm of every group's alignments).

What the tier cannot read from vLLM is the indexer's dtype (``indexer_kv_dtype``, ``auto`` =
fp8): both are derived and the one whose pages fill the engine's stride is taken (when the stride
has room for either, the tier's ``indexer_dtype`` setting decides). A block that no candidate fits
is stored as one opaque page, and the tier counts and reports it (``tier.py``). The record formats (which bytes of a
record are scales), from ``cache_utils.py`` and ``indexer_k_store.py``:

- main ``nvfp4_ds_mla`` (SM100): 288 B = 256 e2m1 + 32 e4m3, interleaved; 512-B pages;
- main ``fp8_ds_mla`` with V4.1's MXFP8 record (SM100): 528 B = 512 e4m3 + 16 UE8M0, interleaved;
- main ``fp8_ds_mla`` elsewhere (H100/H200, and what ``auto``/``fp8`` resolve to there): 584 B =
  576 (448 e4m3 + 64 bf16) + 8 UE8M0, split (data rows, then scale rows); 576-B pages;
- indexer (split: values, then scales): MXFP4 68 B = 64 + 4 UE8M0, or FP8 132 B = 128 + fp32;
  its pages take the main pages' alignment.

Importable without vLLM (the daemon's tests use it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.engines.pages.records import Record
from kvstore.format.page_layout import INTERLEAVED, SPLIT, GroupSpec, PageLayout, PageSpec

INDEXER_DTYPES = ("fp8", "mxfp4")
_LAYER = re.compile(r"layers\.(\d+)\.")


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class EngineGroup:
    """One offloaded KV cache group as vLLM's OffloadingConfig describes it."""

    group: int  # the KV cache config's group id (what an OffloadKey names)
    tokens_per_block: int
    layer_names: tuple[str, ...]


@dataclass(frozen=True)
class Records:
    """The records of one engine configuration (a record family and an indexer dtype)."""

    cache_dtype: str
    mxfp8_record: bool
    indexer_dtype: str
    main: Record
    indexer: Record


def records(cache_dtype: str, mxfp8_record: bool, indexer_dtype: str, index_head_dim: int = 128) -> Records | None:
    """The records vLLM's V4.1 cache modules use for this configuration; None: not a V4.1 one."""
    if cache_dtype == "nvfp4_ds_mla" and mxfp8_record:
        main = Record(256, 32, INTERLEAVED, 512)
    elif cache_dtype == "fp8_ds_mla":
        main = Record(512, 16, INTERLEAVED, 512) if mxfp8_record else Record(576, 8, SPLIT, 576)
    else:
        return None
    if indexer_dtype == "mxfp4":
        idx = Record(index_head_dim // 2, index_head_dim // 32, SPLIT, main.align)
    elif indexer_dtype == "fp8":
        idx = Record(index_head_dim, index_head_dim // 128 * 4, SPLIT, main.align)
    else:
        return None
    return Records(cache_dtype, mxfp8_record, indexer_dtype, main, idx)


def layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def is_indexer(name: str) -> bool:
    return name.endswith("indexer.k_cache")


def block_pages(g: EngineGroup, rec: Records, ratios: Sequence[int]) -> list[PageSpec] | None:
    """One block's pages of group ``g`` as vLLM's planner packs them: layers of one spec side by
    side, specs in the order of their first layer, from byte 0. None: a layer this derivation
    does not know (not a V4.1 kv-source cache)."""
    by_spec: dict[tuple[bool, int], list[tuple[str, int]]] = {}
    for name in g.layer_names:
        layer = layer_of(name)
        if layer is None or layer >= len(ratios) or ratios[layer] not in (1, 2):
            return None
        by_spec.setdefault((is_indexer(name), ratios[layer]), []).append((name, layer))
    pages: list[PageSpec] = []
    off = 0
    for (indexer, m), layers in by_spec.items():
        r = rec.indexer if indexer else rec.main
        states = g.tokens_per_block // m
        size = _round_up(states * (r.data + r.scale), r.align)
        for _, layer in layers:
            pages.append(PageSpec(f"{'index' if indexer else 'main'}.L{layer}", off, states, r.data, r.scale,
                                  r.arrangement, size))
            off += size
    return pages


@dataclass(frozen=True)
class Derived:
    """A page layout and how it was found: ``records`` None means every block is opaque, for ``reason``."""

    layout: PageLayout
    records: Records | None
    padding: int  # bytes of each engine block past its pages (never stored)
    reason: str = ""

    @property
    def opaque(self) -> bool:
        return self.records is None


def derive(model: str, cache_dtype: str, mxfp8_record: bool, groups: Sequence[EngineGroup], stride: int,
           blocks_per_chunk: int, ratios: Sequence[int] | None, fingerprint: dict[str, str],
           indexer_dtypes: Sequence[str] = INDEXER_DTYPES, index_head_dim: int = 128) -> Derived:
    """The page layout of vLLM chunks of ``blocks_per_chunk`` blocks, each ``stride`` bytes apart
    (the engine's ``worker_kv_bytes_per_block``): of the candidate record families (``cache_dtype``'s;
    both when it is unresolved: ``auto`` and ``fp8`` reach the scheduler as the model's dtype, and
    V4.1's attention resolves them in the workers) and indexer dtypes, the one whose pages fit the
    stride; when several do, the largest, if what is left is less than a page (else the tier cannot
    tell them apart: every block is opaque until ``indexer_dtype`` is set). Groups alias from byte
    0 of a block (vLLM offloads the whole packed block for each), so each keeps its own pages."""
    fits: list[tuple[int, Records, list[list[PageSpec]]]] = []
    reason = f"cache dtype {cache_dtype!r} (V4.1 record {mxfp8_record}) is no V4.1 record family"
    if ratios is None:
        reason = "the model's compress_ratios could not be read"
    families = (() if "+" in cache_dtype else (cache_dtype,) if cache_dtype.endswith("_ds_mla")
                else ("fp8_ds_mla", "nvfp4_ds_mla"))
    for family, dtype in ((f, d) for f in families for d in indexer_dtypes) if ratios is not None else ():
        assert ratios is not None
        rec = records(family, mxfp8_record, dtype, index_head_dim)
        if rec is None:
            continue
        derived = [block_pages(g, rec, ratios) for g in groups]
        if any(p is None or not p for p in derived):
            reason = f"a layer of {[g.layer_names for g in groups]} is not a V4.1 kv-source cache"
            continue
        pages = [p for p in derived if p is not None]
        end = max(p[-1].offset + p[-1].page_bytes for p in pages)
        if end > stride:
            reason = f"no record family's pages fit the engine's {stride}-byte block ({family}, {dtype}: {end})"
            continue
        fits.append((end, rec, pages))
    fits.sort(key=lambda f: -f[0])
    best = fits[0] if fits else None
    if best is not None and len(fits) > 1 and stride - best[0] >= min(s.page_bytes for p in best[2] for s in p):
        reason = (f"the pages of {len(fits)} record families fit the engine's {stride}-byte block with room to "
                  "spare: set the tier's indexer_dtype")
        best = None
    fp = {"model": model, "kv_cache_dtype": cache_dtype, "mxfp8_record": str(mxfp8_record).lower(),
          "blocks_per_chunk": str(blocks_per_chunk), "stride": str(stride), **fingerprint}
    specs: list[GroupSpec] = []
    if best is None:
        fp["indexer_dtype"] = "unknown"
        for g in groups:
            specs.append(GroupSpec(g.group, g.tokens_per_block * blocks_per_chunk, stride * blocks_per_chunk,
                                   (PageSpec("opaque", 0, 1, stride * blocks_per_chunk, 0, SPLIT,
                                             stride * blocks_per_chunk),)))
        return Derived(PageLayout(model, "vllm", tuple(sorted(fp.items())), tuple(specs)), None, 0, reason)
    end, rec, pages = best
    fp["indexer_dtype"], fp["kv_cache_dtype"] = rec.indexer_dtype, rec.cache_dtype
    for g, block in zip(groups, pages):
        chunk = [PageSpec(f"{p.name}.b{b}", b * stride + p.offset, p.states, p.data, p.scale, p.arrangement,
                          p.page_bytes) for b in range(blocks_per_chunk) for p in block]
        g_end = block[-1].offset + block[-1].page_bytes
        specs.append(GroupSpec(g.group, g.tokens_per_block * blocks_per_chunk,
                               (blocks_per_chunk - 1) * stride + g_end, tuple(chunk)))
    return Derived(PageLayout(model, "vllm", tuple(sorted(fp.items())), tuple(specs)), rec, stride - end)
