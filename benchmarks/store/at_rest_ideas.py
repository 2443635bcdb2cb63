"""Encodings of a chunk at rest, measured offline on the same chunks (bench_at_rest.py's table).

Each idea maps one chunk blob to the bytes of the record it would be stored as; the table adds
what LMDB then allocates for it (overflow pages: ceil((record + 16) / 4096) pages of 4096 bytes).
Only the kept one (flag 2) is in kvstore; the others are here to be measured, not used.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import zstandard as zstd

from kvstore.format import chunk
from kvstore.tiers.ssd import chunk_record as record_chunk
from kvstore.tiers.ssd.record import HEADER, RecordCodec

PAGE, PAGE_HEADER = 4096, 16
Idea = Callable[[bytes], int]


def overflow_bytes(record_len: int) -> int:
    """What LMDB allocates for a value this large (an overflow run: 16-byte header, whole pages)."""
    return math.ceil((record_len + PAGE_HEADER) / PAGE) * PAGE


def _split(blob: bytes) -> tuple[int, int]:
    h = chunk.read_header(blob)
    return h.header_bytes, h.compressible_offset


def _z(level: int) -> Callable[[bytes], int]:
    c = zstd.ZstdCompressor(level=level)
    return lambda data: len(c.compress(data))


def _tail(blob: bytes, residual: bool, planes: bool, varint: bool = False) -> bytes:
    """The tail (scales, ids, checksum) with scales column-major (residuals from the column's mean
    if ``residual``), ids as byte planes or delta+zigzag varints."""
    p = record_chunk.plan(blob, len(blob))
    assert p is not None
    if residual and planes:
        return record_chunk.forward(blob, p)
    src = np.frombuffer(blob, np.uint8)
    out = bytearray(blob[p.split :])
    dst = np.frombuffer(out, np.uint8)
    for off, n, w in p.scales:
        s = src[off : off + n * w].reshape(n, w)
        base = (s.sum(axis=0, dtype=np.uint32) // n).astype(np.uint8) if residual else np.zeros(w, np.uint8)
        dst[off - p.split : off - p.split + n * w].reshape(w, n)[...] = (s - base).T
    ids = np.frombuffer(blob, "<u4", p.token_count, p.ids_offset)
    at = p.ids_offset - p.split
    if planes:
        dst[at : at + 4 * p.token_count].reshape(4, -1)[...] = ids.view(np.uint8).reshape(-1, 4).T
    if varint:
        d = np.diff(ids.astype(np.int64), prepend=0)
        zz = (d << 1) ^ (d >> 63)
        packed = bytearray()
        for v in zz.tolist():
            while v >= 0x80:
                packed.append(v & 0x7F | 0x80)
                v >>= 7
            packed.append(v)
        return bytes(out[:at]) + bytes(packed) + bytes(out[at + 4 * p.token_count :])
    return bytes(out)


def _flag1(level: int) -> Idea:
    z = _z(level)
    return lambda b: HEADER.size + _split(b)[1] + z(b[_split(b)[1] :])


def _codes_raw(tail: Callable[[bytes], bytes], level: int = 1) -> Idea:
    z = _z(level)
    return lambda b: HEADER.size + _split(b)[1] + z(tail(b))


def _flag2(level: int) -> Idea:
    codec = RecordCodec(level, chunk.compressible_offset)
    return lambda b: len(codec.encode(memoryview(b)))


def _codes_frame(b: bytes) -> int:
    hb, split = _split(b)
    return HEADER.size + 4 + hb + _z(1)(b[hb:split]) + _z(1)(_tail(b, True, True))


def _one_frame(b: bytes) -> int:
    hb, _ = _split(b)
    return HEADER.size + 4 + hb + _z(1)(bytes(b[hb : _split(b)[1]]) + _tail(b, True, True))


def _dict_idea(train: list[bytes]) -> Idea:
    """zstd dictionary trained on the transformed tails of another session's chunks (same layout)."""
    d = zstd.train_dictionary(16 << 10, [_tail(b, True, True) for b in train])
    c = zstd.ZstdCompressor(level=1, dict_data=d)
    codes = _z(1)  # the tail frame without the dictionary
    flag2 = _flag2(1)
    return lambda b: flag2(b) - codes(_tail(b, True, True)) + len(c.compress(_tail(b, True, True)))


def _entropy(data: np.ndarray) -> float:
    _, counts = np.unique(data, return_counts=True)
    return float(-(counts * np.log2(counts / counts.sum())).sum() / 8)


def _bound(b: bytes) -> int:
    """Order-0 entropy (bytes) of the codes (per cache kind) and of the transformed tail: what an
    ideal static coder of these symbols would need, plus the raw header. No encoder gets there."""
    hb, split = _split(b)
    tail = np.frombuffer(_tail(b, True, True), np.uint8)
    d = chunk.decode(b, _bound.layout)  # type: ignore[attr-defined]
    main = np.concatenate([e.codes.ravel() for n, e in d.entries.items() if n.startswith("main")])
    idx = np.concatenate([e.codes.ravel() for n, e in d.entries.items() if not n.startswith("main")])
    return int(hb + _entropy(main) + _entropy(idx) + _entropy(tail))


def ideas(train: list[bytes], layout: object) -> list[tuple[str, Idea]]:
    _bound.layout = layout  # type: ignore[attr-defined]
    return [
        ("raw, no compression (flag 0)", lambda b: HEADER.size + len(b)),
        ("codes raw, zstd-1 from the first scales section (flag 1, the default)", _flag1(1)),
        ("  same, zstd-3", _flag1(3)),
        ("  same, zstd-9", _flag1(9)),
        ("  same, zstd-19", _flag1(19)),
        ("codes raw; tail: scales column-major (one channel block across tokens)",
         _codes_raw(lambda b: _tail(b, False, False))),
        ("codes raw; tail: scales as per-column residuals from the column mean, column-major",
         _codes_raw(lambda b: _tail(b, True, False))),
        ("codes raw; tail: + token ids as 4 byte planes", _codes_raw(lambda b: _tail(b, True, True))),
        ("codes raw; tail: token ids delta + zigzag varint instead", _codes_raw(lambda b: _tail(b, True, False, True))),
        ("codes in one zstd-1 frame + transformed tail frame", _codes_frame),
        ("codes: sign plane raw + magnitudes (6 bits a byte) in one zstd-1 frame per format + transformed "
         "tail frame (flag 2, --ssd-compact-records)", _flag2(1)),
        ("  same, zstd-3", _flag2(3)),
        ("  same, zstd-19", _flag2(19)),
        ("  same, tail frame with a zstd dictionary trained per layout (16 KiB)", _dict_idea(train)),
        ("codes + transformed tail in one zstd-1 frame", _one_frame),
        ("order-0 entropy bound (codes per cache kind + transformed tail): no encoder", _bound),
    ]



def codec_speed(blobs: list[bytes], legacy: bool, repeats: int = 5) -> tuple[float, float]:
    """(encode MB/s, decode MB/s) of chunk bytes through RecordCodec, best of ``repeats`` (the
    machine is shared: the best run is the one least disturbed)."""
    mb = sum(map(len, blobs)) / 1e6
    codec = RecordCodec(1, chunk.compressible_offset, transform_chunks=not legacy)
    enc, dec = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        recs = [codec.encode(memoryview(b)) for b in blobs]
        enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        for r in recs:
            codec.decode(b"", r)
        dec.append(time.perf_counter() - t)
    return mb / min(enc), mb / min(dec)
