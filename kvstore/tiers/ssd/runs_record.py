"""The ssd tier's gathered-runs record body (record flag 3): a value whose compressible bytes are
spread through it (a page blob's scale rows: a split page's after its data rows, an interleaved
page's after each record's data) and at its tail.

    u16 G | G x (u32 offset, u32 length, u32 stride, u32 count)
    | value[:prefix] less the gathered bytes, in order, raw
    | one zstd frame of: the gathered bytes (run by run, instance by instance), then value[prefix:]

A run (offset, length, stride, count) is ``count`` byte runs of ``length``, the i-th at ``offset + i *
stride``. The runs say everything a reader needs (no layout): they must be in offset order and not
overlap (``check``), all before ``prefix``. Gather and scatter are numpy strided copies, one per run
(a page's 128 or 256 records' scales are one run, the equal pages of a group one too).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

N_RUNS, RUN = struct.Struct("<H"), struct.Struct("<IIII")
MAX_RUNS = 0xFFFF

Run = tuple[int, int, int, int]
#: A value's runs to gather (offset order), or None: the value is no page blob this codec knows.
CompressibleRuns = Callable[[bytes | memoryview], Sequence[Run] | None]


def check(runs: Sequence[Run], prefix: int) -> int | None:
    """The bytes ``runs`` gather, or None unless they are valid runs before ``prefix``: each of
    length >= 1, count >= 1, stride >= length, every run starting at or after the end of the one
    before it, the last ending at or before ``prefix``."""
    if not 0 < len(runs) <= MAX_RUNS:
        return None
    end = total = 0
    for off, length, stride, count in runs:
        if length < 1 or count < 1 or stride < length or off < end:
            return None
        end = off + (count - 1) * stride + length
        total += length * count
    return total if end <= prefix else None


def gaps(runs: Sequence[Run], prefix: int) -> list[Run]:
    """The runs of ``[0, prefix)`` that ``runs`` (valid: ``check``) leave out, in offset order."""
    out: list[Run] = []
    at = 0
    for off, length, stride, count in runs:
        if off > at:
            out.append((at, off - at, off - at, 1))
        if count > 1 and stride > length:
            out.append((off + length, stride - length, stride, count - 1))
        at = off + (count - 1) * stride + length
    if prefix > at:
        out.append((at, prefix - at, prefix - at, 1))
    return out


def _strided(a: np.ndarray, run: Run) -> np.ndarray:
    off, length, stride, count = run
    return as_strided(a[off:], shape=(count, length), strides=(stride, 1), writeable=a.flags.writeable)


def gather(src: np.ndarray, runs: Sequence[Run], dst: np.ndarray) -> int:
    """Copy ``runs`` of ``src`` into ``dst`` back to back; the bytes copied."""
    at = 0
    for run in runs:
        n = run[1] * run[3]
        dst[at : at + n].reshape(run[3], run[1])[...] = _strided(src, run)
        at += n
    return at


def scatter(src: np.ndarray, runs: Sequence[Run], dst: np.ndarray) -> int:
    """``gather`` undone: ``src``'s bytes, back to back, into ``runs`` of ``dst``; the bytes copied."""
    at = 0
    for run in runs:
        n = run[1] * run[3]
        _strided(dst, run)[...] = src[at : at + n].reshape(run[3], run[1])
        at += n
    return at


def table(runs: Sequence[Run]) -> bytes:
    return N_RUNS.pack(len(runs)) + b"".join(RUN.pack(*r) for r in runs)


def read_table(body: memoryview) -> tuple[list[Run], int] | None:
    """(runs, bytes the table takes) at the start of a flag 3 body; None if truncated."""
    if len(body) < N_RUNS.size:
        return None
    (n,) = N_RUNS.unpack_from(body)
    at = N_RUNS.size + RUN.size * n
    if len(body) < at:
        return None
    return [RUN.unpack_from(body, N_RUNS.size + RUN.size * i) for i in range(n)], at
