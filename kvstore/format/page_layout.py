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

A definition is checked in the units the daemon computes with before any layout exists: every int
bounded so that what is derived from it (a blob's u32 header fields, bytes per token as a double,
token counts summed over many blobs as u64) fits, JSON nested at most ``MAX_DEPTH`` deep with no
non-finite numbers, strings UTF-8, and the canonical form (what the id hashes and what the daemon
stores and reads back at open) at most ``MAX_DEFINITION_BYTES``: a layout accepted once reopens.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from typing import Any

SPLIT, INTERLEAVED = "split", "interleaved"
KIND = "engine-pages"
#: A definition, as sent and in canonical form (non-ASCII as 6-byte \\u escapes), is at most this long.
MAX_DEFINITION_BYTES = 64 << 10
#: How deep a definition's JSON may nest (a layout needs 5: layout, groups, group, pages, page).
MAX_DEPTH = 8
#: A group's block is at most this long: its blob (header, hash and checksum on top) is what a save
#: buffers, and the blob's u32 header fields (total bytes, block bytes, data rows) hold it.
MAX_BLOCK_BYTES = 64 << 20
#: Tokens one block covers, at most: 2^24 (vLLM's are 16 to a few thousand), so tokens summed over
#: 2^40 blobs still fit a u64.
MAX_TOKENS = 1 << 24
#: A group index is a u32 in every blob header and key of the group.
MAX_GROUP = (1 << 32) - 1


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
        for field in ("offset", "states", "data", "scale", "page_bytes"):
            _bounded(f"page {self.name}: {field}", getattr(self, field), 0, MAX_BLOCK_BYTES)
        _utf8("a page's name", self.name)
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
        _bounded("group", self.group, 0, MAX_GROUP)
        _bounded(f"group {self.group}: tokens", self.tokens, 1, MAX_TOKENS)
        _bounded(f"group {self.group}: block_bytes", self.block_bytes, 1, MAX_BLOCK_BYTES)
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
        for what, text in (("name", self.name), ("engine", self.engine)):
            _utf8(what, text)
        for k, v in self.fingerprint:
            _utf8("a fingerprint key", k)
            _utf8(f"fingerprint[{k!r}]", v)
        if len(self._canonical) > MAX_DEFINITION_BYTES:
            raise PageLayoutError(f"a page layout's canonical definition (non-ASCII as 6-byte \\u escapes) is at most "
                                  f"{MAX_DEFINITION_BYTES} bytes, this one is {len(self._canonical)}")

    # -- identity ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"kind": KIND, "name": self.name, "engine": self.engine, "fingerprint": dict(self.fingerprint),
                "groups": [{"group": g.group, "tokens": g.tokens, "block_bytes": g.block_bytes,
                            "pages": [p.__dict__ for p in g.pages]} for g in self.groups]}

    def definition(self) -> bytes:
        """The canonical definition (what the id hashes and what the daemon stores)."""
        return self._canonical

    @cached_property
    def _canonical(self) -> bytes:
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
        """The layout a definition describes; PageLayoutError naming what is wrong. Types are exact
        (an int is a JSON integer, not 2.0, "2" or true); keys a layout does not use are ignored
        (and not in the canonical form)."""
        if len(blob) > MAX_DEFINITION_BYTES:
            raise PageLayoutError(f"a page layout definition is at most {MAX_DEFINITION_BYTES} bytes, got {len(blob)}")
        d = _parse(blob)
        if not isinstance(d, dict) or d.get("kind") != KIND:
            raise PageLayoutError(f"not a page layout definition (kind must be {KIND!r})")
        fp = _field(d, "fingerprint", dict, "")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in fp.items()):
            raise PageLayoutError("fingerprint must map strings to strings")
        groups = []
        for i, g in enumerate(_field(d, "groups", list, "")):
            at = f"groups[{i}]."
            if not isinstance(g, dict):
                raise PageLayoutError(f"groups[{i}] must be an object")
            pages = []
            for j, p in enumerate(_field(g, "pages", list, at)):
                pat = f"{at}pages[{j}]."
                if not isinstance(p, dict):
                    raise PageLayoutError(f"{at}pages[{j}] must be an object")
                pages.append(PageSpec(_field(p, "name", str, pat), _int(p, "offset", pat), _int(p, "states", pat),
                                      _int(p, "data", pat), _int(p, "scale", pat), _field(p, "arrangement", str, pat),
                                      _int(p, "page_bytes", pat)))
            groups.append(GroupSpec(_int(g, "group", at), _int(g, "tokens", at), _int(g, "block_bytes", at),
                                    tuple(pages)))
        return cls(_field(d, "name", str, ""), _field(d, "engine", str, ""), tuple(sorted(fp.items())), tuple(groups))

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


# -- reading a definition: bounded, exact ------------------------------------------------------------
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(rb"[\[\]{}]")


def _parse(blob: bytes) -> object:
    """JSON nested at most MAX_DEPTH deep (counted before parsing: a deep one never reaches the
    recursive parser), with no NaN, Infinity or number too large for a double."""
    depth = 0
    for b in _BRACKET.findall(_STRING.sub(b"", bytes(blob))):
        depth += 1 if b in b"[{" else -1
        if depth > MAX_DEPTH:
            raise PageLayoutError(f"a page layout definition nests at most {MAX_DEPTH} levels deep")
    try:
        return json.loads(blob, parse_constant=_no_constant, parse_float=_finite)
    except PageLayoutError:
        raise
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, an int of over 4300 digits
        raise PageLayoutError(f"malformed page layout definition: {type(e).__name__}: {e}") from None


def _no_constant(name: str) -> object:
    raise PageLayoutError(f"a page layout definition holds no {name}: numbers must be finite")


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise PageLayoutError(f"a page layout definition holds no number as large as {text[:32]}")
    return x


def _field(d: dict[str, Any], key: str, kind: type, at: str) -> Any:
    if key not in d:
        raise PageLayoutError(f"malformed page layout definition: {at}{key} is missing")
    v = d[key]
    if not isinstance(v, kind) or isinstance(v, bool):
        raise PageLayoutError(f"{at}{key} must be a JSON {_KINDS[kind]}, got {_show(v)}")
    return v


_KINDS: dict[type, str] = {int: "integer", str: "string", list: "list", dict: "object"}


def _int(d: dict[str, Any], key: str, at: str) -> int:
    v: int = _field(d, key, int, at)
    _bounded(f"{at}{key}", v, 0 if key != "tokens" else 1, _LIMITS.get(key, MAX_BLOCK_BYTES))
    return v


_LIMITS = {"group": MAX_GROUP, "tokens": MAX_TOKENS}


def _bounded(what: str, v: int, low: int, high: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise PageLayoutError(f"{what} must be an integer from {low} to {high}, got {_show(v)}")


def _utf8(what: str, text: str) -> None:
    try:
        text.encode()
    except UnicodeEncodeError:
        raise PageLayoutError(f"{what} is not valid UTF-8 (a lone surrogate \\uD800-\\uDFFF)") from None


def _show(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:37]}..."
