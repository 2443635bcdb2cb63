"""The host tier's memory pool: a dropped value's buffer is lent again only once nothing refers to
it (a reader's view of a deleted value keeps its bytes), buffers are faulted in ahead of the saves
that copy into them, and what the pool keeps free is bounded."""

from __future__ import annotations

import time

import numpy as np

from kvstore.tiers.config import HostTierConfig
from kvstore.tiers.host.tier import MIN_AHEAD_BYTES, HostPool, HostTier

N = 256 << 10


def _address(view: memoryview | bytes) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _wait(pred: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.01)


def test_a_dropped_value_s_memory_is_lent_again_once_unreferenced() -> None:
    tier = HostTier(HostTierConfig(pin_memory=False, reserve_bytes=0))
    try:
        tier.put_many([(_key(1), b"a" * N)])
        view = tier.get_many([_key(1)])[0]
        assert view is not None
        first = _address(view)
        del view
        assert tier.delete_many([_key(1)]) == 1
        tier.put_many([(_key(2), b"b" * N)])
        again = tier.get_many([_key(2)])[0]
        assert again is not None and _address(again) == first and bytes(again) == b"b" * N
    finally:
        tier.close()


def test_a_reader_s_view_of_a_deleted_value_keeps_its_bytes() -> None:
    tier = HostTier(HostTierConfig(pin_memory=False, reserve_bytes=0))
    try:
        tier.put_many([(_key(1), b"a" * N)])
        held = tier.get_many([_key(1)])[0]
        assert held is not None and held.readonly
        tier.delete_many([_key(1)])
        for i in range(2, 6):  # saves of the same size after the delete: none may take that buffer
            tier.put_many([(_key(i), bytes([i]) * N)])
        assert bytes(held) == b"a" * N
        assert _address(held) not in {_address(tier.get_many([_key(i)])[0]) for i in range(2, 6)}  # type: ignore[arg-type]
        tier.put_many([(_key(2), b"c" * N)])  # a replaced value gives its buffer back too
        assert bytes(tier.get_many([_key(2)])[0]) == b"c" * N  # type: ignore[arg-type]
    finally:
        tier.close()


def test_buffers_are_faulted_in_ahead_of_the_takes() -> None:
    pool = HostPool(reserve_bytes=8 * N)
    try:
        pool.take(N)  # the first of a size is faulted in line; it tells the pool the size
        _wait(lambda: pool.held_bytes() >= 8 * N)
        assert pool.held_bytes() == 8 * N
        before = pool.faulted_in_line
        bufs = [pool.take(N) for _ in range(8)]
        assert pool.faulted_in_line == before and all(len(b) == N for b in bufs)
    finally:
        pool.close()


def test_what_the_pool_keeps_free_is_bounded_and_small_values_stay_bytes() -> None:
    pool = HostPool(reserve_bytes=4 * N)
    try:
        for _ in range(16):
            pool.give(np.empty(N, np.uint8))
        assert pool.held_bytes() <= 4 * N
    finally:
        pool.close()
    tier = HostTier(HostTierConfig(pin_memory=False))
    try:
        tier.put_many([(_key(1), b"x" * (MIN_AHEAD_BYTES - 1))])
        assert isinstance(tier.get_many([_key(1)])[0], bytes)
        tier.put_many([(_key(2), b"y" * MIN_AHEAD_BYTES)])
        got = tier.get_many([_key(2)])[0]
        assert isinstance(got, memoryview) and got.readonly and bytes(got) == b"y" * MIN_AHEAD_BYTES
    finally:
        tier.close()


def test_a_lent_buffer_put_whole_is_kept_without_a_copy_and_anything_else_is_copied() -> None:
    tier = HostTier(HostTierConfig(pin_memory=False))
    try:
        lent = tier.buffer_for(N)
        assert lent is not None and not lent.readonly and tier.buffer_for(MIN_AHEAD_BYTES - 1) is None
        lent[:] = b"s" * N
        tier.put_many([(_key(1), lent.toreadonly())])  # what a save does with its private copy of a chunk
        got = tier.get_many([_key(1)])[0]
        assert got is not None and _address(got) == _address(lent) and bytes(got) == b"s" * N
        again = tier.buffer_for(N)  # lent twice, put twice: the second put of the first copies
        assert again is not None
        again[:] = b"t" * N
        tier.put_many([(_key(2), again)])
        tier.put_many([(_key(3), lent)])
        assert _address(tier.get_many([_key(2)])[0]) == _address(again)  # type: ignore[arg-type]
        assert _address(tier.get_many([_key(3)])[0]) != _address(lent)  # type: ignore[arg-type]
        part = tier.buffer_for(2 * N)
        assert part is not None
        part[:] = b"p" * (2 * N)
        tier.put_many([(_key(4), part[:N])])  # a slice of a lent buffer is not the buffer: copied
        got = tier.get_many([_key(4)])[0]
        assert _address(got) != _address(part) and bytes(got) == b"p" * N  # type: ignore[arg-type]
    finally:
        tier.close()
