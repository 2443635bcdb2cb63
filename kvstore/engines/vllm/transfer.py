"""The tier's data movement between the CPU primary tier's slots and the daemon, on the job threads:
a store job's blocks read from their slots by the daemon and saved in one turn, a load job's verified
blocks written into their slots by the daemon (kvstore/transport/slots.py); where the daemon cannot
reach this process, through the client's arena or the stream."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.v1.kv_offload.base import OffloadKey, get_offload_block_hash, get_offload_group_idx

from kvstore.engines.pages.sessions import PageSession, block_key
from kvstore.format import page

if TYPE_CHECKING:
    from kvstore.client.calls import SavedSession
    from kvstore.engines.pages.daemon import DaemonLink
    from kvstore.engines.vllm.sessions import Sessions
    from kvstore.format.manifest import Manifest
    from kvstore.format.page_layout import GroupSpec, PageLayout
    from kvstore.format.turn_record import Append

log = logging.getLogger("kvstore.engines.vllm.tier")


class Transfer:
    """Copies between the CPU primary tier's slots (``stride`` bytes each in ``primary``) and the daemon."""

    def __init__(self, layout: PageLayout, primary: memoryview, stride: int, daemon: DaemonLink,
                 sessions: Sessions) -> None:
        self.layout = layout
        self.stride = stride
        self._flat = primary.cast("B") if primary.ndim != 1 or primary.format != "B" else primary
        self._daemon = daemon
        self._sessions = sessions

    def group(self, key: OffloadKey) -> GroupSpec:
        g = self.layout.group(get_offload_group_idx(key))
        if g is None:
            raise page.PageError(f"vLLM offloads group {get_offload_group_idx(key)}, which this layout lacks")
        return g

    def store(self, s: PageSession | None, keys: list[OffloadKey], cids: list[int], ends: list[int | None]
              ) -> tuple[bool, None]:
        """The job's blocks saved as one turn of the request's page session (``Client.save_pages``: on
        the daemon's host the daemon reads each block from its primary slot itself and builds the page
        blob around it, one copy; elsewhere the blobs are encoded here and sent)."""
        if s is None or not self._daemon.available():
            return False, None
        client = self._daemon.client(s.tenant, "store")

        def send(m: Manifest | Append, fresh: list[int], base: int) -> SavedSession:
            return client.save_pages(m, self.layout, self._flat, [cids[i] * self.stride for i in fresh], self.stride,
                                     [get_offload_group_idx(keys[i]) for i in fresh],
                                     [get_offload_block_hash(keys[i]) for i in fresh], base)

        self._sessions.save(client, s, [self.key(s, k) for k in keys], list(range(len(keys))), ends, send)
        return True, None

    def key(self, s: PageSession, key: OffloadKey) -> bytes:
        return block_key(self.layout, s.tenant, get_offload_group_idx(key), get_offload_block_hash(key))

    def load(self, s: PageSession | None, keys: list[OffloadKey], cids: list[int]
             ) -> tuple[bool, list[OffloadKey]]:
        """The job's blocks written into their slots by the daemon itself, one call for the job
        (``Client.load_pages_into``: each verified page blob's payload straight from the daemon's tier
        into the primary's shared memory, one copy); where the daemon cannot write into this process,
        through the arena and copied in by the client. A block missing or refused leaves its slot as it
        was and is not among the keys done."""
        if s is None or not self._daemon.available():
            return False, []
        client = self._daemon.client(s.tenant, "load")
        pkeys = [self.key(s, k) for k in keys]
        placed = client.load_pages_into(s.tenant.namespace, pkeys, self._flat, [c * self.stride for c in cids],
                                        self.stride)
        loaded: set[int] = set()
        for i, block in placed:  # the key names the layout and group: a verified blob is the group's size
            if len(block) == self.group(keys[i]).block_bytes:
                loaded.add(i)
            else:
                log.warning("kvstore tier: block %s is %d bytes, not its group's %d: a miss", pkeys[i].hex(),
                            len(block), self.group(keys[i]).block_bytes)
        if len(loaded) < len(keys):
            log.debug("kvstore tier: %d of %d blocks loaded", len(loaded), len(keys))
        done = [k for i, k in enumerate(keys) if i in loaded]
        return len(loaded) == len(keys), done
