"""An engine page session at the real geometry for the turn-save benchmark (issue 30): DeepSeek-V4.1's
vLLM page layout (``tests/helpers/pages.py``'s ``v41_layout``: group 0, layers 2/8/14 at 128 states per
256-token block, and group 1, layer 20 at 256; 227,840 bytes of pages per 256 tokens, about a token
chunk's), saved the way vLLM's tier saves it: ``PageSessions.save`` with ``Client.save_pages`` reading
each block from its slot of the engine's CPU region (on the daemon's host the daemon reads the slots
itself), one turn per 2,048 tokens (8 blocks of each group, 16 pages), the session growing block by
block to the size measured.

Beside each turn, the raw floor of the same bytes: the turn's 16 blocks put into a raw LMDB
environment (geometry_raw.RawLmdb) under their page keys, one fsync'd commit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.resume.geometry_raw import RawLmdb
from benchmarks.resume.geometry_session import TURN_TOKENS
from kvstore.client import Client
from kvstore.client.calls import SavedSession
from kvstore.engines.pages.sessions import PageSessions, Tenant, block_key
from kvstore.format.manifest import Manifest, Retention
from kvstore.format.page_layout import PageLayout
from kvstore.format.turn_record import Append
from kvstore.server.process import DaemonProcess
from tests.helpers.pages import v41_layout

NS, SID = "geometry-pages", "engine-request"
BLOCK_TOKENS = 256
POOL_TURNS = 4  # distinct random turns' worth of block bytes, cycled (FP4 codes: incompressible bytes)


def block_bytes_per_token_block() -> int:
    return sum(g.block_bytes for g in v41_layout().groups)


def _sender(client: Client, layout: PageLayout, region: np.ndarray, stride: int, offsets: list[int],
            gids: list[int], hashes: list[bytes]) -> Callable[[Manifest | Append, list[int], int], SavedSession]:
    """``PageSessions.save``'s ``send`` as vLLM's tier makes it (vllm/transfer.py): the fresh blocks
    read from their slots of ``region`` by ``Client.save_pages``."""
    def send(m: Manifest | Append, fresh: list[int], base: int) -> SavedSession:
        return client.save_pages(m, layout, region, [offsets[i] for i in fresh], stride, [gids[i] for i in fresh],
                                 [hashes[i] for i in fresh], base)

    return send


def run_pages(tokens: int, work: Path) -> tuple[list[float], list[float]]:
    """A page session grown to ``tokens`` tokens, turn by turn: (turn save seconds, raw put seconds)."""
    layout = v41_layout()
    groups = layout.groups
    stride = max(g.block_bytes for g in groups)
    per = TURN_TOKENS // BLOCK_TOKENS  # blocks of each group per turn
    slots = per * len(groups)
    rng = np.random.default_rng(7)
    region = rng.integers(0, 256, (POOL_TURNS * slots) * stride, np.uint8)  # the engine's CPU region of slots
    tenant = Tenant(NS)
    sessions = PageSessions(layout, tenant, Retention())
    raw = RawLmdb(work / "raw-pages")
    d = DaemonProcess(work / "daemon-pages").start()
    saves: list[float] = []
    puts: list[float] = []
    try:
        client = Client(d.address)
        client.register_layout(layout.definition(), NS)
        s = sessions.session(tenant, SID)
        for turn in range(tokens // TURN_TOKENS):
            base = (turn % POOL_TURNS) * slots
            blocks = [(g.group, b) for b in range(turn * per, (turn + 1) * per) for g in groups]
            hashes = [b.to_bytes(8, "big") + g.to_bytes(8, "big") for g, b in blocks]  # the engine's block hashes
            gids = [g for g, _ in blocks]
            offsets = [(base + i) * stride for i in range(slots)]
            pkeys = [block_key(layout, tenant, g, h) for g, h in zip(gids, hashes)]
            ends: list[int | None] = [(b + 1) * BLOCK_TOKENS for _, b in blocks]

            t = time.perf_counter()
            sessions.save(client, s, pkeys, list(range(slots)), ends, _sender(client, layout, region, stride,
                                                                             offsets, gids, hashes))
            saves.append(time.perf_counter() - t)
            items = [(k, region.data[o : o + layout.group(g).block_bytes])  # type: ignore[union-attr]
                     for k, o, g in zip(pkeys, offsets, gids)]
            puts.append(raw.put_turn(items))
        m, _ = client.get_session(NS, SID)
        if len(m.chunk_keys) != tokens // BLOCK_TOKENS * len(groups):
            raise RuntimeError(f"the page session names {len(m.chunk_keys)} pages, not "
                               f"{tokens // BLOCK_TOKENS * len(groups)}")
        client.close()
    finally:
        d.stop()
        raw.close()
    return saves, puts
