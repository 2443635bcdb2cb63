"""Engine blocks as kvstore stores them: self-describing, checksummed page blobs.

An engine names a block by its own hash (vLLM: the chained block hash, plus the KV cache group);
kvstore keeps one blob per (block hash, group), under a key that hashes the layout id, the
namespace, the group and the block hash, so a block is never served across tenants or engine
configurations. docs/FORMAT.md ("Engine pages") gives the byte layout; this module is its only
writer and reader.

    header (64 B) | block hash | pad16 | data rows of every page | scale rows | padding | xxh3-64

The blob holds exactly the engine's block bytes, regrouped: the codes of every page first
(incompressible FP4/FP8), then every scale row, then the bytes no record covers (engine
padding), so a storage tier compresses only the tail (``compressible_offset``), as it does for
chunks. Both directions are a handful of strided copies per page; a block round-trips bit-exact.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import xxhash

from kvstore.format.page_layout import INTERLEAVED, GroupSpec, PageLayout

MAGIC = b"KVPG"
VERSION = 1
_HEADER = struct.Struct("<4sHHII16s16sIHHII")  # see docs/FORMAT.md
HEADER_BYTES = _HEADER.size  # 64
CHECKSUM_BYTES = 8
MAX_HASH_BYTES = 64
_DOMAIN = b"kvstore.page.v1\x00"
_COMPRESSIBLE_AT = 56


class PageError(ValueError):
    """A blob is not the page blob it should be; the message says why. Callers treat it as a miss."""


@dataclass(frozen=True)
class PageHeader:
    header_bytes: int
    total_bytes: int
    block_bytes: int
    layout_id: bytes
    key: bytes
    group: int
    block_hash: bytes
    compressible_offset: int


def page_key(layout_id: bytes, namespace: str, group: int, block_hash: bytes) -> bytes:
    """The 16-byte key of one engine block of ``namespace``: XXH3-128 over the domain, layout id,
    namespace, group and the engine's block hash (docs/FORMAT.md)."""
    if len(layout_id) != 16 or not 0 < len(block_hash) <= MAX_HASH_BYTES:
        raise ValueError("layout id must be 16 bytes and a block hash 1-64 bytes")
    ns = namespace.encode()
    h = xxhash.xxh3_128()
    for part in (_DOMAIN, layout_id, len(ns).to_bytes(2, "little"), ns, group.to_bytes(4, "little"),
                 len(block_hash).to_bytes(2, "little"), block_hash):
        h.update(part)
    return h.digest()


def _pad16(n: int) -> int:
    return (n + 15) & ~15


def header_bytes(hash_len: int) -> int:
    return _pad16(HEADER_BYTES + hash_len)


def blob_bytes(group: GroupSpec, hash_len: int) -> int:
    return header_bytes(hash_len) + group.block_bytes + CHECKSUM_BYTES


# A copy between the engine block and the blob payload: rows of ``cols`` bytes, taken at column
# ``col`` of ``rows`` rows that fill block[src : src + span]; placed back to back at payload[dst:].
_Op = tuple[int, int, int, int, int, int]  # (src, span, rows, col, cols, dst)


@lru_cache(maxsize=64)
def _plan(group: GroupSpec) -> tuple[_Op, ...]:
    """Where every byte of a block goes in the payload: data rows, then scale rows, then padding."""
    pages = sorted(group.pages, key=lambda p: p.offset)
    data: list[tuple[int, int, int, int, int]] = []
    scales: list[tuple[int, int, int, int, int]] = []
    pad: list[tuple[int, int, int, int, int]] = []
    end = 0
    for p in pages:
        if p.offset > end:
            pad.append((end, p.offset - end, 1, 0, p.offset - end))
        rec = p.data + p.scale
        if p.arrangement == INTERLEAVED:
            data.append((p.offset, p.record_bytes, p.states, 0, p.data))
            if p.scale:
                scales.append((p.offset, p.record_bytes, p.states, p.data, p.scale))
        else:
            data.append((p.offset, p.data_bytes, 1, 0, p.data_bytes))
            if p.scale:
                scales.append((p.offset + p.data_bytes, p.scale_bytes, 1, 0, p.scale_bytes))
        tail = p.page_bytes - p.states * rec
        if tail:
            pad.append((p.offset + p.record_bytes, tail, 1, 0, tail))
        end = p.offset + p.page_bytes
    if end < group.block_bytes:
        pad.append((end, group.block_bytes - end, 1, 0, group.block_bytes - end))
    ops: list[_Op] = []
    at = 0
    for src, span, rows, col, cols in (*data, *scales, *pad):
        ops.append((src, span, rows, col, cols, at))
        at += rows * cols
    assert at == group.block_bytes
    return tuple(ops)


def _views(block: np.ndarray, payload: np.ndarray, op: _Op) -> tuple[np.ndarray, np.ndarray]:
    src, span, rows, col, cols, dst = op
    b = block[src : src + span].reshape(rows, span // rows)[:, col : col + cols]
    return b, payload[dst : dst + rows * cols].reshape(rows, cols)


def encode_into(layout: PageLayout, group: int, block_hash: bytes, key: bytes,
                block: memoryview | bytes | bytearray | np.ndarray, dest: memoryview | bytearray) -> int:
    """Write the blob of one engine block into ``dest``; returns its length. ``block`` is exactly
    the group's ``block_bytes`` engine bytes (e.g. a view of vLLM's primary tier slot)."""
    g = layout.group(group)
    if g is None:
        raise PageError(f"layout {layout.name} has no group {group}")
    src = block.reshape(-1).view(np.uint8) if isinstance(block, np.ndarray) else np.frombuffer(block, dtype=np.uint8)
    if src.size != g.block_bytes:
        raise PageError(f"group {group} blocks are {g.block_bytes} bytes, got {src.size}")
    hb = header_bytes(len(block_hash))
    total = hb + g.block_bytes + CHECKSUM_BYTES
    out = np.frombuffer(dest, dtype=np.uint8, count=total)
    _HEADER.pack_into(dest, 0, MAGIC, VERSION, hb, total, g.block_bytes, layout.layout_id, key, group,
                      len(block_hash), 0, hb + g.data_bytes, 0)
    out[HEADER_BYTES : HEADER_BYTES + len(block_hash)] = np.frombuffer(block_hash, dtype=np.uint8)
    out[HEADER_BYTES + len(block_hash) : hb] = 0
    payload = out[hb : hb + g.block_bytes]
    for op in _plan(g):
        b, p = _views(src, payload, op)
        p[...] = b
    mv = memoryview(dest)
    struct.pack_into("<Q", dest, total - CHECKSUM_BYTES, xxhash.xxh3_64_intdigest(mv[: total - CHECKSUM_BYTES]))
    return total


def encode(layout: PageLayout, group: int, block_hash: bytes, key: bytes,
           block: memoryview | bytes | bytearray | np.ndarray) -> bytes:
    g = layout.group(group)
    if g is None:
        raise PageError(f"layout {layout.name} has no group {group}")
    buf = bytearray(blob_bytes(g, len(block_hash)))
    encode_into(layout, group, block_hash, key, block, buf)
    return bytes(buf)


def read_header(blob: bytes | bytearray | memoryview) -> PageHeader:
    mv = memoryview(blob)
    if len(mv) < HEADER_BYTES + CHECKSUM_BYTES:
        raise PageError(f"page blob truncated ({len(mv)} bytes)")
    (magic, version, hb, total, block_bytes, layout_id, key, group, hash_len, _flags, comp,
     _res) = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise PageError(f"not a page blob (magic {bytes(magic)!r})")
    if version != VERSION:
        raise PageError(f"unsupported page blob version {version}")
    if not 0 < hash_len <= MAX_HASH_BYTES or hb != header_bytes(hash_len):
        raise PageError(f"malformed page header (hash length {hash_len}, header bytes {hb})")
    if total != len(mv):
        raise PageError(f"page blob is {len(mv)} bytes, its header says {total}")
    if total != hb + block_bytes + CHECKSUM_BYTES or not hb <= comp <= hb + block_bytes:
        raise PageError(f"malformed page header (total {total}, block {block_bytes}, compressible offset {comp})")
    return PageHeader(hb, total, block_bytes, bytes(layout_id), bytes(key), group,
                      bytes(mv[HEADER_BYTES : HEADER_BYTES + hash_len]), comp)


def verify_checksum(blob: bytes | bytearray | memoryview) -> None:
    mv = memoryview(blob)
    (stored,) = struct.unpack_from("<Q", mv, len(mv) - CHECKSUM_BYTES)
    if xxhash.xxh3_64_intdigest(mv[: len(mv) - CHECKSUM_BYTES]) != stored:
        raise PageError("page blob checksum mismatch")


def _of_layout(h: PageHeader, layout: PageLayout) -> GroupSpec:
    """The group of ``layout`` the header names, if the header has its geometry; else PageError."""
    if h.layout_id != layout.layout_id:
        raise PageError(f"page blob is of layout {h.layout_id.hex()}, expected {layout.layout_hex}")
    g = layout.group(h.group)
    if g is None:
        raise PageError(f"layout {layout.name} has no group {h.group}")
    if h.block_bytes != g.block_bytes or h.compressible_offset != h.header_bytes + g.data_bytes:
        raise PageError(f"group {h.group} blocks are {g.block_bytes} bytes with {g.data_bytes} of data rows; "
                        f"the blob says {h.block_bytes} and {h.compressible_offset - h.header_bytes}")
    return g


def check(blob: bytes | bytearray | memoryview, layout: PageLayout, namespace: str, *,
          verify: bool = True) -> PageHeader:
    """Everything a store checks before it keeps (or serves) a page blob: the header against the
    layout and its group, the key recomputed from namespace, group and block hash, the checksum."""
    h = read_header(blob)
    _of_layout(h, layout)
    want = page_key(layout.layout_id, namespace, h.group, h.block_hash)
    if h.key != want:
        raise PageError(f"page key {h.key.hex()} does not match its namespace, group and block hash "
                        f"(expected {want.hex()})")
    if verify:
        verify_checksum(blob)
    return h


def check_known(blob: bytes | bytearray | memoryview, layout: PageLayout, key: bytes) -> PageHeader:
    """``check`` for a reader that knows the key it asked for (the daemon checked the key against
    the namespace before serving it): the header against the layout and that key, the checksum."""
    h = read_header(blob)
    if h.key != key:
        raise PageError(f"page blob is block {h.key.hex()}, not the {key.hex()} asked for")
    _of_layout(h, layout)
    verify_checksum(blob)
    return h


def decode_into(blob: bytes | bytearray | memoryview, layout: PageLayout,
                dest: memoryview | bytearray | np.ndarray) -> PageHeader:
    """Write a page blob's engine block into ``dest`` (the group's ``block_bytes``), in the
    engine's own arrangement: one copy. The blob must have passed ``check``."""
    h = read_header(blob)
    g = _of_layout(h, layout)
    out = dest.reshape(-1).view(np.uint8) if isinstance(dest, np.ndarray) else np.frombuffer(dest, dtype=np.uint8)
    if out.size != g.block_bytes:
        raise PageError(f"group {h.group} blocks are {g.block_bytes} bytes, the destination is {out.size}")
    payload = np.frombuffer(blob, dtype=np.uint8, count=g.block_bytes, offset=h.header_bytes)
    for op in _plan(g):
        b, p = _views(out, payload, op)
        b[...] = p
    return h


def compressible_offset(blob: bytes | bytearray | memoryview) -> int:
    """Where a page blob's compressible part (scale rows, padding, checksum) starts; 0 if none."""
    mv = memoryview(blob)
    if len(mv) < HEADER_BYTES or bytes(mv[:4]) != MAGIC:
        return 0
    (offset,) = struct.unpack_from("<I", mv, _COMPRESSIBLE_AT)
    return offset if offset <= len(mv) else 0


def is_page(blob: bytes | bytearray | memoryview) -> bool:
    return bytes(memoryview(blob)[:4]) == MAGIC
