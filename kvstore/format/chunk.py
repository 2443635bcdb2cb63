"""The unit of storage: a self-describing, checksummed binary chunk.

A chunk holds C consecutive tokens of one sequence: for each persisted cache of the layout its
packed entries for that span (codes and scales as separate contiguous arrays), and the token ids.
docs/FORMAT.md gives the byte layout; this module is its only writer and reader.

    header (72 B) | section table (16 B x n) | codes sections | scales sections | token ids | xxh3-64

Codes come first and scales + token ids last, so a storage tier can compress only the tail
(FP4 codes of Gaussian data are incompressible; E4M3 scale bytes shrink ~2.3x under zstd).
Decoding is zero-copy: sections are numpy views on the caller's buffer.
"""

from __future__ import annotations

import functools
import itertools
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvstore.format.keys import KEY_BYTES, token_bytes
from kvstore.format.layout import Layout

if TYPE_CHECKING:
    import torch

MAGIC = b"KVCK"
VERSION = 1
_HEADER = struct.Struct("<4sHHIIQ16s16sIHHII")  # see docs/FORMAT.md
_SECTION = struct.Struct("<HBBIII")
HEADER_BYTES = _HEADER.size  # 72
_COMPRESSIBLE, _COMPRESSIBLE_AT = struct.Struct("<I"), 64  # the header's compressible_offset field
SECTION_BYTES = _SECTION.size  # 16
CHECKSUM_BYTES = 8
ALIGN = 16
KIND_CODES, KIND_SCALES = 0, 1
MAX_CHUNK_BYTES = 1 << 31


class ChunkError(ValueError):
    """A blob is not a valid chunk; the subclass says why. Callers treat any of them as a miss."""


class TruncatedChunk(ChunkError):
    pass


class OversizedChunk(ChunkError):
    pass


class BadMagic(ChunkError):
    pass


class UnsupportedVersion(ChunkError):
    pass


class LayoutMismatch(ChunkError):
    pass


class ChecksumMismatch(ChunkError):
    pass


class MalformedChunk(ChunkError):
    pass


@dataclass(frozen=True)
class Entries:
    """Packed entries of one cache over a span: ``codes [n, code_bytes]``, ``scales [n, scale_bytes]``."""

    codes: np.ndarray
    scales: np.ndarray

    @classmethod
    def of(cls, codes: torch.Tensor | np.ndarray, scales: torch.Tensor | np.ndarray) -> Entries:
        def arr(t: torch.Tensor | np.ndarray) -> np.ndarray:
            return t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)  # type: ignore[union-attr]

        return cls(arr(codes), arr(scales))

    @property
    def n(self) -> int:
        return int(self.codes.shape[0])


@dataclass(frozen=True)
class Header:
    version: int
    header_bytes: int
    total_bytes: int
    token_count: int
    start: int
    layout_id: bytes
    key: bytes
    tokens_offset: int
    n_sections: int
    compressible_offset: int


@dataclass(frozen=True)
class Chunk:
    """A decoded chunk: views into the buffer it was decoded from."""

    header: Header
    token_ids: np.ndarray  # uint32 [token_count]
    entries: dict[str, Entries]

    @property
    def key(self) -> bytes:
        return self.header.key

    @property
    def start(self) -> int:
        return self.header.start

    @property
    def token_count(self) -> int:
        return self.header.token_count


def _pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def encoded_size(layout: Layout, token_count: int) -> int:
    """Exact byte size of a chunk of ``token_count`` tokens under ``layout``."""
    off = _pad(HEADER_BYTES + SECTION_BYTES * 2 * len(layout.caches))
    for c in layout.caches:
        off += _pad(c.entries_for(token_count) * c.code_bytes)
    for c in layout.caches:
        off += _pad(c.entries_for(token_count) * c.scale_bytes)
    return off + 4 * token_count + CHECKSUM_BYTES


def encode(layout: Layout, *, key: bytes, start: int, token_ids: object,
           entries: Mapping[str, Entries]) -> bytes:
    """Build a chunk. ``entries`` maps every cache name of the layout to its packed entries for the
    span; each cache must hold exactly ``token_count // m`` entries of the layout's widths."""
    ids = token_bytes(token_ids)  # type: ignore[arg-type]
    n_tok = len(ids) // 4
    if len(key) != KEY_BYTES:
        raise ValueError(f"chunk key must be {KEY_BYTES} bytes, got {len(key)}")
    if set(entries) != {c.name for c in layout.caches}:
        raise ValueError(f"entries for {sorted(entries)} do not match layout caches "
                         f"{[c.name for c in layout.caches]}")
    sections: list[tuple[int, int, np.ndarray]] = []
    for kind in (KIND_CODES, KIND_SCALES):
        for i, c in enumerate(layout.caches):
            e = entries[c.name]
            want_n, width = c.entries_for(n_tok), (c.code_bytes if kind == KIND_CODES else c.scale_bytes)
            arr = e.codes if kind == KIND_CODES else e.scales
            if arr.dtype != np.uint8 or arr.shape != (want_n, width):
                raise ValueError(f"cache {c.name}: {'codes' if kind == KIND_CODES else 'scales'} must be "
                                 f"uint8 [{want_n}, {width}] for {n_tok} tokens, got {arr.dtype} "
                                 f"{list(arr.shape)}")
            sections.append((i, kind, arr))
    table_end = _pad(HEADER_BYTES + SECTION_BYTES * len(sections))
    total = encoded_size(layout, n_tok)
    buf = bytearray(total)
    mv = memoryview(buf)
    off, compressible = table_end, 0
    for s_i, (cache_i, kind, arr) in enumerate(sections):
        if kind == KIND_SCALES and not compressible:
            compressible = off
        length = arr.size
        _SECTION.pack_into(buf, HEADER_BYTES + s_i * SECTION_BYTES, cache_i, kind, 0, arr.shape[0], off, length)
        mv[off : off + length] = np.ascontiguousarray(arr).reshape(-1).data
        off += _pad(length)
    tokens_offset = off
    mv[off : off + len(ids)] = ids
    _HEADER.pack_into(buf, 0, MAGIC, VERSION, table_end, total, n_tok, start, layout.layout_id, key,
                      tokens_offset, len(sections), 0, compressible or tokens_offset, 0)
    struct.pack_into("<Q", buf, total - CHECKSUM_BYTES, xxhash.xxh3_64_intdigest(mv[: total - CHECKSUM_BYTES]))
    return bytes(buf)


def read_header(blob: bytes | bytearray | memoryview) -> Header:
    """Parse and sanity-check the fixed header (no checksum). Raises a :class:`ChunkError`."""
    mv = memoryview(blob)
    if len(mv) < HEADER_BYTES + CHECKSUM_BYTES:
        raise TruncatedChunk(f"chunk is {len(mv)} bytes, shorter than its {HEADER_BYTES}-byte header")
    (magic, version, header_bytes, total, n_tok, start, layout_id, key, tokens_offset, n_sections, _flags,
     compressible, _reserved) = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise BadMagic(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}: not a kvstore chunk")
    if version != VERSION:
        raise UnsupportedVersion(f"chunk format version {version}; this build reads version {VERSION}")
    if total > MAX_CHUNK_BYTES:
        raise OversizedChunk(f"chunk declares {total} bytes, over the {MAX_CHUNK_BYTES}-byte limit")
    if len(mv) < total:
        raise TruncatedChunk(f"chunk is {len(mv)} bytes but declares {total}")
    if len(mv) > total:
        raise OversizedChunk(f"chunk is {len(mv)} bytes but declares {total}: trailing data")
    table_end = HEADER_BYTES + SECTION_BYTES * n_sections
    if header_bytes < table_end:
        raise MalformedChunk(f"header_bytes {header_bytes} is inside the {n_sections}-entry section table "
                             f"(which ends at {table_end})")
    if tokens_offset + 4 * n_tok > total - CHECKSUM_BYTES:
        raise MalformedChunk(f"token ids [{tokens_offset}, {tokens_offset + 4 * n_tok}) run past the checksum "
                             f"at {total - CHECKSUM_BYTES}")
    if tokens_offset < header_bytes:  # so the section table, too, lies within the chunk
        raise MalformedChunk(f"tokens_offset {tokens_offset} is before header_bytes {header_bytes}: the header "
                             f"and section table run past the sections (a {total}-byte chunk)")
    if not header_bytes <= compressible <= tokens_offset:
        raise MalformedChunk(f"compressible_offset {compressible} is outside [header_bytes {header_bytes}, "
                             f"tokens_offset {tokens_offset}]")
    return Header(version, header_bytes, total, n_tok, start, bytes(layout_id), bytes(key), tokens_offset,
                  n_sections, compressible)


def verify_checksum(blob: bytes | bytearray | memoryview) -> None:
    mv = memoryview(blob)
    (stored,) = struct.unpack_from("<Q", mv, len(mv) - CHECKSUM_BYTES)
    if xxhash.xxh3_64_intdigest(mv[: len(mv) - CHECKSUM_BYTES]) != stored:
        raise ChecksumMismatch("chunk checksum mismatch: its bytes were damaged after it was encoded")


def check(blob: bytes | bytearray | memoryview, layout: Layout, *, verify: bool = True) -> Header:
    """Everything ``decode`` rejects, without building a view: the header parsed once, the
    checksum (unless told not to), the layout, and every section's bounds. What a store needs
    to accept a chunk: one header parse and one checksum pass, no numpy."""
    h = read_header(blob)
    if verify:
        verify_checksum(blob)
    if h.layout_id != layout.layout_id:
        raise LayoutMismatch(f"chunk was written under layout {h.layout_id.hex()}, "
                             f"expected {layout.name} ({layout.layout_hex})")
    if h.n_sections != 2 * len(layout.caches):
        raise MalformedChunk(f"{h.n_sections} sections, layout {layout.name} needs {2 * len(layout.caches)}")
    table = memoryview(blob)[HEADER_BYTES : HEADER_BYTES + SECTION_BYTES * h.n_sections]
    canonical, tokens_offset, compressible = _canonical_table(layout, h.token_count)
    if h.tokens_offset == tokens_offset and h.compressible_offset == compressible and table == canonical:
        return h  # what ``encode`` writes, byte for byte: every bound below holds (one compare)
    _check_sections(_sections(blob, h), h, layout)
    return h


def _check_sections(sections: list[tuple[int, int, int, int, int]], h: Header, layout: Layout) -> None:
    """A section table other than the canonical one: every (cache, kind) once, each section of its
    cache's entry count and width, the codes sections within [header_bytes, compressible_offset],
    the scales sections within [compressible_offset, tokens_offset], no two non-empty ones
    overlapping. MalformedChunk naming the first entry that is not."""
    seen: set[tuple[int, int]] = set()
    regions: list[tuple[int, int, int]] = []
    for s_i, (cache_i, kind, n, off, length) in enumerate(sections):
        if cache_i >= len(layout.caches) or kind not in (KIND_CODES, KIND_SCALES):
            raise MalformedChunk(f"section {s_i}: cache {cache_i} kind {kind} is not in the layout")
        c = layout.caches[cache_i]
        codes = kind == KIND_CODES
        width = c.code_bytes if codes else c.scale_bytes
        what = f"section {s_i} ({c.name} {'codes' if codes else 'scales'})"
        if n != c.entries_for(h.token_count) or length != n * width:
            raise MalformedChunk(f"{what} has {n} entries / {length} bytes; expected "
                                 f"{c.entries_for(h.token_count)} x {width}")
        lo, hi = (h.header_bytes, h.compressible_offset) if codes else (h.compressible_offset, h.tokens_offset)
        if off < lo or off + length > hi:
            raise MalformedChunk(f"{what}: bytes [{off}, {off + length}) are outside [{lo}, {hi}] (the "
                                 f"{'codes' if codes else 'scales'} region: compressible_offset splits codes "
                                 f"from scales)")
        if (cache_i, kind) in seen:
            raise MalformedChunk(f"{what}: a second {'codes' if codes else 'scales'} section of that cache")
        seen.add((cache_i, kind))
        if length:
            regions.append((off, off + length, s_i))
    if len(seen) != h.n_sections:
        raise MalformedChunk("a cache is missing its codes or scales section")
    regions.sort()
    for (_, end, a), (start, _, b) in itertools.pairwise(regions):
        if start < end:
            raise MalformedChunk(f"sections {a} and {b} overlap")


@functools.lru_cache(maxsize=64)
def _canonical_table(layout: Layout, token_count: int) -> tuple[bytes, int, int]:
    """The section table ``encode`` writes for ``token_count`` tokens of ``layout``, where the token
    ids then start, and its compressible_offset: where the codes sections end and the first scales
    section starts (memoized: a store sees a handful of (layout, span) pairs)."""
    out = bytearray()
    off = _pad(HEADER_BYTES + SECTION_BYTES * 2 * len(layout.caches))
    split = off
    for kind in (KIND_CODES, KIND_SCALES):
        if kind == KIND_SCALES:
            split = off
        for i, c in enumerate(layout.caches):
            n = c.entries_for(token_count)
            length = n * (c.code_bytes if kind == KIND_CODES else c.scale_bytes)
            out += _SECTION.pack(i, kind, 0, n, off, length)
            off += _pad(length)
    return bytes(out), off, split


def _sections(blob: bytes | bytearray | memoryview, h: Header) -> list[tuple[int, int, int, int, int]]:
    """(cache index, kind, entries, offset, length) of each section-table entry."""
    mv = memoryview(blob)
    out = []
    for s_i in range(h.n_sections):
        cache_i, kind, _pad_b, n, off, length = _SECTION.unpack_from(mv, HEADER_BYTES + s_i * SECTION_BYTES)
        out.append((cache_i, kind, n, off, length))
    return out


def token_ids_raw(blob: bytes | bytearray | memoryview, h: Header) -> memoryview:
    """The token ids as stored (uint32 LE bytes): a view, ready to hash (``keys.chunk_key_raw``)."""
    return memoryview(blob)[h.tokens_offset : h.tokens_offset + 4 * h.token_count]


def decode(blob: bytes | bytearray | memoryview, layout: Layout, *, verify: bool = True) -> Chunk:
    """Parse a chunk written under ``layout``: zero-copy views, checksum verified unless told not to."""
    h = check(blob, layout, verify=verify)
    mv = memoryview(blob)
    parts: dict[str, dict[int, np.ndarray]] = {c.name: {} for c in layout.caches}
    for cache_i, kind, n, off, length in _sections(blob, h):
        c = layout.caches[cache_i]
        width = c.code_bytes if kind == KIND_CODES else c.scale_bytes
        parts[c.name][kind] = np.frombuffer(mv, np.uint8, length, off).reshape(n, width)
    entries = {name: Entries(p[KIND_CODES], p[KIND_SCALES]) for name, p in parts.items()}
    ids = np.frombuffer(mv, "<u4", h.token_count, h.tokens_offset)
    return Chunk(h, ids, entries)


def compressible_offset(blob: bytes | bytearray | memoryview) -> int:
    """Where the compressible tail (scales, token ids, checksum) starts; 0 if ``blob`` is no chunk.
    A peek at one header field, not a parse: the store has parsed and checked the header already
    (``check``), and a wrong answer here only costs compression, never correctness."""
    mv = memoryview(blob)
    if len(mv) < HEADER_BYTES or bytes(mv[:4]) != MAGIC:
        return 0
    (offset,) = _COMPRESSIBLE.unpack_from(mv, _COMPRESSIBLE_AT)
    return offset if offset <= len(mv) else 0
