"""The HBM tier's allocator and copy planner: pure logic, run on any machine (no CUDA).

The planner is checked by carrying out its plan with numpy on host arrays standing in for the
staging buffers and the device arena: every value must land byte-exact where it was allocated."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstore.tiers.hbm.alloc import (
    ALIGN,
    ExtentAllocator,
    aligned,
    packed_offsets,
    paired_runs,
    plan_uploads,
)


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[0] + aligned(b[1]) and b[0] < a[0] + aligned(a[1])


def test_random_alloc_release_never_overlaps_and_coalesces() -> None:
    capacity, rng = 1 << 20, random.Random(0)
    alloc = ExtentAllocator(capacity)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            offset = rng.choice(list(live))
            alloc.release(offset, live.pop(offset))
        elif rng.random() < 0.2:
            sizes = [rng.randint(1, 9000) for _ in range(rng.randint(1, 6))]
            offsets = alloc.alloc_many(sizes)
            for o, s in zip(offsets or [], sizes):
                assert all(not _overlaps((o, s), block) for block in live.items())
                live[o] = s
        else:
            size = rng.randint(1, 40_000)
            offset = alloc.alloc(size)
            if offset is None:
                assert alloc.largest() < aligned(size)
                continue
            assert offset % ALIGN == 0 and offset + size <= capacity
            assert all(not _overlaps((offset, size), block) for block in live.items())
            live[offset] = size
        assert alloc.free_bytes() == capacity - sum(aligned(s) for s in live.values())
    for offset, size in live.items():
        alloc.release(offset, size)
    assert alloc.extents() == [(0, capacity)]


def test_alloc_many_is_contiguous_when_it_can_be_and_all_or_nothing() -> None:
    alloc = ExtentAllocator(10 * 1024)
    offsets = alloc.alloc_many([1000, 1024, 10])
    assert offsets == [0, 1024, 2048]
    hole = alloc.alloc(1024)  # 2304..3328
    assert hole == 2304
    alloc.release(1024, 1024)  # a 1 KiB hole at 1024
    free_before = alloc.extents()
    assert alloc.alloc_many([8000, 8000]) is None  # does not fit: nothing allocated
    assert alloc.extents() == free_before
    scattered = alloc.alloc_many([1024, 6000])  # no extent for both: placed one by one
    assert scattered == [1024, 3328]


def test_release_rejects_foreign_and_double_frees() -> None:
    alloc = ExtentAllocator(4096)
    offset = alloc.alloc(100)
    assert offset == 0
    alloc.release(0, 100)
    with pytest.raises(ValueError):
        alloc.release(0, 100)
    with pytest.raises(ValueError):
        alloc.release(3, 10)
    with pytest.raises(ValueError):
        ExtentAllocator(0)


def test_paired_runs_merge_only_what_is_back_to_back_on_both_sides() -> None:
    blocks = [(0, 1000), (1024, 256), (1280, 10), (4096, 512)]
    dst, span = packed_offsets([s for _, s in blocks])
    assert dst == [0, 1024, 1280, 1536] and span == 2048
    assert paired_runs(blocks, dst) == [(0, 0, 1290), (4096, 1536, 512)]
    assert paired_runs(blocks, [0, 1024, 5000, 5256]) == [(0, 0, 1280), (1280, 5000, 10), (4096, 5256, 512)]


@pytest.mark.parametrize(("lanes", "buffer_bytes"), [(1, 4096), (3, 4096), (8, 2048), (4, 1 << 16)])
def test_plan_uploads_carried_out_lands_every_byte(lanes: int, buffer_bytes: int) -> None:
    rng = np.random.default_rng(7)
    sizes = [int(s) for s in rng.integers(1, 9000, size=40)] + [buffer_bytes * 3 + 5]
    alloc = ExtentAllocator(1 << 20)
    alloc.alloc(300)  # the batch does not start at 0
    offsets = alloc.alloc_many(sizes)
    assert offsets is not None
    values = [rng.integers(0, 256, size=s, dtype=np.uint8) for s in sizes]
    arena = np.zeros(1 << 20, dtype=np.uint8)
    plan = plan_uploads(list(zip(offsets, sizes)), lanes, buffer_bytes)
    assert 1 <= len(plan) <= lanes
    per_lane = [sum(n for seg in segs for *_, n in seg.pieces) for segs in plan]
    assert sum(per_lane) == sum(sizes)
    for segments in plan:
        for seg in segments:
            staging = np.zeros(buffer_bytes, dtype=np.uint8)
            for i, within, pos, n in seg.pieces:
                assert pos % ALIGN == 0 and pos + n <= buffer_bytes
                staging[pos:pos + n] = values[i][within:within + n]
            for pos, dev, n in seg.copies:
                arena[dev:dev + n] = staging[pos:pos + n]
    for o, v in zip(offsets, values):
        assert np.array_equal(arena[o:o + len(v)], v)
    if lanes == 1 and buffer_bytes == 1 << 16:  # contiguous batch: few copies, not one per value
        assert sum(len(seg.copies) for seg in plan[0]) <= len(plan[0]) + 1


def test_plan_uploads_rejects_unaligned_buffers() -> None:
    with pytest.raises(ValueError):
        plan_uploads([(0, 10)], 1, 1000)
    assert plan_uploads([], 4, 4096) == []
