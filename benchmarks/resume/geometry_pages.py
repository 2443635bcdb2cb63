"""An engine page session at the real geometry for the turn-save benchmark (issue 30): a page layout of
DeepSeek-V4.1's shape, built by hand (``tests/helpers/pages.py``'s ``v41_layout``: group 0, layers 2/8/14
at 128 states per 256-token block, and group 1, layer 20 at 256; 227,840 bytes of pages per 256 tokens,
about a token chunk's; what vLLM's own planner lays out, and the tier under vLLM's stack, are measured by
benchmarks/vllm_tier/), saved the way vLLM's tier saves it: ``PageSessions.save`` with ``Client.save_pages`` reading
each block from its slot of the engine's CPU region (on the daemon's host the daemon reads the slots
itself), one turn per 2,048 tokens (8 blocks of each group, 16 pages), the session growing block by
block.

``PageGrower.prepare`` makes a session's next turn: its save, and the raw floor of the same bytes (the
turn's 16 blocks under their page keys, for one raw LMDB put with an fsync'd commit:
geometry_raw.RawLmdb).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from benchmarks.resume.geometry_session import TURN_TOKENS
from kvstore.client import Client
from kvstore.client.calls import SavedSession
from kvstore.engines.pages.sessions import PageSessions, Tenant, block_key
from kvstore.format.manifest import Manifest, Retention
from kvstore.format.turn_record import Append
from tests.helpers.pages import v41_layout

NS = "geometry-pages"
BLOCK_TOKENS = 256
POOL_TURNS = 4  # distinct random turns' worth of block bytes, cycled (FP4 codes: incompressible bytes)

RawItems = list[tuple[bytes, memoryview]]


def block_bytes_per_token_block() -> int:
    return sum(g.block_bytes for g in v41_layout().groups)


class PageGrower:
    """Engine page sessions of one tenant, grown a turn at a time through one client, the blocks read
    from slots of one CPU region (the engine's) as vLLM's tier reads them (vllm/transfer.py)."""

    def __init__(self, client: Client, seed: int = 7) -> None:
        self.client = client
        self.layout = v41_layout()
        self.groups = self.layout.groups
        self.stride = max(g.block_bytes for g in self.groups)
        self.per = TURN_TOKENS // BLOCK_TOKENS  # blocks of each group per turn
        self.slots = self.per * len(self.groups)
        rng = np.random.default_rng(seed)
        self.region = rng.integers(0, 256, (POOL_TURNS * self.slots) * self.stride, np.uint8)
        self.tenant = Tenant(NS)
        self.sessions = PageSessions(self.layout, self.tenant, Retention())
        self.turns: dict[str, int] = {}  # session id -> turns saved
        client.register_layout(self.layout.definition(), NS)

    def prepare(self, session_id: str) -> tuple[Callable[[], float], RawItems]:
        """``session_id``'s next turn (blocks numbered on from its last): a call that saves it and says in
        how many seconds, and the raw floor's items (the same bytes under the same keys)."""
        turn = self.turns.get(session_id, 0)
        s = self.sessions.session(self.tenant, session_id)
        base = (turn % POOL_TURNS) * self.slots
        blocks = [(g.group, b) for b in range(turn * self.per, (turn + 1) * self.per) for g in self.groups]
        # the engine's block hashes: distinct per session, block and group
        tag = session_id.encode()[:8].ljust(8, b"\0")
        hashes = [tag + b.to_bytes(4, "big") + g.to_bytes(4, "big") for g, b in blocks]
        gids = [g for g, _ in blocks]
        offsets = [(base + i) * self.stride for i in range(self.slots)]
        pkeys = [block_key(self.layout, self.tenant, g, h) for g, h in zip(gids, hashes)]
        ends: list[int | None] = [(b + 1) * BLOCK_TOKENS for _, b in blocks]
        send = self._sender(offsets, gids, hashes)

        def save() -> float:
            t = time.perf_counter()
            self.sessions.save(self.client, s, pkeys, list(range(self.slots)), ends, send)
            seconds = time.perf_counter() - t
            self.turns[session_id] = turn + 1
            return seconds

        items = [(k, self.region.data[o : o + self.layout.group(g).block_bytes])  # type: ignore[union-attr]
                 for k, o, g in zip(pkeys, offsets, gids)]
        return save, items

    def _sender(self, offsets: list[int], gids: list[int], hashes: list[bytes]
                ) -> Callable[[Manifest | Append, list[int], int], SavedSession]:
        """``PageSessions.save``'s ``send`` as vLLM's tier makes it: the fresh blocks read from their
        slots of the region by ``Client.save_pages``."""
        def send(m: Manifest | Append, fresh: list[int], base: int) -> SavedSession:
            return self.client.save_pages(m, self.layout, self.region, [offsets[i] for i in fresh], self.stride,
                                          [gids[i] for i in fresh], [hashes[i] for i in fresh], base)

        return send

    def check(self, session_id: str) -> None:
        """The daemon's version of the session names every page saved (RuntimeError if not)."""
        m, _ = self.client.get_session(NS, session_id)
        want = self.turns.get(session_id, 0) * self.slots
        if len(m.chunk_keys) != want:
            raise RuntimeError(f"page session {session_id!r} names {len(m.chunk_keys)} pages, not {want}")
