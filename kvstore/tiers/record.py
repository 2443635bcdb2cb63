"""The ssd tier's record framing: a value behind a header that says how it is stored, so both
sizes are recorded and every record written under any setting reads back under any other.

    u8 flag | u32 raw_len | u32 prefix | ...
    flag 0 (raw):   value                                    (prefix = raw_len)
    flag 1 (zstd):  value[:prefix] raw | zstd frame of value[prefix:]
    flag 2 (chunk): u32 codes_frame_len | value[:prefix] raw (chunk header + section table)
                    | zstd frame of value[prefix:split] (codes_frame_len bytes; none if empty)
                    | zstd frame of the transformed tail (record_chunk.py)

Flag 2 is written for every value that is a chunk (magic ``KVCK``, a sane header and table);
flag 1 for other values (manifests of the first format, anything a test puts), compressed
from ``compressible_from(value)`` on; flag 0 when compression is off or does not shrink it.
docs/FORMAT.md has the byte-level description.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from typing import Any

import zstandard as zstd

from kvstore.tiers import record_chunk
from kvstore.tiers.base import CorruptValue

HEADER = struct.Struct("<BII")
CODES_LEN = struct.Struct("<I")  # flag 2 only, right after HEADER
RAW, ZSTD, CHUNK = 0, 1, 2

#: Where a value's compressible part starts (the chunk format puts incompressible FP4 codes first).
CompressibleFrom = Callable[[bytes | memoryview], int]


class RecordCodec:
    """Frames values into records and back. zstd contexts are not thread-safe: one per thread."""

    def __init__(self, level: int, compressible_from: CompressibleFrom | None) -> None:
        self._level = level
        self._from = compressible_from
        self._local = threading.local()

    def _ctx(self) -> Any:
        local = self._local
        if not hasattr(local, "dctx"):
            local.cctx = zstd.ZstdCompressor(level=self._level) if self._level else None
            local.dctx = zstd.ZstdDecompressor()
        return local

    def encode(self, view: memoryview) -> bytes:
        raw_len = len(view)
        if raw_len > 0xFFFFFFFF:
            raise ValueError(f"ssd tier: values must be under 4 GiB, got {raw_len} bytes")
        start = 0 if self._from is None else self._from(view)
        if not 0 <= start <= raw_len:
            raise ValueError(f"ssd tier: compressible_from gave offset {start} for a {raw_len}-byte value")
        cctx = self._ctx().cctx
        if cctx is not None:
            p = record_chunk.plan(view, raw_len)
            if p is not None:
                record = _encode_chunk(cctx, view, p)
                if len(record) < HEADER.size + raw_len:
                    return record
            elif start < raw_len:
                frame = cctx.compress(view[start:])
                if start + len(frame) < raw_len:  # keep it only when it actually shrinks the value
                    return b"".join((HEADER.pack(ZSTD, raw_len, start), view[:start], frame))
        return b"".join((HEADER.pack(RAW, raw_len, raw_len), view))

    def decode(self, key: bytes, record: memoryview | bytes) -> bytes | memoryview:
        """The original value; TierError when the framing is invalid (bad flag, lengths, frame).
        One copy out of ``record`` (LMDB's map): the raw prefix is copied into the value's buffer
        and the zstd frame decompressed straight after it (no decompressed-then-joined tail)."""
        where = f"ssd tier: key {key.hex()}"
        if len(record) < HEADER.size:
            raise CorruptValue(f"{where}: record of {len(record)} bytes is shorter than its header")
        flag, raw_len, prefix = HEADER.unpack_from(record)
        body = memoryview(record)[HEADER.size :]
        if flag == RAW:
            if len(body) != raw_len or prefix != raw_len:
                raise CorruptValue(f"{where}: raw record holds {len(body)} bytes, header says {raw_len}")
            return bytes(body)
        if flag == CHUNK:
            return self._decode_chunk(where, raw_len, prefix, body)
        if flag != ZSTD:
            raise CorruptValue(f"{where}: unknown codec flag {flag}")
        if prefix >= raw_len or prefix > len(body):
            raise CorruptValue(f"{where}: bad raw prefix {prefix} for a {raw_len}-byte value")
        out = bytearray(raw_len)
        out[:prefix] = body[:prefix]
        _frame_into(self._ctx().dctx, where, body[prefix:], memoryview(out)[prefix:])
        return memoryview(out).toreadonly()

    def _decode_chunk(self, where: str, raw_len: int, prefix: int, body: memoryview) -> memoryview:
        if len(body) < CODES_LEN.size + prefix:
            raise CorruptValue(f"{where}: chunk record of {len(body)} bytes is shorter than its raw prefix {prefix}")
        (codes_len,) = CODES_LEN.unpack_from(body)
        body = body[CODES_LEN.size :]
        p = record_chunk.plan(body[:prefix], raw_len)
        if p is None or p.header_bytes != prefix or prefix + codes_len > len(body):
            raise CorruptValue(f"{where}: chunk record's header, section table or lengths are invalid")
        if (codes_len == 0) != (p.split == prefix):
            raise CorruptValue(f"{where}: chunk record's codes frame is {codes_len} bytes for "
                               f"{p.split - prefix} bytes of codes")
        out = bytearray(raw_len)
        out[:prefix] = body[:prefix]
        dctx = self._ctx().dctx
        if codes_len:
            _frame_into(dctx, where, body[prefix : prefix + codes_len], memoryview(out)[prefix : p.split])
        tail = bytearray(p.tail_len)
        _frame_into(dctx, where, body[prefix + codes_len :], memoryview(tail))
        record_chunk.inverse(tail, p, out)
        return memoryview(out).toreadonly()


def _encode_chunk(cctx: Any, view: memoryview, p: record_chunk.Plan) -> bytes:
    codes = cctx.compress(view[p.header_bytes : p.split]) if p.split > p.header_bytes else b""
    tail = cctx.compress(record_chunk.forward(view, p))
    return b"".join((HEADER.pack(CHUNK, p.raw_len, p.header_bytes), CODES_LEN.pack(len(codes)),
                     view[: p.header_bytes], codes, tail))


def _frame_into(dctx: Any, where: str, frame: memoryview, dest: memoryview) -> None:
    """Decompress the one zstd ``frame`` into all of ``dest``; CorruptValue unless it fills it exactly."""
    try:
        # Check the frame's declared size first: a corrupt one must not make us allocate GBs.
        if zstd.frame_content_size(frame) != len(dest):
            raise CorruptValue(f"{where}: zstd frame size does not match the header's length")
        reader = dctx.stream_reader(frame)
        got = 0
        while got < len(dest):
            n = reader.readinto(dest[got:])
            if not n:
                break
            got += n
    except zstd.ZstdError as exc:
        raise CorruptValue(f"{where}: cannot decompress: {exc}") from exc
    if got != len(dest):
        raise CorruptValue(f"{where}: decompressed {got} bytes, header says {len(dest)}")
