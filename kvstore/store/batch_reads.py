"""A whole load's chunks read from the tiers as batches: each tier asked once, its answers verified in one pass.

``TieredStore.get`` reads and verifies one key at a time (Python per chunk: a tier call, a header
parse, a checksum, a key recomputed). A load of a long session is hundreds to thousands of chunks,
so here each tier, fastest first, is asked for every key still unserved in one call
(``Tier.read_views``: the ssd tier answers them from one read transaction, raw records as views
into its memory map), and what it answered is verified in one call (``Verify``: for chunks
``kvstore.format.chunk_batch.check``, the C kernel, with the GIL released). A copy that fails is
counted, and dropped from that tier once the batch is done; its key goes on to the next tier, as in
``Promotion.find``. The values are valid inside the ``with`` block only (views into a tier's
storage): the caller sends or copies them there. As the block ends, failing copies are dropped,
then what slower tiers served is promoted into faster ones, from copies, best effort as every promotion.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence

from kvstore.store.promotion import Promotion
from kvstore.store.tier_slot import TierSlot
from kvstore.tiers.base import Stored, TierError

log = logging.getLogger(__name__)

#: verify(positions in the load, the values a tier returned for them) -> for each, whether it is valid
Verify = Callable[[Sequence[int], Sequence[Stored]], Sequence[bool]]


@contextlib.contextmanager
def read_verified(slots: Sequence[TierSlot], up: Promotion, durable: int, promote: bool, keys: Sequence[bytes],
                  verify: Verify, behind: Callable[[list[int]], None] | None = None, counted: bool = True
                  ) -> Iterator[list[Stored | None]]:
    """The verified value of each key (None: no tier holds a valid copy), valid inside the block.
    ``behind``: what slower tiers served is not copied up here but handed over (its positions in
    ``keys``) to be read again and promoted after the load (``promote_behind.py``). ``counted``: a
    tier's hits are counted (not for that second read)."""
    out: list[Stored | None] = [None] * len(keys)
    found_in = [-1] * len(keys)
    failed: list[tuple[TierSlot, bytes]] = []
    copies: list[tuple[bytes, bytes, int]] = []
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
            yield out
            below = [j for j, (blob, t) in enumerate(zip(out, found_in)) if promote and t > 0 and blob is not None]
            if behind is not None:
                if below:
                    behind(below)
            else:  # copies of what slower tiers served, for promotion: the views end with this block
                copies = [(keys[j], bytes(out[j]), found_in[j]) for j in below]  # type: ignore[arg-type]
    finally:
        for slot, key in failed:  # after the read transactions ended (a delete is a write), before promotion
            slot.drop(key)
    durable_later: list[tuple[bytes, Stored]] = []  # read below the durable tier: one batch, one fsync
    for key, copy, t in copies:
        if t > durable:
            durable_later.append((key, copy))
        up.promote(key, copy, min(t, durable))
    up.promote_durably(durable_later)
