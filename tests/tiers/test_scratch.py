"""The scratch shelf (kvstore/tiers/scratch.py) lends numpy buffers, which compare element-wise: a lend must
take the kept buffer it chose by position, whatever the sizes on the shelf (a shelf of two buffers of
different sizes once made every decoded ssd read of a compressed record fail)."""

from __future__ import annotations

import numpy as np

from kvstore.tiers.scratch import MIN_BYTES, Scratch


def test_a_lend_takes_the_smallest_kept_buffer_that_fits_among_numpy_buffers_of_any_size() -> None:
    made: list[int] = []

    def alloc(n: int) -> np.ndarray:
        made.append(n)
        return np.zeros(n, np.uint8)

    shelf: Scratch[np.ndarray] = Scratch(alloc)
    with shelf.lending() as lend:  # two buffers of different sizes, then both kept
        lend(3 * MIN_BYTES)
        lend(5 * MIN_BYTES)
    with shelf.lending() as lend:
        a = lend(2 * MIN_BYTES)  # the 3 MiB one
        b = lend(4 * MIN_BYTES)  # the 5 MiB one
        c = lend(MIN_BYTES)  # none left: a new one
    assert made == [3 * MIN_BYTES, 5 * MIN_BYTES, MIN_BYTES]
    assert (len(a), len(b), len(c)) == (2 * MIN_BYTES, 4 * MIN_BYTES, MIN_BYTES)
    assert a.base is not b.base
    with shelf.lending() as lend:  # equal sizes on the shelf: still by position
        x, y = lend(5 * MIN_BYTES), lend(3 * MIN_BYTES)
    assert len(x) == 5 * MIN_BYTES and len(y) == 3 * MIN_BYTES and len(made) == 3
