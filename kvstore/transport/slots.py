"""Slots: engine pages in the caller's region of slots, loaded into it (scatter) and saved from it (gather).

An engine's CPU cache is one region cut into slots (vLLM's primary tier: one block stride per
slot). A load of page blobs names that region (``CallerMemory``: address, size), ``slot_bytes`` and,
for each key, the offset of its slot; the daemon writes each verified blob's payload (the engine's
block bytes, kvstore/format/page.py) at its slot's start, nothing else: the header and checksum stay
with the daemon, the bytes of a slot past the payload, and every slot of a miss, are left as they
were. Both sides check the slots the same way, before any byte is written (this module: the daemon
on the request, the client before its own copy where the daemon cannot write).

A save of engine pages reads them the same way (``gather``, ``CallerPages``): the daemon reads each
slot's block bytes with process_vm_readv straight into the buffer the store keeps, and builds the
page blob (header, key, checksum) around them itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.format import page
from kvstore.format.page_layout import PageLayout
from kvstore.transport import cma
from kvstore.v1 import kvstore_pb2 as pb


def check(offsets: Sequence[int] | np.ndarray, slot_bytes: int, size: int, n_keys: int) -> np.ndarray:
    """The slot offsets as uint64, if there is one per key and every slot lies inside the
    ``size``-byte region without overlapping another; else InvalidArgument naming the field."""
    off = np.asarray(offsets, np.uint64).reshape(-1)
    if len(off) != n_keys:
        raise InvalidArgument(f"CallerMemory.slot_offsets names {len(off)} slots for {n_keys} keys: one per key")
    if slot_bytes <= 0:
        raise InvalidArgument("CallerMemory.slot_bytes must be positive with slot_offsets")
    if not n_keys:
        return off
    if slot_bytes > size or int(off.max()) > size - slot_bytes:
        bad = int(np.argmax(off > np.uint64(max(size - slot_bytes, 0)))) if slot_bytes <= size else 0
        raise InvalidArgument(f"CallerMemory.slot_offsets[{bad}] = {int(off[bad])}: a slot of {slot_bytes} bytes "
                              f"there ends past the region's {size} bytes")
    order = np.argsort(off, kind="stable")
    gaps = np.diff(off[order])
    if (gaps < np.uint64(slot_bytes)).any():
        j = int(order[int(np.argmax(gaps < np.uint64(slot_bytes))) + 1])
        raise InvalidArgument(f"CallerMemory.slot_offsets[{j}] = {int(off[j])} overlaps another slot "
                              f"({slot_bytes} bytes each)")
    return off


class Scatter(NamedTuple):
    """Where each key of a scatter load goes: its slot's offset within its region, its slot's absolute
    address in the caller's memory, and its slot's size (all uint64, one per key); ``hull``: the
    (address, size) spanning every region (named by an error about the caller's memory)."""

    offsets: np.ndarray
    addresses: np.ndarray
    slot_bytes: np.ndarray
    hull: tuple[int, int]


def region_field(i: int) -> str:
    """The request field of region ``i`` of a load into several regions (0 = into)."""
    return "into" if i == 0 else f"more_into[{i - 1}]"


def scatter(regions: Sequence[pb.CallerMemory], n_keys: int, prefix: str = "",
            field: Callable[[int], str] = region_field) -> Scatter:
    """The slots of a load of ``n_keys`` engine pages into ``regions`` of the caller's memory: one region
    (``check``: one slot per key), or several, the keys split over them in order, each taking as many as
    its ``slot_offsets`` name. Every region's slots are checked as ``check`` does (the error prefixed
    with ``prefix`` and the region's ``field``: into or more_into[i] on the wire), and no two slots of
    different regions may overlap: InvalidArgument naming the field."""
    if len(regions) == 1:
        r = regions[0]
        off = check(r.slot_offsets, r.slot_bytes, r.size, n_keys)
        return Scatter(off, off + np.uint64(r.address), np.full(len(off), r.slot_bytes, np.uint64), (r.address, r.size))
    counts = [len(r.slot_offsets) for r in regions]
    if sum(counts) != n_keys:
        raise InvalidArgument(f"{prefix}{field(0)}..{field(len(regions) - 1)}: the regions name {sum(counts)} slots "
                              f"for {n_keys} keys: one per key, the keys split over the regions in order")
    parts = []
    for i, r in enumerate(regions):
        try:
            parts.append(check(r.slot_offsets, r.slot_bytes, r.size, counts[i]))
        except InvalidArgument as e:
            raise InvalidArgument(f"{prefix}{field(i)}: {e}") from None
    off = np.concatenate(parts) if parts else np.zeros(0, np.uint64)
    of = np.repeat(np.arange(len(regions)), counts)  # each key's region
    bases = np.array([r.address for r in regions], np.uint64)
    sizes = np.array([r.slot_bytes for r in regions], np.uint64)[of]
    addresses = off + bases[of]
    low = min(r.address for r in regions)
    hull = (low, max(r.address + r.size for r in regions) - low)
    if n_keys > 1:  # across regions: sorted by address, each slot ends before the next begins
        order = np.argsort(addresses, kind="stable")
        clash = addresses[order[1:]] < addresses[order[:-1]] + sizes[order[:-1]]
        if clash.any():
            k = int(np.argmax(clash))
            j, other = int(order[k + 1]), int(order[k])
            first = [0, *np.cumsum(counts).tolist()]
            raise InvalidArgument(f"{prefix}{field(int(of[j]))}: CallerMemory.slot_offsets"
                                  f"[{j - first[int(of[j])]}] = {int(off[j])} overlaps a slot of "
                                  f"{field(int(of[other]))} (slot_offsets[{other - first[int(of[other])]}])")
    return Scatter(off, addresses, sizes, hull)


def gather(pid: int, pages: pb.CallerPages, layout: PageLayout, namespace: str,
           buffer_for: Callable[[int], memoryview | None] | None = None) -> list[memoryview]:
    """The page blobs of the blocks ``pages`` names in process ``pid``'s slots, each built in a buffer of
    ``buffer_for`` (the store's fastest tier lends the one it then keeps; else a bytearray): header and
    key written here, the block bytes read into it from the slot (one copy, ``cma.MAX_IOV`` slots a
    system call), the checksum computed over what was read. InvalidArgument, before any byte is
    read, for slots outside the region, a group the layout lacks, a block longer than its slot or
    a malformed hash; cma.CrossMemoryError where the kernel refuses the read."""
    region, n = pages.region, len(pages.groups)
    if len(pages.block_hashes) != n:
        raise InvalidArgument(f"CallerPages names {n} groups and {len(pages.block_hashes)} block hashes: one each")
    offsets = check(region.slot_offsets, region.slot_bytes, region.size, n)
    bufs: list[memoryview] = []
    pieces = np.empty((n, 2), np.uint64)
    for i, (group, block_hash) in enumerate(zip(pages.groups, pages.block_hashes)):
        g = layout.group(group)
        if g is None:
            raise InvalidArgument(f"CallerPages.groups[{i}] = {group}: layout {layout.layout_hex} has no such group")
        if g.block_bytes > region.slot_bytes:
            raise InvalidArgument(f"CallerPages.groups[{i}]: group {group}'s blocks are {g.block_bytes} bytes; "
                                  f"CallerMemory.slot_bytes is {region.slot_bytes}")
        if not 0 < len(block_hash) <= page.MAX_HASH_BYTES:
            raise InvalidArgument(f"CallerPages.block_hashes[{i}] is {len(block_hash)} bytes, not 1-64")
        size = page.blob_bytes(g, len(block_hash))
        lent = buffer_for(size) if buffer_for is not None else None
        buf = lent if lent is not None else memoryview(bytearray(size))
        key = page.page_key(layout.layout_id, namespace, group, bytes(block_hash))
        at = page.write_header(layout, group, bytes(block_hash), key, buf)
        pieces[i] = (cma.address_of(buf) + at, g.block_bytes)
        bufs.append(buf)
    cma.read(pid, pieces, region.address, region.size, offsets)
    for buf in bufs:
        page.seal(buf)
    return [b.toreadonly() for b in bufs]
