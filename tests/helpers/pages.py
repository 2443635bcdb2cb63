"""DeepSeek-V4.1-shaped engine page layouts built by hand, for the page blob and page load tests
(what vLLM's planner really lays out is tests/engines/vllm_tier/'s business: here only the format is tested)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.client import Client
from kvstore.engines.pages.records import Record
from kvstore.engines.sglang.geometry import Pool, derive, fit
from kvstore.format import page
from kvstore.format.manifest import Kind, Manifest, Retention
from kvstore.format.page_layout import INTERLEAVED, SPLIT, GroupSpec, PageLayout, PageSpec

#: (data, scale, arrangement) per record: main KV, indexer K
RECORDS = {"nvfp4_ds_mla": ((256, 32, "interleaved"), (64, 4, "split")),  # Blackwell, MXFP4 indexer
           "fp8_ds_mla": ((576, 8, "split"), (128, 4, "split"))}  # Hopper's 584-B records, fp8 indexer


def _group(group: int, layers: tuple[tuple[int, int], ...], dtype: str) -> GroupSpec:
    """The main pages of ``layers`` ((layer, states) each), then their indexer pages, packed from byte 0."""
    pages, at = [], 0
    for kind, (data, scale, arrangement) in zip(("main", "index"), RECORDS[dtype]):
        for layer, states in layers:
            n = states * (data + scale)
            pages.append(PageSpec(f"{kind}.L{layer}", at, states, data, scale, arrangement, n))
            at += n
    return GroupSpec(group, 256, at, tuple(pages))


def v41_layout(dtype: str = "nvfp4_ds_mla", fingerprint: dict[str, str] | None = None) -> PageLayout:
    """Two groups: layers 2, 8, 14 (m=2: 128 states per 256-token block), and layer 20 (m=1)."""
    return PageLayout("deepseek-ai/DeepSeek-V4.1-Flash", "vllm",
                      tuple(sorted({"kv_cache_dtype": dtype, **(fingerprint or {})}.items())),
                      (_group(0, ((2, 128), (8, 128), (14, 128)), dtype), _group(1, ((20, 256),), dtype)))


def opaque_layout(name: str, block_bytes: int = 4096, fingerprint: dict[str, str] | None = None) -> PageLayout:
    """Two groups (0 and 1) of small blocks kept as one opaque page each: the page surfaces' fuzz and
    isolation tests, where the blocks' structure does not matter and small blobs keep them quick."""
    opaque = (PageSpec("opaque", 0, 1, block_bytes, 0, "split", block_bytes),)
    return PageLayout(name, "vllm", tuple(sorted((fingerprint or {}).items())),
                      tuple(GroupSpec(g, 256, block_bytes, opaque) for g in (0, 1)))


def scaled_block(layout: PageLayout, group: int, seed: int) -> bytes:
    """A block of ``group``: random codes, its scale bytes in a narrow range (as E4M3/UE8M0 scales of one
    tensor are), wherever its pages keep them (``split``: the scale rows; ``interleaved``: each record's)."""
    rng = np.random.default_rng(seed)
    g = layout.group(group)
    assert g is not None
    blk = rng.integers(0, 256, g.block_bytes, dtype=np.uint8)
    for p in g.pages:
        if p.arrangement == "split":
            blk[p.offset + p.data_bytes : p.offset + p.record_bytes] = rng.integers(0x30, 0x38, p.scale_bytes)
        else:
            rec = blk[p.offset : p.offset + p.record_bytes].reshape(p.states, p.data + p.scale)
            rec[:, p.data :] = rng.integers(0x30, 0x38, (p.states, p.scale))
    return blk.tobytes()


def save_page_session(address: str, layout: PageLayout, namespace: str, blocks: Sequence[bytes],
                      session_id: str = "s") -> tuple[list[bytes], list[bytes]]:
    """A page session of ``blocks`` (block i of group i % 2, hash ``<namespace>/<i>``) saved whole through the
    daemon at ``address``, its layout registered first; (the page keys, the page blobs), in order."""
    hashes = [f"{namespace}/{i}".encode() for i in range(len(blocks))]
    keys = [page.page_key(layout.layout_id, namespace, i % 2, h) for i, h in enumerate(hashes)]
    blobs = [page.encode(layout, i % 2, h, k, b) for i, (h, k, b) in enumerate(zip(hashes, keys, blocks))]
    with Client(address=address) as c:
        c.register_layout(layout.definition())
        c.save_session(Manifest(session_id, namespace, layout.layout_id, 256 * len(blocks), 0, tuple(keys), b"", (),
                                retention=Retention(ttl_s=3600), kind=Kind.ENGINE_PAGES), blobs)
    return keys, blobs


#: Page records of the shapes SGLang's DeepSeek-V4.1 host pools hold, built by hand for the format and
#: layout-rule tests (which records SGLang really picks, and its pools' sizes, are tested under its own
#: stack: tests/engines/sglang_tier/): two of one size in two arrangements, padded to other alignments
SPLIT_288 = Record(256, 32, SPLIT, 256, "split-288")
INTERLEAVED_288 = Record(256, 32, INTERLEAVED, 288, "interleaved-288")
SPLIT_528 = Record(512, 16, SPLIT, 512, "split-528")
INDEXER_68 = Record(64, 4, SPLIT, 1, "indexer-68")
RANKS = {"tp_size": "1", "tp_rank": "replicated", "pp_rank": "0", "pp_size": "1"}
POOL_PAGE_TOKENS = 256


def padded_item(states: int, rec: Record) -> int:
    """An item of ``states`` records padded to the record's alignment (what ``geometry.fit`` admits)."""
    return -(-states * rec.nbytes // rec.align) * rec.align


def pool_shapes(main: Record = SPLIT_288, mains: tuple[Record, ...] | None = None) -> list[Pool]:
    """Pools named as SGLang's V4.1 pools are (the ratio in the name: 256 / ratio records a page; three
    ratio-2 layers, one ratio-1 layer, an indexer pool beside each), each record then found by ``fit`` from
    the item size alone among ``mains`` (default: ``main`` only) and ``INDEXER_68``."""
    cands = mains if mains is not None else (main,)
    out = []
    for name, layers, ratio in (("deepseek_v4_c2", 3, 2), ("deepseek_v4_c1", 1, 1)):
        states = POOL_PAGE_TOKENS // ratio
        out.append(fit(name, layers, padded_item(states, main), POOL_PAGE_TOKENS, cands, [INDEXER_68]))
        out.append(fit(f"{name}_indexer", layers, padded_item(states, INDEXER_68), POOL_PAGE_TOKENS, cands,
                       [INDEXER_68]))
    return out


def pooled_layout(main: Record) -> PageLayout:
    """The page layout of ``pool_shapes(main)``."""
    return derive("m", pool_shapes(main), RANKS).layout
