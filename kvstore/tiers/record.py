"""The ssd tier's record framing: a value, zstd-compressed from a given offset on, behind a
9-byte header (codec flag, raw length, length of the uncompressed prefix), so both sizes are
recorded and a value written with compression off reads back after turning it on.

    u8 flag (0 raw, 1 zstd) | u32 raw_len | u32 prefix | prefix bytes raw | zstd frame of the rest
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from typing import Any

import zstandard as zstd

from kvstore.tiers.base import CorruptValue

HEADER = struct.Struct("<BII")
RAW, ZSTD = 0, 1

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
        if cctx is not None and start < raw_len:
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
        if flag != ZSTD:
            raise CorruptValue(f"{where}: unknown codec flag {flag}")
        if prefix >= raw_len or prefix > len(body):
            raise CorruptValue(f"{where}: bad raw prefix {prefix} for a {raw_len}-byte value")
        frame = body[prefix:]
        try:
            # Check the frame's declared size first: a corrupt one must not make us allocate GBs.
            if zstd.frame_content_size(frame) != raw_len - prefix:
                raise CorruptValue(f"{where}: zstd frame size does not match header length {raw_len}")
            out = bytearray(raw_len)
            out[:prefix] = body[:prefix]
            got = _decompress_into(self._ctx().dctx, frame, memoryview(out)[prefix:])
        except zstd.ZstdError as exc:
            raise CorruptValue(f"{where}: cannot decompress: {exc}") from exc
        if got != raw_len - prefix:
            raise CorruptValue(f"{where}: decompressed {got} bytes, header says {raw_len - prefix}")
        return memoryview(out).toreadonly()


def _decompress_into(dctx: Any, frame: memoryview, dest: memoryview) -> int:
    """Decompress ``frame`` into ``dest``; how many bytes it gave (less than ``len(dest)`` only for a
    frame shorter than it declared)."""
    reader = dctx.stream_reader(frame)
    got = 0
    while got < len(dest):
        n = reader.readinto(dest[got:])
        if not n:
            break
        got += n
    return got
