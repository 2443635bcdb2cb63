"""The ssd tier's chunk-aware record body (record flag 2): where a chunk's bytes compress.

A chunk (docs/FORMAT.md) is header + section table | FP4 codes | scales | token ids | checksum.
Measured on Gaussian KV at the real geometry (benchmarks/results/at_rest.md), zstd shrinks the
codes by ~2% (E2M1 codes of block-scaled data are not uniform: ~3.9 bits of 4), and the scales
far more once each column of a scales section (one channel block across the chunk's tokens) is
stored contiguously as residuals from a per-column base byte: E4M3 and UE8M0 bytes of positive
scales are monotonic in log2(scale), so residuals of every column share one distribution (one
Huffman table) where raw bytes of columns with different sigmas do not. Token ids are stored as
four byte planes (an id below 2^17 has a constant top byte).

The transformed tail is defined by the chunk's own header and section table, which the record
keeps raw in front of the frames, so a reader needs nothing but the record:

    tail' = value[split:] with, in place,
              every scales section of n > 0 entries x w bytes -> residuals, column-major:
                  tail'[off - split + j*n + e] = (value[off + e*w + j] - base[j]) mod 256
              the token ids (T x u32 at tokens_offset) -> byte planes:
                  tail'[tokens_offset - split + b*T + t] = byte b of id t
            then the bases of every such scales section appended, in section-table order.

``split`` is the header's compressible_offset. The base is the encoder's choice (the column's
mean, rounded down); a reader only adds it back.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

_MAGIC = b"KVCK"
_VERSION = 1
_HEADER_BYTES = 72
_SECTION = struct.Struct("<HBBIII")  # cache index, kind, pad, entries, offset, length
_KIND_SCALES = 1


@dataclass(frozen=True)
class Plan:
    """Where the transformed regions of one chunk lie (all offsets into the chunk)."""

    raw_len: int
    header_bytes: int  # the raw prefix: header + section table
    split: int  # compressible_offset: the codes region is [header_bytes, split), the tail the rest
    scales: tuple[tuple[int, int, int], ...]  # (offset, entries n, width w) of each non-empty scales section
    ids_offset: int
    token_count: int
    codes: tuple[tuple[tuple[int, int], ...], ...]  # (offset, length) of codes sections, per frame group

    @property
    def codes_len(self) -> int:
        return self.split - self.header_bytes

    @property
    def n_code_frames(self) -> int:
        """One zstd frame per group; bytes of the codes region in no section go into the last one."""
        return len(self.codes) if self.codes else int(self.codes_len > 0)

    def frame_runs(self) -> list[list[tuple[int, int]]]:
        """Per codes frame, the (start, length) runs of the codes region its magnitudes fill, in
        stream order: a group's sections in table order; the bytes in no section (padding), in
        offset order, go to the last frame."""
        hb = self.header_bytes
        frames = [[(off - hb, length) for off, length in g] for g in self.codes]
        gaps, end = [], 0
        for start, length in sorted(run for f in frames for run in f):
            if start > end:
                gaps.append((end, start - end))
            end = start + length
        if end < self.codes_len:
            gaps.append((end, self.codes_len - end))
        if not frames and self.codes_len:
            frames = [[]]
        if frames:
            frames[-1] += gaps
        return frames

    @property
    def bases_len(self) -> int:
        return sum(w for _, _, w in self.scales)

    @property
    def tail_len(self) -> int:
        """Bytes the tail frame decompresses to."""
        return self.raw_len - self.split + self.bases_len


def plan(prefix: bytes | memoryview, raw_len: int) -> Plan | None:
    """The plan for a chunk of ``raw_len`` bytes whose first bytes are ``prefix`` (at least its
    header and section table), or None when they are no chunk this transform can handle: bad
    magic or version, a declared size other than ``raw_len``, or regions out of bounds or overlapping."""
    mv = memoryview(prefix)
    if len(mv) < _HEADER_BYTES or bytes(mv[:4]) != _MAGIC:
        return None
    version, header_bytes, total, token_count = struct.unpack_from("<HHII", mv, 4)
    tokens_offset, n_sections = struct.unpack_from("<IH", mv, 56)
    (split,) = struct.unpack_from("<I", mv, 64)
    if (version != _VERSION or total != raw_len or len(mv) < header_bytes
            or header_bytes < _HEADER_BYTES + _SECTION.size * n_sections or not header_bytes <= split <= raw_len):
        return None
    scales: list[tuple[int, int, int]] = []
    regions = [(tokens_offset, 4 * token_count)]
    codes: list[tuple[int, int, int]] = []  # (cache index, offset, length)
    scale_len: dict[int, int] = {}
    for i in range(n_sections):
        cache, kind, _pad, n, off, length = _SECTION.unpack_from(mv, _HEADER_BYTES + i * _SECTION.size)
        if (n == 0) != (length == 0) or (n and length % n):
            return None
        if kind == _KIND_SCALES:
            scale_len[cache] = length
            if n:
                scales.append((off, n, length // n))
                regions.append((off, length))
        elif n:
            codes.append((cache, off, length))
    end = split
    for off, length in sorted(regions):
        if off < end or off + length > raw_len:
            return None
        end = off + length
    end = header_bytes
    for _, off, length in sorted(codes, key=lambda c: c[1]):
        if off < end or off + length > split:
            return None
        end = off + length
    groups: dict[int, list[tuple[int, int]]] = {}
    for cache, off, length in codes:  # table order; grouped by the format's codes-to-scales ratio
        sl = scale_len.get(cache, 0)
        groups.setdefault(length // sl if sl else 0, []).append((off, length))
    return Plan(raw_len, header_bytes, split, tuple(scales), tokens_offset, token_count,
                tuple(tuple(g) for g in groups.values()))


def _sign_lut() -> np.ndarray:
    """Sign-plane byte -> the sign bits of its 4 codes bytes, in place (bits 3 and 7), as one u32."""
    lut = np.zeros((256, 4), np.uint8)
    for byte in range(256):
        for i in range(4):
            two = (byte >> (2 * i)) & 3
            lut[byte, i] = ((two & 1) << 3) | ((two & 2) << 6)
    return lut.view("<u4").reshape(-1)


_SIGNS = _sign_lut()


def codes_forward(value: bytes | memoryview, p: Plan) -> tuple[bytes, list[bytes]]:
    """(sign plane, the magnitude stream of each codes frame) of the codes region. Sign plane bit k
    (byte k // 8, bit k % 8) is the sign of code k: bit 3 of codes byte k // 2 for even k, bit 7 for odd.
    A magnitude byte is (byte & 7) | ((byte >> 1) & 0x38): the two codes' low 3 bits."""
    c = np.frombuffer(value, np.uint8, p.codes_len, p.header_bytes)
    two = np.zeros((p.codes_len + 3) // 4 * 4, np.uint8)  # each byte's two sign bits, 4 bytes per plane byte
    t = two[: p.codes_len]
    np.right_shift(c, 3, out=t)
    t &= 1
    hi = c >> 6
    hi &= 2
    t |= hi
    x = two.view("<u4")
    signs = ((x & 3) | ((x >> 6) & 0xC) | ((x >> 12) & 0x30) | ((x >> 18) & 0xC0)).astype(np.uint8)
    mags = c >> 1
    mags &= 0x38
    mags |= c & 7
    out = [b"".join(mags[start : start + length].data for start, length in runs) for runs in p.frame_runs()]
    return signs.tobytes(), out


def codes_inverse(signs: bytes | memoryview, p: Plan, out: bytearray | memoryview) -> None:
    """Merge the sign plane into the codes region of ``out``, which holds the magnitudes (the
    frames were decompressed straight into their runs: ``frame_runs``)."""
    dst = np.frombuffer(out, np.uint8, p.codes_len, p.header_bytes)
    sign_bits = _SIGNS[np.frombuffer(signs, np.uint8)].view(np.uint8)[: p.codes_len]
    hi = dst & 0x38
    hi <<= 1
    dst &= 7
    dst |= hi
    dst |= sign_bits


def forward(value: bytes | memoryview, p: Plan) -> bytes:
    """tail' of ``value`` (see the module docstring)."""
    src = np.frombuffer(value, np.uint8)
    out = bytearray(value[p.split :])
    dst = np.frombuffer(out, np.uint8)
    bases = []
    for off, n, w in p.scales:
        s = src[off : off + n * w].reshape(n, w)
        base = (s.sum(axis=0, dtype=np.uint32) // n).astype(np.uint8)  # each column's mean, rounded down
        bases.append(base)
        dst[off - p.split : off - p.split + n * w].reshape(w, n)[...] = (s - base).T
    t = p.token_count
    if t:
        at = p.ids_offset - p.split
        dst[at : at + 4 * t].reshape(4, t)[...] = src[p.ids_offset : p.ids_offset + 4 * t].reshape(t, 4).T
    return bytes(out) + b"".join(b.tobytes() for b in bases)


def inverse(tail: bytes | bytearray | memoryview, p: Plan, out: bytearray | memoryview) -> None:
    """Write the chunk bytes [split, raw_len) into ``out`` from ``tail`` (``p.tail_len`` bytes)."""
    src = np.frombuffer(tail, np.uint8)
    dst = np.frombuffer(out, np.uint8)
    body = p.raw_len - p.split
    dst[p.split :] = src[:body]
    at_base = body
    for off, n, w in p.scales:
        base = src[at_base : at_base + w]
        at_base += w
        r = src[off - p.split : off - p.split + n * w].reshape(w, n)
        np.add(r.T, base, out=dst[off : off + n * w].reshape(n, w))  # uint8: wraps mod 256
    t = p.token_count
    if t:
        at = p.ids_offset - p.split
        dst[p.ids_offset : p.ids_offset + 4 * t].reshape(t, 4)[...] = src[at : at + 4 * t].reshape(4, t).T
