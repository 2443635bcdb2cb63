"""Checks for a batch of chunk blobs at once, and copies of the valid ones, in one pass.

What a load applies to every chunk it reads (``kvstore/store/sessions/reads.py``, against ``chunk_index.py``):
the header's sanity checks (``chunk.read_header``), the xxh3-64 checksum (``chunk.verify_checksum``),
the header's claims (key, layout, start, token count) against what the store expects, and the key
recomputed from the chunk's own token ids (``keys.chunk_key_raw``, a chained xxh3-128). Here for N
blobs in one call: by the C kernel (``kvstore/format/_chunks.c``) when it was built, with no Python
per chunk and the GIL released; else by :func:`check_reference`, the same checks chunk by chunk in
Python. Both give the same :class:`Status` for every blob (tests/format/test_chunk_batch.py).

With ``dest``, each valid blob is also copied into the caller's buffer at its offset, in the same
pass: the checksum is computed over the source (bringing it into cache), then the blob is streamed
from cache into ``dest``: about one memcpy for checks and copy together. The source must not change
during the call (tier values are immutable, or a read transaction's snapshot); a slot whose blob
fails is left as it was.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

import numpy as np

from kvstore.format import chunk
from kvstore.format.keys import KEY_BYTES, ROOT, chunk_key_raw

try:
    import kvstore.format._chunks as _chunks
except ImportError:  # not built (a source checkout without a compiler): the Python reference below
    _chunks = None

#: Whether the C kernel is in use (else the Python reference answers every call).
NATIVE = _chunks is not None
#: A contiguous buffer: a blob, or a destination (then writable: a bytearray, a numpy array's ``.data``,
#: an arena's view).
Buffer: TypeAlias = bytes | bytearray | memoryview


class Status(enum.IntEnum):
    """Why a blob is not the chunk expected (VALID when it is). Values shared with _chunks.c."""

    VALID = 0
    MISSING = 1  # None: the tier had no value
    TRUNCATED = 2  # chunk.TruncatedChunk
    OVERSIZED = 3  # chunk.OversizedChunk
    BAD_MAGIC = 4  # chunk.BadMagic
    BAD_VERSION = 5  # chunk.UnsupportedVersion
    MALFORMED = 6  # chunk.MalformedChunk (of the header)
    CHECKSUM = 7  # chunk.ChecksumMismatch
    CLAIM = 8  # the header names another key, layout, start or token count
    KEY = 9  # the key recomputed from its token ids is not the key expected
    NO_ROOM = 10  # valid, but longer than its slot in ``dest``: not copied


_HEADER_ERRORS: dict[type[chunk.ChunkError], Status] = {
    chunk.TruncatedChunk: Status.TRUNCATED, chunk.OversizedChunk: Status.OVERSIZED, chunk.BadMagic: Status.BAD_MAGIC,
    chunk.UnsupportedVersion: Status.BAD_VERSION, chunk.MalformedChunk: Status.MALFORMED,
}


@dataclass(frozen=True)
class Expected:
    """What each of N blobs must be: blob i claims ``keys[i]``, ``layout_ids`` (one for all, or one
    per blob), ``starts[i]`` and ``token_count`` tokens. With ``parents`` (and ``namespace``), its
    key is also recomputed from its token ids: ``chunk_key_raw(layout, namespace, parents[i], ids)``
    must give ``keys[i]`` (a collision, or a chunk planted under another's key, fails)."""

    keys: Sequence[bytes]
    layout_ids: bytes | Sequence[bytes]
    starts: Sequence[int] | np.ndarray
    token_count: int
    namespace: str | None = None
    parents: Sequence[bytes] | None = None

    @classmethod
    def chain(cls, keys: Sequence[bytes], layout_id: bytes, namespace: str, chunk_tokens: int,
              first_index: int = 0, parent: bytes = ROOT) -> Expected:
        """Consecutive chunks of one sequence (a session's), the first at ``first_index`` after ``parent``."""
        keys = list(keys)
        return cls(keys, layout_id, np.arange(first_index, first_index + len(keys), dtype=np.int64) * chunk_tokens,
                   chunk_tokens, namespace, [parent, *keys[:-1]])

    def __len__(self) -> int:
        return len(self.keys)

    def layout_at(self, i: int) -> bytes:
        return self.layout_ids if isinstance(self.layout_ids, bytes) else self.layout_ids[i]


class BatchResult(NamedTuple):
    """One :class:`Status` per blob, as a uint8 array."""

    status: np.ndarray

    @property
    def valid(self) -> np.ndarray:
        """bool [N]: which blobs are the chunks expected (and, with a ``dest``, were copied there)."""
        return self.status == Status.VALID

    @property
    def all_valid(self) -> bool:
        return not self.status.any()

    def failures(self) -> dict[int, Status]:
        """{index: status} of the blobs that are not valid."""
        return {int(i): Status(int(self.status[i])) for i in np.flatnonzero(self.status)}


def check(blobs: Sequence[Buffer | None], expected: Expected, *, dest: Buffer | None = None,
          dest_offsets: Sequence[int] | np.ndarray | None = None, slot_sizes: Sequence[int] | np.ndarray | None = None,
          threads: int = 1) -> BatchResult:
    """Check N blobs (contiguous buffers; None for a miss) against ``expected``; with ``dest`` (a
    writable buffer), copy each valid blob i to ``dest[dest_offsets[i]:]`` (NO_ROOM where it does not
    fit, in ``dest`` or in ``slot_sizes[i]`` bytes). ``threads``: split the pass over that many
    threads (the C kernel only). ValueError on arguments that do not describe N blobs."""
    args = _arguments(len(blobs), expected, dest, dest_offsets, slot_sizes)
    if _chunks is None:
        return check_reference(blobs, expected, dest=dest, dest_offsets=dest_offsets, slot_sizes=slot_sizes)
    status = np.empty(len(blobs), np.uint8)
    try:
        _chunks.check(list(blobs), *args, status, threads)
    except BufferError as e:  # what the buffer protocol raises for a strided view
        raise ValueError(f"chunk blobs must be contiguous buffers: {e}") from e
    return BatchResult(status)


def addresses(blobs: Sequence[Buffer | None]) -> np.ndarray:
    """uint64 [N]: the address of each contiguous blob's first byte (0 for None), valid while the blob
    lives (the C kernel in one call, else numpy's view of each)."""
    out = np.zeros(len(blobs), np.uint64)
    if _chunks is not None:
        _chunks.addresses(list(blobs), out)
    else:
        for i, b in enumerate(blobs):
            if b is not None:
                out[i] = np.frombuffer(b, np.uint8).ctypes.data
    return out


def check_packed(buffer: Buffer, offsets: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray,
                 expected: Expected, *, dest: Buffer | None = None,
                 dest_offsets: Sequence[int] | np.ndarray | None = None,
                 slot_sizes: Sequence[int] | np.ndarray | None = None, threads: int = 1) -> BatchResult:
    """:func:`check` of the blobs ``buffer[offsets[i] : offsets[i] + lengths[i]]`` (e.g. an arena a
    daemon filled, or a caller's buffer it loaded into); ValueError if one lies outside ``buffer``."""
    offs, lens = _int64(offsets), _int64(lengths)
    size = memoryview(buffer).nbytes
    if len(offs) != len(lens) or ((offs < 0) | (lens < 0) | (offs + lens > size)).any():
        raise ValueError(f"offsets and lengths must be as many and lie within the {size}-byte buffer")
    args = _arguments(len(offs), expected, dest, dest_offsets, slot_sizes)
    if _chunks is None:
        mv = _bytes(buffer)
        blobs = [mv[o : o + n] for o, n in zip(offs.tolist(), lens.tolist())]
        return check_reference(blobs, expected, dest=dest, dest_offsets=dest_offsets, slot_sizes=slot_sizes)
    status = np.empty(len(offs), np.uint8)
    _chunks.check_packed(buffer, offs, lens, *args, status, threads)
    return BatchResult(status)


def check_reference(blobs: Sequence[Buffer | None], expected: Expected, *, dest: Buffer | None = None,
                    dest_offsets: Sequence[int] | np.ndarray | None = None,
                    slot_sizes: Sequence[int] | np.ndarray | None = None) -> BatchResult:
    """:func:`check` in Python, blob by blob, through chunk.py's own checks: the reference the C
    kernel is tested against, and the path where it was not built."""
    _arguments(len(blobs), expected, dest, dest_offsets, slot_sizes)
    out = memoryview(dest).cast("B") if dest is not None else None
    offs = _int64(dest_offsets).tolist() if dest_offsets is not None else []
    slots = _int64(slot_sizes).tolist() if slot_sizes is not None else None
    status = np.empty(len(blobs), np.uint8)
    for i, blob in enumerate(blobs):
        st = Status.MISSING if blob is None else _status(_bytes(blob), expected, i)
        if st is Status.VALID and out is not None:
            mv = _bytes(blob)  # type: ignore[arg-type]
            room = max(0, len(out) - offs[i]) if slots is None else min(max(0, len(out) - offs[i]), slots[i])
            if len(mv) > room:
                st = Status.NO_ROOM
            else:
                out[offs[i] : offs[i] + len(mv)] = mv
        status[i] = st
    return BatchResult(status)


def _status(mv: memoryview, expected: Expected, i: int) -> Status:
    try:
        h = chunk.read_header(mv)
    except chunk.ChunkError as e:
        return _HEADER_ERRORS[type(e)]
    try:
        chunk.verify_checksum(mv)
    except chunk.ChecksumMismatch:
        return Status.CHECKSUM
    layout_id = expected.layout_at(i)
    if (h.key, h.layout_id, h.start, h.token_count) != (expected.keys[i], layout_id, int(expected.starts[i]),
                                                        expected.token_count):
        return Status.CLAIM
    if expected.parents is not None:
        ids = chunk.token_ids_raw(mv, h)
        if chunk_key_raw(layout_id, expected.namespace or "", expected.parents[i], ids) != expected.keys[i]:
            return Status.KEY
    return Status.VALID


def _bytes(blob: Buffer) -> memoryview:
    mv = memoryview(blob)
    if not mv.contiguous:
        raise ValueError("chunk blobs must be contiguous buffers")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _int64(values: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int64).reshape(-1)


def _packed(keys: Sequence[bytes], n: int, what: str) -> bytes:
    if len(keys) != n or any(len(k) != KEY_BYTES for k in keys):
        raise ValueError(f"{what}: {n} values of {KEY_BYTES} bytes expected")
    return b"".join(keys)


def _arguments(n: int, e: Expected, dest: Buffer | None, dest_offsets: Sequence[int] | np.ndarray | None,
               slot_sizes: Sequence[int] | np.ndarray | None) -> tuple[object, ...]:
    """The C kernel's arguments after the blobs and before the status array; ValueError where they
    do not describe ``n`` blobs."""
    keys = _packed(e.keys, n, "keys")
    layouts = e.layout_ids * n if isinstance(e.layout_ids, bytes) else _packed(e.layout_ids, n, "layout_ids")
    if len(layouts) != KEY_BYTES * n:
        raise ValueError(f"layout id must be {KEY_BYTES} bytes")
    starts = _int64(e.starts)
    if len(starts) != n or (starts < 0).any():
        raise ValueError(f"starts: {n} non-negative values expected")
    if not 0 <= e.token_count < 1 << 32:
        raise ValueError(f"token_count {e.token_count} is outside [0, 2^32)")
    parents = None if e.parents is None else _packed(e.parents, n, "parents")
    ns = (e.namespace or "").encode()
    offs = slots = None
    if dest is not None:
        if memoryview(dest).readonly:
            raise ValueError("dest must be a writable buffer")
        if dest_offsets is None:
            raise ValueError("dest needs dest_offsets")
        offs = _int64(dest_offsets)
        if len(offs) != n or (offs < 0).any():
            raise ValueError(f"dest_offsets: {n} non-negative values expected")
        if slot_sizes is not None:
            slots = _int64(slot_sizes)
            if len(slots) != n or (slots < 0).any():
                raise ValueError(f"slot_sizes: {n} non-negative values expected")
    return keys, layouts, starts, e.token_count, ns, parents, dest, offs, slots
