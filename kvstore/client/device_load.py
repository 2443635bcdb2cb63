"""The client's side of the same-GPU handoff: a session's chunks loaded straight into device memory.

Negotiated once per client and device: when the daemon runs on this host (ServerInfo.host_id) with
an HBM tier, the client allocates a device buffer, exports it through CUDA IPC (ipc.py) and
attaches it; the daemon checks it is on its HBM tier's GPU (by UUID) and opens it. From then on a
load is one RPC: the daemon copies the chunks device to device into the buffer and answers their
offsets. When any step is not possible (no CUDA, another host or GPU, IPC refused, e.g. under a
sandbox) the loader remembers why (``reason``) and loads through the host path: the ordinary
``load_session``, then one upload from a pinned buffer.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

from kvstore.cuda.ipc import DeviceBuffer, IpcUnavailable
from kvstore.errors import FailedPrecondition, InvalidArgument, KvstoreError
from kvstore.format.manifest import Manifest
from kvstore.transport import convert, shm
from kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    import torch

    from kvstore.client import Client

IPC, HOST = "ipc", "host"
MIN_BUFFER_BYTES = 64 << 20


class DeviceLoader:
    """``load(namespace, session_id)`` -> (manifest, [(chunk index, uint8 device tensor)]).

    The tensors are views of one buffer this loader reuses: valid until its next load (clone what
    you keep). A load waits for the device's current stream first, so kernels still reading the
    previous load's views finish before the daemon overwrites them."""

    def __init__(self, client: Client, device: torch.device) -> None:
        self._client = client
        self.device = device
        self.path = ""  # IPC or HOST once negotiated
        self.reason = ""  # why HOST, when it is
        self._buffer: DeviceBuffer | None = None
        self._buffer_id = ""
        self._lock = threading.Lock()

    def load(self, namespace: str, session_id: str) -> tuple[Manifest, list[tuple[int, torch.Tensor]]]:
        import torch

        with self._lock:
            if not self.path:
                self._negotiate()
            if self.path == IPC:
                torch.cuda.current_stream(self.device).synchronize()
                try:
                    return self._load_ipc(namespace, session_id)
                except FailedPrecondition as e:  # e.g. the daemon restarted without an HBM tier
                    self._fall_back(str(e))
            return self._load_host(namespace, session_id)

    def _negotiate(self) -> None:
        import torch

        info = self._client.info()
        if not torch.cuda.is_available() or self.device.type != "cuda":
            self._fall_back("no CUDA device here")
        elif info.host_id != shm.host_id():
            self._fall_back("the daemon runs on another host")
        elif "hbm" not in info.tiers:
            self._fall_back("the daemon has no HBM tier")
        else:
            try:
                self._attach(MIN_BUFFER_BYTES)
                self.path = IPC
            except (IpcUnavailable, KvstoreError) as e:
                self._fall_back(str(e))

    def _fall_back(self, reason: str) -> None:
        self.path, self.reason = HOST, reason
        self._buffer, self._buffer_id = None, ""

    def _attach(self, size: int) -> None:
        self._detach()
        buf = DeviceBuffer(self.device, size)
        h = buf.export()
        handle = pb.DeviceBufferHandle(
            gpu_uuid=h.gpu_uuid, handle=h.handle, storage_bytes=h.storage_bytes, storage_offset=h.storage_offset,
            ref_counter_handle=h.ref_counter_handle, ref_counter_offset=h.ref_counter_offset,
            event_handle=h.event_handle, event_sync_required=h.event_sync_required, size=h.size)
        r = self._client._call(self._client._stub.AttachDeviceBuffer, pb.AttachDeviceBufferRequest(buffer=handle))
        self._buffer, self._buffer_id = buf, r.buffer_id

    def _detach(self) -> None:
        if self._buffer_id:  # best effort: the daemon closes our oldest buffer when we attach more anyway
            with contextlib.suppress(KvstoreError):
                self._client._call(self._client._stub.DetachDeviceBuffer,
                                   pb.DetachArenaRequest(arena_id=self._buffer_id))
        self._buffer, self._buffer_id = None, ""

    def _load_ipc(self, namespace: str, session_id: str) -> tuple[Manifest, list[tuple[int, torch.Tensor]]]:
        for _ in range(3):
            req = pb.LoadSessionToDeviceRequest(namespace=namespace, session_id=session_id, buffer_id=self._buffer_id)
            try:
                r = self._client._call(self._client._stub.LoadSessionToDevice, req)
            except InvalidArgument:  # the daemon forgot the buffer (restarted): attach it again
                self._attach(self._buffer.size if self._buffer else MIN_BUFFER_BYTES)
                continue
            if r.needed_bytes:
                self._attach(max(r.needed_bytes, 2 * (self._buffer.size if self._buffer else 0)))
                continue
            assert self._buffer is not None
            t = self._buffer.tensor
            return convert.session_from_pb(r.session), [(c.index, t[c.offset:c.offset + c.size]) for c in r.chunks]
        raise KvstoreError("LoadSessionToDevice did not settle on a buffer after 3 attaches")

    def _load_host(self, namespace: str, session_id: str) -> tuple[Manifest, list[tuple[int, torch.Tensor]]]:
        """The ordinary load, then one upload of all its chunks from a pinned buffer."""
        import torch

        manifest, pairs = self._client.load_session(namespace, session_id)
        got = [(i, memoryview(b)) for i, b in pairs]
        total = sum(len(b) for _, b in got)
        pinned = torch.empty(total, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        arr, at, spans = pinned.numpy(), 0, []
        for i, b in got:
            arr[at:at + len(b)] = memoryview(b).cast("B")
            spans.append((i, at, len(b)))
            at += len(b)
        dev = pinned.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the pinned buffer may be reused after
        return manifest, [(i, dev[a:a + n]) for i, a, n in spans]

    def close(self) -> None:
        with self._lock:
            self._detach()


def loader_for(client: Any, device: torch.device | str | int | None) -> DeviceLoader:
    """The client's loader for ``device`` (default: the current CUDA device), made once."""
    import torch

    dev = torch.device(device if device is not None else "cuda")
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    loaders: dict[torch.device, DeviceLoader] = client._device_loaders  # closed by Client.close
    if dev not in loaders:
        loaders[dev] = DeviceLoader(client, dev)
    return loaders[dev]
