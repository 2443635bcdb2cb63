"""The daemon's side of the same-GPU handoff: client device buffers opened through CUDA IPC, and
loads that copy a session's chunks into them device to device (kvstore/cuda/ipc.py says why the
client exports and the daemon opens, never the other way round).

A buffer is opened once, at attach, and belongs to the token that attached it: any other token
naming its id gets the same answer as for an unknown id. Each token keeps at most
``MAX_PER_OWNER`` buffers open (attaching one more closes its oldest), so a client that dies
without detaching pins a bounded amount of its GPU's memory. A load copies the chunks the HBM
tier holds device to device, under that tier's lock (they cannot be freed mid-copy); chunks held
only by slower tiers are read through the host path (a batch read verified as any load) and uploaded. The
HBM copies are not re-verified: they were checked on the way in, and HBM is not where bit rot
lives. Nothing here imports torch until a daemon with an HBM tier is asked to attach.
"""

from __future__ import annotations

import secrets
import threading
from typing import TYPE_CHECKING, Any

from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.tiers.hbm.alloc import packed_offsets
from kvstore.transport import convert
from kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    from kvstore.store import SessionStore

MAX_PER_OWNER = 2


class DeviceArenas:
    def __init__(self, sessions: SessionStore) -> None:
        self._sessions = sessions
        self._lock = threading.Lock()
        self._buffers: dict[str, tuple[str, Any]] = {}  # buffer id -> (owner, uint8 device tensor), oldest first

    def _hbm(self) -> Any:
        """The store's HBM tier (the one with ``copy_to``), or None."""
        return self._sessions.store.hbm_tier()

    def __len__(self) -> int:
        with self._lock:
            return len(self._buffers)

    def attach(self, owner: str, request: pb.AttachDeviceBufferRequest) -> str:
        hbm = self._hbm()
        if hbm is None:
            raise FailedPrecondition("this daemon has no HBM tier: load through the host path")
        from kvstore.cuda.ipc import IpcHandle, IpcUnavailable, gpu_uuid, open_handle

        b = request.buffer
        mine = gpu_uuid(hbm.device)
        if b.gpu_uuid != mine:
            raise FailedPrecondition(f"the buffer is on GPU {b.gpu_uuid or '?'}, this daemon's HBM tier on {mine}: "
                                     "load through the host path")
        handle = IpcHandle(b.gpu_uuid, bytes(b.handle), b.storage_bytes, b.storage_offset, bytes(b.ref_counter_handle),
                           b.ref_counter_offset, bytes(b.event_handle), b.event_sync_required, b.size)
        try:
            tensor = open_handle(handle)
        except IpcUnavailable as e:
            raise FailedPrecondition(f"{e}: load through the host path") from e
        return self.add_opened(owner, tensor)

    def add_opened(self, owner: str, tensor: Any) -> str:
        """Register an opened buffer (a uint8 tensor on the HBM tier's device) for ``owner``."""
        buffer_id = secrets.token_hex(16)
        with self._lock:
            held = [i for i, (o, _) in self._buffers.items() if o == owner]
            for old in held[: max(0, len(held) - MAX_PER_OWNER + 1)]:
                del self._buffers[old]  # closes the mapping once no load still uses it
            self._buffers[buffer_id] = (owner, tensor)
        return buffer_id

    def detach(self, owner: str, buffer_id: str) -> bool:
        with self._lock:
            entry = self._buffers.get(buffer_id)
            if entry is None or entry[0] != owner:
                return False
            del self._buffers[buffer_id]
            return True

    def load(self, owner: str, namespace: str, session_id: str, buffer_id: str) -> pb.LoadSessionToDeviceResponse:
        """Copy the session's chunks into ``owner``'s buffer ``buffer_id``; blocking (a worker thread)."""
        with self._lock:
            entry = self._buffers.get(buffer_id)
        if entry is None or entry[0] != owner:
            raise InvalidArgument(f"unknown device buffer {buffer_id!r}: attach again")
        dst, hbm = entry[1], self._hbm()
        m = self._sessions.get(namespace, session_id)  # the namespace's own manifest: chunks it owns
        keys = list(m.chunk_keys)
        store = self._sessions.store
        store.pin(keys)
        try:
            sizes: list[int | None] = [hbm.size_of(k) for k in keys]
            blobs = self._read_host(namespace, keys, [i for i, s in enumerate(sizes) if s is None])
            for i, blob in blobs.items():
                sizes[i] = len(blob)
            present = [i for i, s in enumerate(sizes) if s is not None]
            offsets, span = packed_offsets([sizes[i] or 0 for i in present])
            if span > dst.numel():
                return pb.LoadSessionToDeviceResponse(session=convert.session_to_pb(m), needed_bytes=span)
            at = dict(zip(present, offsets))
            on_device = [i for i in present if i not in blobs]
            held = hbm.copy_to([keys[i] for i in on_device], dst, [at[i] for i in on_device])
            lost = [i for i, h in zip(on_device, held) if not h]  # left the HBM tier since size_of
            again = self._read_host(namespace, keys, lost)
            blobs.update((i, b) for i, b in again.items() if len(b) == sizes[i])
            _upload(dst, [(at[i], b) for i, b in blobs.items()])
        finally:
            store.unpin(keys)
        chunks = [pb.DeviceChunk(index=i, offset=at[i], size=sizes[i]) for i in present
                  if i in blobs or i not in lost]
        return pb.LoadSessionToDeviceResponse(session=convert.session_to_pb(m), chunks=chunks,
                                              device_chunks=len(on_device) - len(lost))

    def _read_host(self, namespace: str, keys: list[bytes], which: list[int]) -> dict[int, Any]:
        """Chunks ``which`` (indices into ``keys``) read and verified as every load is (one batch read:
        ``SessionStore.read``), copied out of the tiers for the upload."""
        if not which:
            return {}
        with self._sessions.read(namespace, [keys[i] for i in which]) as got:
            return {i: bytes(blob) for i, blob in zip(which, got) if blob is not None}


def _upload(dst: Any, pieces: list[tuple[int, Any]]) -> None:
    """Host blobs into the device buffer at their offsets, done when this returns."""
    if not pieces:
        return
    import torch

    for at, blob in pieces:  # a plain (synchronous) copy per chunk: these are the exceptions
        dst[at:at + len(blob)].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    if dst.device.type == "cuda":
        torch.cuda.synchronize(dst.device)
