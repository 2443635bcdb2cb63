"""The tier's data movement: a store job's primary slots encoded into page blobs and saved in one
turn; a load job's verified blocks written into the primary's slots by the daemon (scatter loads:
kvstore/transport/slots.py). Runs on the job threads."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import numpy as np
from vllm.v1.kv_offload.base import OffloadKey, get_offload_block_hash, get_offload_group_idx

from kvstore.engines.vllm.sessions import PageSession, Sessions, block_key
from kvstore.format import page

if TYPE_CHECKING:
    from kvstore.engines.vllm.daemon import DaemonLink
    from kvstore.format.page_layout import GroupSpec, PageLayout

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
        self._local = threading.local()  # each store thread's encode buffer

    def group(self, key: OffloadKey) -> GroupSpec:
        g = self.layout.group(get_offload_group_idx(key))
        if g is None:
            raise page.PageError(f"vLLM offloads group {get_offload_group_idx(key)}, which this layout lacks")
        return g

    def _slot(self, cid: int, key: OffloadKey) -> memoryview:
        """The bytes of the primary's slot ``cid`` that are ``key``'s group's (geometry.py)."""
        start = cid * self.stride
        return self._flat[start : start + self.group(key).block_bytes]

    def store(self, s: PageSession | None, keys: list[OffloadKey], cids: list[int], ends: list[int | None]
              ) -> tuple[bool, None]:
        if s is None or not self._daemon.available():
            return False, None
        client = self._daemon.client(s.tenant, "store")
        for batch in self._batches(keys):  # a turn save per arena's worth (a long prefill's step is more)
            bkeys = [keys[i] for i in batch]
            pkeys = [self.key(s, k) for k in bkeys]
            self._sessions.save(client, s, pkeys, self._encode(bkeys, pkeys, [cids[i] for i in batch]),
                                [ends[i] for i in batch])
        return True, None

    def key(self, s: PageSession, key: OffloadKey) -> bytes:
        return block_key(self.layout, s.tenant, get_offload_group_idx(key), get_offload_block_hash(key))

    def _encode(self, keys: list[OffloadKey], pkeys: list[bytes], cids: list[int]) -> list[memoryview]:
        """The job's page blobs, encoded into one buffer this thread reuses (a fresh buffer per blob
        would fault in every page; the arena copy that follows reads them while they are warm)."""
        sizes = [page.blob_bytes(self.group(k), len(get_offload_block_hash(k))) for k in keys]
        buf: bytearray | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < sum(sizes):
            buf = self._local.buf = bytearray(sum(sizes))
        view, at, out = memoryview(buf), 0, []
        for k, pk, cid, n in zip(keys, pkeys, cids, sizes):
            dest = view[at : at + n]
            page.encode_into(self.layout, get_offload_group_idx(k), get_offload_block_hash(k), pk,
                             np.frombuffer(self._slot(cid, k), dtype=np.uint8), dest)
            out.append(dest)
            at += n
        return out

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

    def _batches(self, keys: list[OffloadKey]) -> list[list[int]]:
        """The job's keys cut into runs whose blobs fit one arena (one batch each, when it is larger)."""
        out: list[list[int]] = [[]]
        room = self._daemon.arena_bytes
        for i, k in enumerate(keys):
            n = page.blob_bytes(self.group(k), len(get_offload_block_hash(k)))
            if out[-1] and n > room:
                out.append([])
                room = self._daemon.arena_bytes
            out[-1].append(i)
            room -= n
        return out
