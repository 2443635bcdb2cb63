"""The HBM tier's extent allocator: byte ranges of one preallocated device arena, pure Python.

The arena is a single ``cudaMalloc`` made at startup; values are placed in it by this allocator,
so a put never calls into the CUDA allocator and never competes with the model for memory. Blocks
start ``ALIGN``-byte aligned (as ``cudaMalloc`` does) so copies run at full speed, and a batch is
placed in one contiguous extent when one is free: its values then move in one copy per staging
buffer instead of one per value (``contiguous_runs``). No CUDA here: tested on any machine.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

ALIGN = 256


def aligned(size: int) -> int:
    """``size`` rounded up to the block alignment (the arena bytes a value of ``size`` occupies)."""
    return -(-size // ALIGN) * ALIGN


class ExtentAllocator:
    """First-fit (lowest offset) allocation of byte ranges in [0, capacity); freed ranges are
    coalesced with their neighbours, so freeing everything leaves one free extent again.

    First fit keeps data packed towards offset 0, which leaves the largest extents at the end for
    the next batch. Not thread-safe: the tier calls it under its own lock."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (offset, size), sorted, never adjacent
        self._free_bytes = capacity

    def alloc(self, size: int) -> int | None:
        """Offset of a fresh block of ``size`` (> 0) bytes, or None if no free extent is big enough."""
        if size <= 0:
            raise ValueError(f"size must be > 0, got {size}")
        need = aligned(size)
        for i, (offset, free) in enumerate(self._free):
            if free >= need:
                if free == need:
                    del self._free[i]
                else:
                    self._free[i] = (offset + need, free - need)
                self._free_bytes -= need
                return offset
        return None

    def alloc_many(self, sizes: Sequence[int]) -> list[int] | None:
        """Offsets for blocks of ``sizes`` (each > 0): back to back in one extent when one is big
        enough, else placed one by one. None (and nothing allocated) if they do not all fit."""
        if not sizes:
            return []
        total = sum(aligned(s) for s in sizes)
        start = self.alloc(total)
        if start is not None:
            out, at = [], start
            for s in sizes:
                out.append(at)
                at += aligned(s)
            return out
        if len(sizes) == 1:
            return None
        placed: list[int] = []
        for s in sizes:
            offset = self.alloc(s)
            if offset is None:
                for o, size in zip(placed, sizes):
                    self.release(o, size)
                return None
            placed.append(offset)
        return placed

    def release(self, offset: int, size: int) -> None:
        """Give back a block that ``alloc(size)`` returned (or one value of an ``alloc_many``)."""
        size = aligned(size)
        if offset < 0 or offset + size > self.capacity or offset % ALIGN:
            raise ValueError(f"not a block of this arena: offset {offset}, size {size}")
        i = bisect.bisect(self._free, (offset, 0))
        if (i < len(self._free) and offset + size > self._free[i][0]) or (i > 0 and sum(self._free[i - 1]) > offset):
            raise ValueError(f"block at {offset} (+{size}) overlaps free space: released twice?")
        self._free_bytes += size
        if i < len(self._free) and offset + size == self._free[i][0]:  # merge with the next extent
            size += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == offset:  # merge with the previous extent
            i -= 1
            offset, prev = self._free.pop(i)
            size += prev
        self._free.insert(i, (offset, size))

    def largest(self) -> int:
        """The largest single block that can be allocated now."""
        return max((size for _, size in self._free), default=0)

    def free_bytes(self) -> int:
        return self._free_bytes

    def extents(self) -> list[tuple[int, int]]:
        """The free extents, (offset, size), in address order (a copy; for tests and reports)."""
        return list(self._free)


def paired_runs(blocks: Sequence[tuple[int, int]], dst_offsets: Sequence[int]) -> list[tuple[int, int, int]]:
    """Copies that move ``blocks`` ((src offset, size), sizes > 0, in order) to ``dst_offsets``:
    [(src, dst, bytes)], one per run of blocks that lie back to back (at ``aligned`` spacing) on
    both sides. A run's bytes include the alignment padding between its blocks, never after its
    last one, so a packed batch moves in one copy instead of one per value."""
    runs: list[tuple[int, int, int]] = []
    for i, ((src, size), dst) in enumerate(zip(blocks, dst_offsets, strict=True)):
        if runs:
            prev_src, prev_size = blocks[i - 1]
            step = aligned(prev_size)
            if src == prev_src + step and dst == dst_offsets[i - 1] + step:
                s0, d0, _ = runs[-1]
                runs[-1] = (s0, d0, src + size - s0)
                continue
        runs.append((src, dst, size))
    return runs


def packed_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of ``sizes`` placed back to back at ``aligned`` spacing, and the bytes they span."""
    out, at = [], 0
    for s in sizes:
        out.append(at)
        at += aligned(s)
    return out, at


class Segment(NamedTuple):
    """What one staging buffer carries in one trip: ``pieces`` (value index, offset within the
    value, offset in the buffer, bytes) copied by the CPU, and ``copies`` (buffer offset, arena
    offset, bytes) made by the DMA engine."""

    pieces: list[tuple[int, int, int, int]]
    copies: list[tuple[int, int, int]]


def plan_uploads(blocks: Sequence[tuple[int, int]], lanes: int, buffer_bytes: int) -> list[list[Segment]]:
    """Split an upload of ``blocks`` ((arena offset, size), sizes > 0) into at most ``lanes`` lists
    of segments of at most ``buffer_bytes`` (a multiple of ``ALIGN``) each, with about equal bytes
    per lane: each lane copies its share into its own staging buffers while its earlier segments
    are on their way to the device. Values larger than a buffer are split across segments."""
    if buffer_bytes <= 0 or buffer_bytes % ALIGN:
        raise ValueError(f"buffer_bytes must be a positive multiple of {ALIGN}, got {buffer_bytes}")
    pieces = [(i, within, min(buffer_bytes, size - within))
              for i, (_, size) in enumerate(blocks) for within in range(0, size, buffer_bytes)]
    total = sum(n for _, _, n in pieces)
    lanes = max(1, min(lanes, -(-total // buffer_bytes)))
    plan: list[list[Segment]] = [[] for _ in range(lanes)]
    lane, done, pos = 0, 0, buffer_bytes  # pos == buffer_bytes: the lane's next piece opens a segment
    for i, within, n in pieces:
        if lane < lanes - 1 and done >= total * (lane + 1) / lanes:
            lane, pos = lane + 1, buffer_bytes
        if pos + n > buffer_bytes:
            plan[lane].append(Segment([], []))
            pos = 0
        seg = plan[lane][-1]
        seg.pieces.append((i, within, pos, n))
        pos += aligned(n)
        done += n
    for segments in plan:
        for seg in segments:
            blocks_here = [(p, n) for _, _, p, n in seg.pieces]
            seg.copies.extend(paired_runs(blocks_here, [blocks[i][0] + w for i, w, _, _ in seg.pieces]))
    return [segments for segments in plan if segments]
