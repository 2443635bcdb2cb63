"""A real daemon with ``--ssd-compact-records`` stores page blobs as record flag 3 (their scale rows
gathered by the registered layout and compressed with the tail): a page session saved, the daemon
restarted with no host tier (every load from the ssd tier), loads bit-exact, in fewer bytes than
flag 1 (``--ssd-zstd-level 1``) keeps; and the store reopened with compact records off still serves it."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.transport import shm
from tests.helpers.daemon import start_daemon
from tests.helpers.pages import save_page_session, scaled_block, v41_layout

pytestmark = pytest.mark.skipif(shm.default_shm_dir() is None, reason="no writable /dev/shm on this host")

LAYOUT = v41_layout()
STRIDE = 140000


def blocks(n: int) -> list[bytes]:
    """Random codes, scale bytes in a narrow range (as E4M3 scales of one tensor are)."""
    return [scaled_block(LAYOUT, i % 2, i) for i in range(n)]


def _save_restart_load(data: Path, flags: tuple[str, ...], n: int = 6) -> int:
    ns = f"p-{uuid.uuid4().hex[:12]}"
    blks = blocks(n)
    d = start_daemon(data, *flags)
    try:
        keys, _ = save_page_session(d.address, LAYOUT, ns, blks)
    finally:
        assert d.stop() == 0
    used = 0
    for reopen in (flags, ("--ssd-zstd-level", "0")):  # then with compact records off
        d = start_daemon(data, "--host-capacity-bytes", "0", *reopen)
        try:
            with Client(address=d.address) as c:
                out = np.full(n * STRIDE, 0xAA, np.uint8)
                offsets = [i * STRIDE for i in range(n)]
                placed = c.load_pages_into(ns, keys, out, offsets, STRIDE)
                assert [i for i, _ in placed] == list(range(n))
                for off, b in zip(offsets, blks):
                    assert out[off : off + len(b)].tobytes() == b
                ssd = next(t for t in c.stats().tiers if t.name == "ssd")
                assert ssd.verify_failures == 0
                used = used or ssd.used_bytes
        finally:
            d.stop()
    return used


def test_compact_records_load_bit_exact_after_a_restart_and_keep_fewer_bytes(tmp_path: Path) -> None:
    compact = _save_restart_load(tmp_path / "compact", ("--ssd-compact-records",))
    flag1 = _save_restart_load(tmp_path / "flag1", ("--ssd-zstd-level", "1"))
    assert 0 < compact < flag1
