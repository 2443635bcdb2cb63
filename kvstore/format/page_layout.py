"""Engine page layouts: how an inference engine's KV block is laid out, as kvstore stores it.

A token layout (``layout.py``) describes kvstore's own chunks: entries of every cache for C
tokens. An engine keeps its KV cache in *pages* instead (vLLM: one page per layer and block, the
pages of one KV cache group side by side in one physical block) and names each block by its own
hash. A :class:`PageLayout` describes one engine configuration's blocks, group by group, down to
the rows of every page, so the daemon can check a stored block's structure, compress what
compresses (the scale rows) and count bytes per token, and never serve a block to an engine of
another configuration: the engine's fingerprint (model, cache dtypes, block size, parallelism)
is part of the definition, and the definition's hash is the layout id mixed into every key.

A page holds ``states`` records of ``data + scale`` bytes, arranged either ``split`` (all data
rows, then all scale rows: vLLM's V4 584-B records and its indexer pages) or ``interleaved``
(each record's scales right after its data: vLLM's V4.1 528-B and 288-B main records), then
zero or more padding bytes up to ``page_bytes`` (the engine's alignment). Bytes of a block no
page covers are kept as padding too: a block round-trips bit-exact whatever they hold.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from typing import Any

SPLIT, INTERLEAVED = "split", "interleaved"
KIND = "engine-pages"
MAX_DEFINITION_BYTES = 64 << 10


class PageLayoutError(ValueError):
    """A page layout definition is malformed."""


@dataclass(frozen=True)
class PageSpec:
    """One page of a block: ``states`` records at ``offset`` in the block."""

    name: str  # e.g. "main.L2", "index.L20"
    offset: int
    states: int
    data: int  # bytes of codes per record
    scale: int  # bytes of scales per record
    arrangement: str  # SPLIT or INTERLEAVED
    page_bytes: int  # with the engine's padding

    def __post_init__(self) -> None:
        if self.arrangement not in (SPLIT, INTERLEAVED):
            raise PageLayoutError(f"page {self.name}: arrangement must be {SPLIT!r} or {INTERLEAVED!r}")
        if min(self.offset, self.states, self.data, self.scale) < 0 or self.states * (self.data + self.scale) == 0:
            raise PageLayoutError(f"page {self.name}: offset, states, data and scale must be >= 0, records non-empty")
        if self.page_bytes < self.record_bytes:
            raise PageLayoutError(f"page {self.name}: {self.page_bytes} bytes cannot hold {self.states} records "
                                  f"of {self.data + self.scale} bytes")

    @property
    def record_bytes(self) -> int:
        return self.states * (self.data + self.scale)

    @property
    def data_bytes(self) -> int:
        return self.states * self.data

    @property
    def scale_bytes(self) -> int:
        return self.states * self.scale


@dataclass(frozen=True)
class GroupSpec:
    """The block of one KV cache group: its pages, side by side in ``block_bytes``."""

    group: int  # the engine's group index (part of every key of the group)
    tokens: int  # tokens one block covers
    block_bytes: int
    pages: tuple[PageSpec, ...]

    def __post_init__(self) -> None:
        if self.tokens <= 0 or self.block_bytes <= 0 or not self.pages:
            raise PageLayoutError(f"group {self.group}: tokens and block_bytes must be positive, pages non-empty")
        end = 0
        for p in sorted(self.pages, key=lambda p: p.offset):
            if p.offset < end:
                raise PageLayoutError(f"group {self.group}: page {p.name} overlaps the page before it")
            end = p.offset + p.page_bytes
        if end > self.block_bytes:
            raise PageLayoutError(f"group {self.group}: pages end at byte {end}, past the block's {self.block_bytes}")

    @cached_property
    def data_bytes(self) -> int:
        return sum(p.data_bytes for p in self.pages)

    @cached_property
    def record_bytes(self) -> int:
        return sum(p.record_bytes for p in self.pages)


@dataclass(frozen=True)
class PageLayout:
    """An engine configuration's blocks. ``fingerprint`` is what the engine says it is (model id,
    cache dtypes, block size, parallel rank and size...): two engines share blocks only when
    their layouts, fingerprints included, are equal."""

    name: str
    engine: str
    fingerprint: tuple[tuple[str, str], ...]
    groups: tuple[GroupSpec, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise PageLayoutError("a page layout needs at least one group")
        ids = [g.group for g in self.groups]
        if len(set(ids)) != len(ids):
            raise PageLayoutError(f"duplicate group indices {ids}")

    # -- identity ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"kind": KIND, "name": self.name, "engine": self.engine, "fingerprint": dict(self.fingerprint),
                "groups": [{"group": g.group, "tokens": g.tokens, "block_bytes": g.block_bytes,
                            "pages": [p.__dict__ for p in g.pages]} for g in self.groups]}

    def definition(self) -> bytes:
        """The canonical definition (what the id hashes and what the daemon stores)."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    @cached_property
    def layout_id(self) -> bytes:
        """blake2b-128 of the canonical definition, name included (the name is the engine's model)."""
        return hashlib.blake2b(self.definition(), digest_size=16).digest()

    @property
    def layout_hex(self) -> str:
        return self.layout_id.hex()

    @classmethod
    def from_definition(cls, blob: bytes) -> PageLayout:
        if len(blob) > MAX_DEFINITION_BYTES:
            raise PageLayoutError(f"a page layout definition is at most {MAX_DEFINITION_BYTES} bytes, got {len(blob)}")
        try:
            d = json.loads(blob)
            if not isinstance(d, dict) or d.get("kind") != KIND:
                raise PageLayoutError(f"not a page layout definition (kind must be {KIND!r})")
            fp = d["fingerprint"]
            if not isinstance(fp, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in fp.items()):
                raise PageLayoutError("fingerprint must map strings to strings")
            groups = tuple(
                GroupSpec(int(g["group"]), int(g["tokens"]), int(g["block_bytes"]),
                          tuple(PageSpec(str(p["name"]), int(p["offset"]), int(p["states"]), int(p["data"]),
                                         int(p["scale"]), str(p["arrangement"]), int(p["page_bytes"]))
                                for p in g["pages"]))
                for g in d["groups"])
            return cls(str(d["name"]), str(d["engine"]), tuple(sorted(fp.items())), groups)
        except PageLayoutError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise PageLayoutError(f"malformed page layout definition: {type(e).__name__}: {e}") from None

    # -- geometry ---------------------------------------------------------------------------------
    def group(self, index: int) -> GroupSpec | None:
        return self._by_index.get(index)

    @cached_property
    def _by_index(self) -> dict[int, GroupSpec]:
        return {g.group: g for g in self.groups}

    @property
    def bytes_per_token(self) -> Fraction:
        """Record bytes (data + scales, no padding) per token over every group: the formula."""
        return sum((Fraction(g.record_bytes, g.tokens) for g in self.groups), Fraction(0))
