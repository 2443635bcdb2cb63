"""The page geometry of SGLang's DeepSeek-V4.1 HiCache pools, as kvstore stores them.

SGLang 0.5.23 mirrors each V4.1 global cache in a host pool of its own (``DeepSeekV4PagedHostPool``):
``deepseek_v4_c2`` (the main KV of the three ratio-2 kv-source layers), ``deepseek_v4_c2_indexer``,
``deepseek_v4_c1`` (the ratio-1 layer) and ``deepseek_v4_c1_indexer``. A host page covers one FULL
page of ``page_tokens`` tokens (256): per layer one item of ``item_bytes``, holding ``page_tokens /
ratio`` records. Each pool becomes one group of a :class:`PageLayout` (its page: one ``PageSpec`` per
layer, side by side, as ``page_first`` host memory holds it and ``get_data_page`` flattens it).

A backend sees only the host pools (their layers, ``item_bytes`` and page tokens), not the device pools
whose records they mirror, so each pool's record is the one of its kind whose pages SGLang pads to
exactly ``item_bytes`` (:func:`fit`):

- main KV, SGLang's ``KVLayout``s (sglang/kernels/ops/attention/dsv4/kv_layout.py): ``v41_fp4`` 288 B =
  256 e2m1 + 32 e4m3, ``v4`` 584 B = 576 + 8 UE8M0 (Hopper), ``v41`` 528 B = 512 + 16, block-split (all
  data rows, then all scale rows), each padded to its ``page_align``; their interleaved ``_new``
  arrangements hold records of the same size, so the backend offers only the arrangement SGLang's
  ``select_dsv4_kv_layout`` can pick (``_new`` only under ``SGLANG_DSV4_KV_LAYOUT=v41_new``);
- indexer: MXFP4 ``index_head_dim / 2`` + ``index_head_dim / 32`` or FP8 ``index_head_dim`` + 4 (fp32
  scale), values then scales.

Two arrangements of the same size hold different bytes, so the layout's fingerprint names each pool's
record layout: a page of one is never served to the other. A pool no record (or more than one) fits
is stored as one opaque page per layer, still verified and bit-exact, and ``Geometry.opaque`` names it.

Importable without SGLang (the daemon's tests use it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.engines.pages.records import Record
from kvstore.format.page_layout import INTERLEAVED, SPLIT, GroupSpec, PageLayout, PageSpec

#: SGLang's sliding-window pools: never persisted (kvstore keeps only the global KV; the model replays the window)
SWA_POOLS = frozenset({"swa", "auxiliary_swa", "draft_swa"})
#: The pool a host page's existence is anchored on: SGLang's ``LogicalHostPool``, 0 bytes a page
ANCHOR = "kv"
_RATIO = re.compile(r"_c(\d+)(?:_|$)")


class SwaPoolRefused(ValueError):
    """SGLang registered a sliding-window pool: kvstore persists only the global KV."""


@dataclass(frozen=True)
class Pool:
    """One host pool as the backend sees it: ``layers`` items of ``item_bytes`` per page of ``page_tokens``."""

    name: str
    layers: int
    item_bytes: int
    page_tokens: int
    record: Record | None  # None: not readable from the device pool (stored opaque)

    @property
    def page_bytes(self) -> int:
        return self.layers * self.item_bytes

    @property
    def ratio(self) -> int | None:
        m = _RATIO.search(self.name)
        return int(m.group(1)) if m else None


def main_record(kv_layout: Any) -> Record | None:
    """The record of one of SGLang's main-KV layouts (its ``KVLayout``); None: not one."""
    try:
        data, scale, align = int(kv_layout.data_bytes), int(kv_layout.scale_bytes), int(kv_layout.page_align)
        interleaved = bool(kv_layout.is_interleaved)
        name = str(kv_layout.value)
    except (AttributeError, TypeError, ValueError, KeyError):
        return None
    return Record(data, scale, INTERLEAVED if interleaved else SPLIT, align, name)


def indexer_records(index_head_dim: int = 128) -> list[Record]:
    """The indexer's fused records (values, then scales): MXFP4 and FP8."""
    return [Record(index_head_dim // 2, index_head_dim // 32, SPLIT, 1, f"indexer-mxfp4-{index_head_dim}"),
            Record(index_head_dim, 4, SPLIT, 1, f"indexer-fp8-{index_head_dim}")]


def fit(name: str, layers: int, item_bytes: int, page_tokens: int, mains: Sequence[Record],
        indexers: Sequence[Record]) -> Pool:
    """The pool ``name`` with the one record of its kind (an ``_indexer`` pool's, or a main one's) whose
    pages SGLang pads to exactly ``item_bytes``; with no record when none or several do (then it is opaque)."""
    pool = Pool(name, layers, item_bytes, page_tokens, None)
    fits = [r for r in (indexers if name.endswith("_indexer") else mains)
            if item_pages(Pool(name, layers, item_bytes, page_tokens, r)) is not None]
    return Pool(name, layers, item_bytes, page_tokens, fits[0]) if len(fits) == 1 else pool


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def item_pages(pool: Pool) -> list[PageSpec] | None:
    """The pages of one host page of ``pool``: one per layer, each ``item_bytes``; None: the record
    does not fill the item the way SGLang pads it (then the pool is opaque)."""
    rec, ratio = pool.record, pool.ratio
    if rec is None or not ratio or pool.page_tokens % ratio:
        return None
    states = pool.page_tokens // ratio
    if _round_up(states * rec.nbytes, rec.align) != pool.item_bytes:
        return None
    return [PageSpec(f"{pool.name}.L{i}", i * pool.item_bytes, states, rec.data, rec.scale, rec.arrangement,
                     pool.item_bytes) for i in range(pool.layers)]


@dataclass(frozen=True)
class Geometry:
    """The page layout of an SGLang server's pools and, per pool, its group index."""

    layout: PageLayout
    groups: Mapping[str, int]
    pools: Mapping[str, Pool]
    opaque: tuple[str, ...]  # pools stored as opaque pages (their records unknown)

    @property
    def bytes_per_token(self) -> float:
        return float(self.layout.bytes_per_token)


def derive(model: str, pools: Sequence[Pool], fingerprint: Mapping[str, str]) -> Geometry:
    """The page layout of ``pools`` (sorted by name; a pool's group is its place in that order) for
    ``model``, with ``fingerprint`` (ranks, versions) and every pool's geometry and record layout in
    the layout's fingerprint. SwaPoolRefused for a sliding-window pool, ValueError for none at all."""
    swa = sorted(p.name for p in pools if p.name in SWA_POOLS)
    if swa:
        raise SwaPoolRefused(
            f"SGLang registered the sliding-window pool(s) {swa} with kvstore's HiCache backend: kvstore persists "
            "only DeepSeek-V4.1's global KV and never the SWA window, which the model rebuilds by replaying the "
            "last 128 tokens. Launch SGLang with --enable-encoder-swa-bounded-replay (then no swa pool exists).")
    data = sorted((p for p in pools if p.name != ANCHOR), key=lambda p: p.name)
    if not data:
        raise ValueError("SGLang registered no host pool with data: nothing for kvstore to store")
    fp = {"model": model, **fingerprint}
    groups: list[GroupSpec] = []
    opaque: list[str] = []
    for i, p in enumerate(data):
        pages = item_pages(p)
        if pages is None:
            opaque.append(p.name)
            pages = [PageSpec(f"{p.name}.L{j}.opaque", j * p.item_bytes, 1, p.item_bytes, 0, SPLIT, p.item_bytes)
                     for j in range(p.layers)]
        rec = p.record.name if p.record is not None and p.name not in opaque else "opaque"
        fp[f"pool.{p.name}"] = f"layers={p.layers},item_bytes={p.item_bytes},page_tokens={p.page_tokens},record={rec}"
        groups.append(GroupSpec(i, p.page_tokens, p.page_bytes, tuple(pages)))
    layout = PageLayout(model, "sglang", tuple(sorted(fp.items())), tuple(groups))
    return Geometry(layout, {p.name: i for i, p in enumerate(data)}, {p.name: p for p in data}, tuple(opaque))
