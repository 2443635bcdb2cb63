"""Every read of the store: a batch, each tier asked once, its answers verified in one pass.

A load of a long session is hundreds to thousands of chunks, so each tier, fastest first, is asked
for every key still unserved in one call (``Tier.read_views``: the ssd tier answers them from one
read transaction, raw records as views into its memory map), and what it answered is verified in one
call (``Verify``: for a session's chunks ``kvstore.format.chunk_batch.check``, the C kernel, with the
GIL released). A copy that fails is counted, and dropped from that tier once the batch is done; its
key goes on to the next tier. The values are valid inside the ``with`` block only (views into a
tier's storage): the caller sends or copies them there. As the block ends, failing copies are
dropped, then what slower tiers served is promoted into faster ones (``promotion.py``): from copies
made here, or behind the load, by the store's promotion worker (``store/tiered/promotion.py``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from kvstore.store.tiered.promotion import Promotion
from kvstore.store.tiered.slot import TierSlot
from kvstore.tiers.base import Stored, TierError

log = logging.getLogger(__name__)

#: verify(positions in the load, the values a tier returned for them) -> for each, whether it is valid
Verify = Callable[[Sequence[int], Sequence[Stored]], Sequence[bool]]


class Served(NamedTuple):
    """A batch read's answer: each key's verified value (None: no tier holds a valid copy) and the
    index of the tier that served it (-1 for a miss)."""

    values: list[Stored | None]
    tiers: list[int]


@contextlib.contextmanager
def read_tiers(slots: Sequence[TierSlot], keys: Sequence[bytes], verify: Verify, counted: bool = True
               ) -> Iterator[Served]:
    """The verified value of each key and where it was found, valid inside the block; the copies that
    failed verification are dropped from their tiers as it ends. ``counted``: a tier's hits are
    counted (not for a second read of the same keys, nor a prefetch)."""
    out: list[Stored | None] = [None] * len(keys)
    found_in = [-1] * len(keys)
    failed: list[tuple[TierSlot, bytes]] = []
    try:
        with contextlib.ExitStack() as views_open:
            todo = list(range(len(keys)))
            for t, slot in enumerate(slots):
                if not todo:
                    break
                try:
                    views = views_open.enter_context(slot.read_views([keys[j] for j in todo]))
                except TierError:
                    continue  # counted by the slot; the next tier may hold them
                got = [(j, v) for j, v in zip(todo, views.values) if v is not None]
                ok = verify([j for j, _ in got], [v for _, v in got]) if got else []
                valid = {j for (j, _), good in zip(got, ok) if good}
                for j, v in got:
                    if j in valid:
                        out[j], found_in[j] = v, t
                for j in [todo[p] for p in views.unreadable] + [j for j, _ in got if j not in valid]:
                    slot.counters.verify_failures += 1
                    log.error("chunk %s failed verification in tier %s: deleted there", keys[j].hex(), slot.name)
                    failed.append((slot, keys[j]))
                slot.counters.hits += len(valid) if counted else 0
                todo = [j for j in todo if j not in valid]
            yield Served(out, found_in)
    finally:
        for slot, key in failed:  # after the read transactions ended (a delete is a write), before promotion
            slot.drop(key)


@contextlib.contextmanager
def read_verified(slots: Sequence[TierSlot], up: Promotion, promote: bool, keys: Sequence[bytes],
                  verify: Verify, behind: Callable[[list[int]], None] | None = None, counted: bool = True
                  ) -> Iterator[list[Stored | None]]:
    """``read_tiers``' values, then what slower tiers served promoted (``promote``). ``behind``: not
    copied up here but handed over (its positions in ``keys``) to be read again and promoted after the
    load, on the promotion worker; else copied inside the block and promoted as it ends."""
    copies: list[tuple[bytes, bytes, int]] = []
    with read_tiers(slots, keys, verify, counted) as got:
        yield got.values
        below = [j for j, t in enumerate(got.tiers) if promote and t > 0]
        if behind is not None:
            if below:
                behind(below)
        else:  # copies of what slower tiers served: the views end with this block
            copies = [(keys[j], bytes(got.values[j]), got.tiers[j]) for j in below]  # type: ignore[arg-type]
    up.promote_copies(copies)
