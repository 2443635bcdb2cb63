"""The ssd tier's record framing: a value behind a header that says how it is stored, so both
sizes are recorded and every record written under any setting reads back under any other.

    u8 flag | u32 raw_len | u32 prefix | ...
    flag 0 (raw):   value                                    (prefix = raw_len)
    flag 1 (zstd):  value[:prefix] raw | zstd frame of value[prefix:]
    flag 2 (chunk): u16 F | F x u32 codes frame lengths | value[:prefix] raw (chunk header + table)
                    | sign plane of the codes, raw (2 bits per codes byte) | F zstd frames of the
                    codes' magnitudes | zstd frame of the transformed tail (tiers/ssd/chunk_record.py)

Flag 2 is written for every value that is a chunk (magic ``KVCK``, a sane header and table)
unless ``transform_chunks`` is off; flag 3, under the same setting, for values ``compressible_runs``
gives runs of (a page blob's scale rows, spread through its block); flag 1 for other values
(manifests of the first format, anything a test puts), compressed from ``compressible_from(value)``
on; flag 0 when compression is off or does not shrink the value.
docs/FORMAT.md has the byte-level description.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import zstandard as zstd

from kvstore.tiers.base import CorruptValue
from kvstore.tiers.ssd import chunk_record as record_chunk
from kvstore.tiers.ssd import runs_record
from kvstore.tiers.ssd.runs_record import CompressibleRuns

HEADER = struct.Struct("<BII")
SCRATCH_BYTES = 8 << 20  # per thread: a record up to this size is encoded in one reused, warm buffer
N_FRAMES, FRAME_LEN = struct.Struct("<H"), struct.Struct("<I")  # flag 2 only, right after HEADER
RAW, ZSTD, CHUNK, RUNS = 0, 1, 2, 3
_ONE_SHOT_BYTES = 1 << 20  # a frame up to this size is decompressed in one call, not through a stream reader

#: Where a value's compressible part starts (the chunk format puts incompressible FP4 codes first).
CompressibleFrom = Callable[[bytes | memoryview], int]


class RecordCodec:
    """Frames values into records and back. zstd contexts are not thread-safe: one per thread."""

    def __init__(self, level: int, compressible_from: CompressibleFrom | None, transform_chunks: bool = True,
                 compressible_runs: CompressibleRuns | None = None) -> None:
        """``compressible_runs``: the runs a value's flag 3 record gathers (with ``transform_chunks``
        and compression on), before the tail from ``compressible_from``; None: flag 1 as before."""
        self._level = level
        self._from = compressible_from
        self._transform = transform_chunks
        self._runs = compressible_runs if transform_chunks else None
        self._local = threading.local()

    def _ctx(self) -> Any:
        local = self._local
        if not hasattr(local, "dctx"):
            local.cctx = _compressor(self._level) if self._level else None
            local.dctx = zstd.ZstdDecompressor()
        return local

    def encode(self, view: memoryview) -> bytes:
        """One value's record, as bytes of its own."""
        return bytes(self.encode_one(view))

    def encode_one(self, view: memoryview) -> memoryview:
        """One value's record, written into a buffer this thread reuses: valid until this thread's
        next ``encode_one``. A writer puts each record into its transaction (which copies it) before
        encoding the next, so a batch of any size is encoded in one chunk-sized, cache-warm buffer:
        no fresh pages to fault in (a new 200 KB buffer costs more than filling it; see the README's
        machine notes), and no batch-sized buffer (a 64 MiB save spent 40% of its time making one).
        A value over SCRATCH_BYTES gets a buffer of its own."""
        need = HEADER.size + len(view)  # a record is never longer than header + value
        local = self._ctx()
        buf: bytearray | None = getattr(local, "scratch", None)
        if buf is None or len(buf) < need:
            buf = bytearray(max(need, 1 << 20))
            if need <= SCRATCH_BYTES:
                local.scratch = buf
        dest = memoryview(buf)
        return dest[: self._encode_into(view, dest)]

    def _encode_into(self, view: memoryview, dest: memoryview) -> int:
        raw_len = len(view)
        if raw_len > 0xFFFFFFFF:
            raise ValueError(f"ssd tier: values must be under 4 GiB, got {raw_len} bytes")
        start = 0 if self._from is None else self._from(view)
        if not 0 <= start <= raw_len:
            raise ValueError(f"ssd tier: compressible_from gave offset {start} for a {raw_len}-byte value")
        cctx = self._ctx().cctx
        if cctx is not None:
            p = record_chunk.plan(view, raw_len) if self._transform else None
            if p is not None:
                record = _encode_chunk(cctx, view, p)
                if len(record) < HEADER.size + raw_len:
                    dest[: len(record)] = record
                    return len(record)
            elif self._runs is not None and (runs := self._runs(view)) and (
                    n := _encode_runs(cctx, view, start, runs, dest)):
                return n
            elif start < raw_len:
                frame = cctx.compress(view[start:])
                if start + len(frame) < raw_len:  # keep it only when it actually shrinks the value
                    HEADER.pack_into(dest, 0, ZSTD, raw_len, start)
                    at = HEADER.size + start
                    dest[HEADER.size : at] = view[:start]
                    dest[at : at + len(frame)] = frame
                    return at + len(frame)
        HEADER.pack_into(dest, 0, RAW, raw_len, raw_len)
        dest[HEADER.size : HEADER.size + raw_len] = view
        return HEADER.size + raw_len

    def decode(self, key: bytes, record: memoryview | bytes) -> bytes | memoryview:
        """The original value; TierError when the framing is invalid (bad flag, lengths, frame).
        One copy out of ``record`` (LMDB's map): the raw prefix is copied into the value's buffer
        and the zstd frame decompressed straight after it (no decompressed-then-joined tail)."""
        return self._decode(key, record, None)

    def view(self, key: bytes, record: memoryview | bytes) -> bytes | memoryview:
        """The value with no copy where it is stored raw (a view into ``record``, valid as long as
        ``record`` is), else decoded (a buffer of its own). CorruptValue as for ``decode``."""
        if len(record) >= HEADER.size and record[0] == RAW:
            _, raw_len, prefix = HEADER.unpack_from(record)
            if len(record) - HEADER.size == raw_len == prefix:
                return memoryview(record)[HEADER.size :]
        return self._decode(key, record, None)

    @staticmethod
    def raw_length(key: bytes, record: memoryview | bytes) -> int:
        """The value's length, from the record's header alone; CorruptValue if it has none."""
        if len(record) < HEADER.size:
            raise CorruptValue(f"ssd tier: key {key.hex()}: record of {len(record)} bytes is shorter than its header")
        return int(HEADER.unpack_from(record)[1])

    def decode_into(self, key: bytes, record: memoryview | bytes, out: memoryview) -> int:
        """``decode`` straight into ``out`` (at least ``raw_length`` bytes: ValueError if not), with no
        buffer of the value's own; returns its length. On CorruptValue, ``out`` may be partly written."""
        return len(self._decode(key, record, out))

    def _decode(self, key: bytes, record: memoryview | bytes, out: memoryview | None) -> bytes | memoryview:
        where = f"ssd tier: key {key.hex()}"
        if len(record) < HEADER.size:
            raise CorruptValue(f"{where}: record of {len(record)} bytes is shorter than its header")
        flag, raw_len, prefix = HEADER.unpack_from(record)
        body = memoryview(record)[HEADER.size :]
        if out is not None and len(out) < raw_len:
            raise ValueError(f"{where}: a {raw_len}-byte value does not fit in {len(out)} bytes")
        if flag == RAW:
            if len(body) != raw_len or prefix != raw_len:
                raise CorruptValue(f"{where}: raw record holds {len(body)} bytes, header says {raw_len}")
            if out is None:
                return bytes(body)
            out[:raw_len] = body
            return out[:raw_len]
        if flag == CHUNK:
            return self._decode_chunk(where, raw_len, prefix, body, out)
        if flag == RUNS:
            return self._decode_runs(where, raw_len, prefix, body, out)
        if flag != ZSTD:
            raise CorruptValue(f"{where}: unknown codec flag {flag}")
        if prefix >= raw_len or prefix > len(body):
            raise CorruptValue(f"{where}: bad raw prefix {prefix} for a {raw_len}-byte value")
        dst = memoryview(bytearray(raw_len)) if out is None else out[:raw_len]
        dst[:prefix] = body[:prefix]
        _frame_into(self._ctx().dctx, where, body[prefix:], [dst[prefix:]])
        return dst.toreadonly() if out is None else dst

    def _decode_chunk(self, where: str, raw_len: int, prefix: int, body: memoryview,
                      dest: memoryview | None) -> memoryview:
        bad = CorruptValue(f"{where}: chunk record's header, section table or lengths are invalid")
        if len(body) < N_FRAMES.size:
            raise bad
        (n_frames,) = N_FRAMES.unpack_from(body)
        at = N_FRAMES.size + FRAME_LEN.size * n_frames
        if len(body) < at + prefix:
            raise bad
        frame_lens = [FRAME_LEN.unpack_from(body, N_FRAMES.size + FRAME_LEN.size * i)[0] for i in range(n_frames)]
        p = record_chunk.plan(body[at : at + prefix], raw_len)
        if p is None or p.header_bytes != prefix or p.n_code_frames != n_frames:
            raise bad
        # every byte is written below: no zero fill
        out = memoryview(np.empty(raw_len, np.uint8).data) if dest is None else dest[:raw_len]
        out[:prefix] = body[at : at + prefix]
        at += prefix
        sign_len = (p.codes_len + 3) // 4
        signs = body[at : at + sign_len]
        at += sign_len
        if at + sum(frame_lens) > len(body):
            raise bad
        dctx = self._ctx().dctx
        view = out[prefix : p.split]
        for flen, runs in zip(frame_lens, p.frame_runs()):  # magnitudes straight into their places
            _frame_into(dctx, where, body[at : at + flen], [view[a : a + n] for a, n in runs])
            at += flen
        record_chunk.codes_inverse(signs, p, out)
        tail = bytearray(p.tail_len)
        _frame_into(dctx, where, body[at:], [memoryview(tail)])
        record_chunk.inverse(tail, p, out)
        return out.toreadonly() if dest is None else out

    def _decode_runs(self, where: str, raw_len: int, prefix: int, body: memoryview,
                     dest: memoryview | None) -> memoryview:
        bad = CorruptValue(f"{where}: runs record's table or lengths are invalid")
        got = runs_record.read_table(body) if prefix <= raw_len else None
        if got is None:
            raise bad
        runs, at = got
        gathered = runs_record.check(runs, prefix)
        if gathered is None or len(body) < at + prefix - gathered:
            raise bad
        raw = prefix - gathered
        # every byte is written below: no zero fill
        out = memoryview(np.empty(raw_len, np.uint8).data) if dest is None else dest[:raw_len]
        dst = np.frombuffer(out, np.uint8)
        runs_record.scatter(np.frombuffer(body, np.uint8, raw, at), runs_record.gaps(runs, prefix), dst)
        packed = np.empty(gathered + raw_len - prefix, np.uint8)
        _frame_into(self._ctx().dctx, where, body[at + raw :], [memoryview(packed.data)])
        runs_record.scatter(packed, runs, dst)
        out[prefix:] = packed.data[gathered:]
        return out.toreadonly() if dest is None else out


def _encode_runs(cctx: Any, view: memoryview, start: int, runs: Any, dest: memoryview) -> int:
    """The flag 3 record of ``view`` in ``dest``: its length, or 0 when ``runs`` are not valid
    runs before ``start`` or the record would not be shorter than the value raw."""
    raw_len = len(view)
    gathered = runs_record.check(runs, start)
    if gathered is None:
        return 0
    src = np.frombuffer(view, np.uint8)
    packed = np.empty(gathered + raw_len - start, np.uint8)
    runs_record.gather(src, runs, packed)
    packed[gathered:] = src[start:]
    frame = cctx.compress(packed.data)
    tab = runs_record.table(runs)
    at = HEADER.size + len(tab)
    raw = start - gathered
    total = at + raw + len(frame)
    if total >= HEADER.size + raw_len:
        return 0
    HEADER.pack_into(dest, 0, RUNS, raw_len, start)
    dest[HEADER.size : at] = tab
    runs_record.gather(src, runs_record.gaps(runs, start), np.frombuffer(dest, np.uint8, raw, at))
    dest[at + raw : total] = frame
    return total


def _compressor(level: int) -> zstd.ZstdCompressor:
    """zstd at ``level``; at level 1 with smaller match tables (hash 2^10, chain 2^6, a 32 KiB
    window): a record's compressible part is a ~24 KB tail of FP8 scales and token ids that gains
    from entropy coding, not from long matches, and level 1's default tables (2^13 and 2^12 entries)
    cost more to reset per frame than they find. Same output size to within 0.1%, 20% faster
    (measured on deepseek-v4.1-flash chunk tails); frames read back with any decoder."""
    if level != 1:
        return zstd.ZstdCompressor(level=level)
    return zstd.ZstdCompressor(compression_params=zstd.ZstdCompressionParameters(
        window_log=15, hash_log=10, chain_log=6, search_log=1, min_match=6, target_length=0,
        strategy=zstd.STRATEGY_FAST, write_content_size=True))


def _encode_chunk(cctx: Any, view: memoryview, p: record_chunk.Plan) -> bytes:
    signs, mags = record_chunk.codes_forward(view, p)
    frames = [cctx.compress(m) for m in mags]
    tail = cctx.compress(record_chunk.forward(view, p))
    return b"".join((HEADER.pack(CHUNK, p.raw_len, p.header_bytes), N_FRAMES.pack(len(frames)),
                     *(FRAME_LEN.pack(len(f)) for f in frames), view[: p.header_bytes], signs, *frames, tail))


def _frame_into(dctx: Any, where: str, frame: memoryview, dests: list[memoryview]) -> None:
    """Decompress the one zstd ``frame`` into ``dests``, filling each in turn; CorruptValue unless
    it fills them exactly."""
    want = sum(len(d) for d in dests)
    try:
        # Check the frame's declared size first: a corrupt one must not make us allocate GBs.
        if zstd.frame_content_size(frame) != want:
            raise CorruptValue(f"{where}: zstd frame size does not match the header's length")
        if len(dests) == 1 and want <= _ONE_SHOT_BYTES:
            # a chunk's tail (~24 KB): one decompress call and a copy cost less than a stream reader's
            # set-up and reads (the 512 tails of a 128K-token deepseek-v4.1-flash session: 18 ms, not 31)
            out = dctx.decompress(frame, max_output_size=want)
            if len(out) != want:
                raise CorruptValue(f"{where}: decompressed {len(out)} bytes, header says {want}")
            dests[0][:] = out
            return
        reader = dctx.stream_reader(frame)
        got = 0
        for dest in dests:
            filled = 0
            while filled < len(dest):
                n = reader.readinto(dest[filled:])
                if not n:
                    raise CorruptValue(f"{where}: decompressed {got + filled} bytes, header says {want}")
                filled += n
            got += filled
    except zstd.ZstdError as exc:
        raise CorruptValue(f"{where}: cannot decompress: {exc}") from exc
