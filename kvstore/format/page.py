"""Engine blocks as kvstore stores them: self-describing, checksummed page blobs.

An engine names a block by its own hash (vLLM: the chained block hash, plus the KV cache group);
kvstore keeps one blob per (block hash, group), under a key that hashes the layout id, the
namespace, the group and the block hash, so a block is never served across tenants or engine
configurations. docs/FORMAT.md ("Engine pages") gives the byte layout; this module is its only
writer and reader.

    header (64 B) | block hash | pad16 | the block's bytes, in the engine's order | xxh3-64

The payload is exactly the engine's block from byte 0 to the group's ``block_bytes`` (the end of
its last page), as the engine holds it: a load is one contiguous write of the payload into the
engine's slot (the daemon can make it straight into the engine's memory: ``payload_span``), a
store one contiguous read. Padding the engine keeps past the last page is never stored. A storage
tier compresses only the tail after the last code byte (``compressible_offset``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.format.page_layout import INTERLEAVED, GroupSpec, PageLayout

MAGIC = b"KVPG"
#: 2: the payload in the engine's order (1, regrouped data rows then scale rows, is refused: a miss)
VERSION = 2
_HEADER = struct.Struct("<4sHHII16s16sIHHII")  # see docs/FORMAT.md
HEADER_BYTES = _HEADER.size  # 64
CHECKSUM_BYTES = 8
MAX_HASH_BYTES = 64
# the version is in the key's domain too: a blob of another version is never under a key asked for
_DOMAIN = b"kvstore.page.v2\x00"
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


def codes_end(group: GroupSpec) -> int:
    """Where the block's last code byte ends: what follows (the last page's scale rows, padding) is
    the compressible tail (the codes before it are FP4/FP8, incompressible). Computed, not cached:
    a few pages' arithmetic costs less than hashing the group for a cache."""
    end = 0
    for p in group.pages:
        if p.arrangement == INTERLEAVED:  # the last record's data
            end = max(end, p.offset + (p.states - 1) * (p.data + p.scale) + p.data)
        else:  # every record's data, then the scale rows
            end = max(end, p.offset + p.states * p.data)
    return end


def _group_of(layout: PageLayout, group: int) -> GroupSpec:
    g = layout.group(group)
    if g is None:
        raise PageError(f"layout {layout.name} has no group {group}")
    return g


def write_header(layout: PageLayout, group: int, block_hash: bytes, key: bytes, dest: memoryview | bytearray) -> int:
    """The header and block hash of a blob of ``group`` at the start of ``dest`` (``blob_bytes``
    long): where its payload goes. The payload written there, ``seal`` finishes the blob."""
    g = _group_of(layout, group)
    hb = header_bytes(len(block_hash))
    total = hb + g.block_bytes + CHECKSUM_BYTES
    if len(dest) < total:
        raise PageError(f"a blob of group {group} is {total} bytes; the buffer holds {len(dest)}")
    _HEADER.pack_into(dest, 0, MAGIC, VERSION, hb, total, g.block_bytes, layout.layout_id, key, group,
                      len(block_hash), 0, hb + codes_end(g), 0)
    dest[HEADER_BYTES : HEADER_BYTES + len(block_hash)] = block_hash
    dest[HEADER_BYTES + len(block_hash) : hb] = bytes(hb - HEADER_BYTES - len(block_hash))
    return hb


def seal(dest: memoryview | bytearray) -> int:
    """Write the checksum of a blob whose header and payload are in place; its length."""
    (total,) = struct.unpack_from("<I", dest, 8)
    mv = memoryview(dest)
    struct.pack_into("<Q", dest, total - CHECKSUM_BYTES, xxhash.xxh3_64_intdigest(mv[: total - CHECKSUM_BYTES]))
    return int(total)


def _bytes(buf: memoryview | bytes | bytearray | np.ndarray) -> memoryview:
    mv = buf.reshape(-1).view(np.uint8).data if isinstance(buf, np.ndarray) else memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def encode_into(layout: PageLayout, group: int, block_hash: bytes, key: bytes,
                block: memoryview | bytes | bytearray | np.ndarray, dest: memoryview | bytearray) -> int:
    """Write the blob of one engine block into ``dest``; returns its length. ``block`` is the
    group's ``block_bytes`` engine bytes (e.g. a view of vLLM's primary tier slot, its padding past
    the last page left out): one copy."""
    g = _group_of(layout, group)
    src = _bytes(block)
    if len(src) != g.block_bytes:
        raise PageError(f"group {group} blocks are {g.block_bytes} bytes, got {len(src)}")
    hb = write_header(layout, group, block_hash, key, dest)
    memoryview(dest)[hb : hb + g.block_bytes] = src
    return seal(dest)


def encode(layout: PageLayout, group: int, block_hash: bytes, key: bytes,
           block: memoryview | bytes | bytearray | np.ndarray) -> bytes:
    buf = bytearray(blob_bytes(_group_of(layout, group), len(block_hash)))
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
        raise PageError(f"unsupported page blob version {version} (this reader reads {VERSION})")
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
    g = _group_of(layout, h.group)
    if h.block_bytes != g.block_bytes or h.compressible_offset != h.header_bytes + codes_end(g):
        raise PageError(f"group {h.group} blocks are {g.block_bytes} bytes, their codes ending at {codes_end(g)}; "
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


def payload_span(blob: bytes | bytearray | memoryview) -> tuple[int, int]:
    """(offset, length) of a page blob's payload, the engine's block bytes: what a load writes
    into the engine's slot. PageError for anything but a page blob of this version."""
    h = read_header(blob)
    return h.header_bytes, h.block_bytes


def payload(blob: bytes | bytearray | memoryview, key: bytes) -> memoryview:
    """The payload of the page blob ``key`` names, after its header and checksum were checked (a
    client that knows the key it asked for, not the layout: a blob the daemon verified, checked
    again after a trip over the network)."""
    h = read_header(blob)
    if h.key != key:
        raise PageError(f"page blob is block {h.key.hex()}, not the {key.hex()} asked for")
    verify_checksum(blob)
    return memoryview(blob)[h.header_bytes : h.header_bytes + h.block_bytes]


def decode_into(blob: bytes | bytearray | memoryview, layout: PageLayout,
                dest: memoryview | bytearray | np.ndarray) -> PageHeader:
    """Write a page blob's engine block into ``dest`` (the group's ``block_bytes``): one copy. The
    blob must have passed ``check``."""
    h = read_header(blob)
    g = _of_layout(h, layout)
    out = _bytes(dest)
    if len(out) != g.block_bytes:
        raise PageError(f"group {h.group} blocks are {g.block_bytes} bytes, the destination is {len(out)}")
    out[:] = memoryview(blob)[h.header_bytes : h.header_bytes + g.block_bytes]
    return h


def compressible_offset(blob: bytes | bytearray | memoryview) -> int:
    """Where a page blob's compressible part (after its last code byte) starts; 0 if none."""
    mv = memoryview(blob)
    if len(mv) < HEADER_BYTES or bytes(mv[:4]) != MAGIC:
        return 0
    (offset,) = struct.unpack_from("<I", mv, _COMPRESSIBLE_AT)
    return offset if offset <= len(mv) else 0


def is_page(blob: bytes | bytearray | memoryview) -> bool:
    return bytes(memoryview(blob)[:4]) == MAGIC


#: (offset, length, stride, count): ``count`` runs of ``length`` bytes, the i-th at ``offset + i * stride``
Run = tuple[int, int, int, int]


def scale_runs(group: GroupSpec, header_bytes: int) -> tuple[Run, ...]:
    """The byte runs of a blob of ``group`` (header of ``header_bytes``) that hold scale rows before
    its compressible offset (the ones after it are in the tail already), in offset order, strided
    runs merged: a split page's scale rows are one run, an interleaved page's one strided run (each
    record's scales), and equal pages side by side one run over all of them (SGLang's layers of a
    pool: one run; vLLM's interleaved pages of a group: one)."""
    end = header_bytes + codes_end(group)
    runs: list[Run] = []
    for p in sorted(group.pages, key=lambda p: p.offset):
        if not p.scale:
            continue
        at = header_bytes + p.offset
        if p.arrangement == INTERLEAVED:
            stride, first = p.data + p.scale, at + p.data
            count = min(p.states, max(0, (end - first - p.scale) // stride + 1)) if first + p.scale <= end else 0
            page_runs: list[Run] = [(first, p.scale, stride, count)] if count else []
        else:
            first, n = at + p.data_bytes, p.scale_bytes
            page_runs = [(first, n, n, 1)] if first + n <= end else []
        for r in page_runs:
            merged = _merge(runs[-1], r) if runs else None
            if merged is not None:
                runs[-1] = merged
            else:
                runs.append(r)
    return tuple(runs)


def _merge(a: Run, b: Run) -> Run | None:
    """``a`` and ``b`` as one run, when ``b`` continues ``a``'s progression; else None."""
    off, length, stride, count = a
    if b[1] != length:
        return None
    if count == 1 and b[3] == 1:  # two single runs: the distance is the stride
        step = b[0] - off
        return (off, length, step, 2) if step >= length else None
    if b[0] == off + count * stride and (b[3] == 1 or b[2] == stride):
        return (off, length, stride, count + b[3])
    if count == 1 and b[2] == b[0] - off and b[2] >= length:
        return (off, length, b[2], b[3] + 1)
    return None


class ScaleRuns:
    """``compressible_runs`` for the ssd tier's codec: a page blob's scale runs (``scale_runs``) by the
    layout its header names, found through ``lookup`` (the daemon's registered page layouts, bound
    once the store that keeps them is open: ``bind``); None for anything else (a chunk, a blob of a
    layout not known, a header that does not match its layout's group). The checksum is not read:
    the runs only say which bytes a record gathers, any runs give the value back bit-exact."""

    def __init__(self, lookup: Callable[[bytes], PageLayout | None] | None = None) -> None:
        self._lookup = lookup
        self._cache: dict[tuple[bytes, int, int], tuple[Run, ...]] = {}

    def bind(self, lookup: Callable[[bytes], PageLayout | None]) -> None:
        self._lookup = lookup

    def __call__(self, value: bytes | memoryview) -> tuple[Run, ...] | None:
        if self._lookup is None or not is_page(value):
            return None
        try:
            h = read_header(value)
        except PageError:
            return None
        ck = (h.layout_id, h.group, h.header_bytes)
        runs = self._cache.get(ck)
        if runs is None:
            layout = self._lookup(h.layout_id)
            if layout is None:
                return None
            try:
                g = _of_layout(h, layout)
            except PageError:
                return None
            runs = scale_runs(g, h.header_bytes)
            if len(self._cache) < 4096:
                self._cache[ck] = runs
        return runs  # a header that lies (its compressible offset) gets runs the codec refuses
