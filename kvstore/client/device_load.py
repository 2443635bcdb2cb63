"""The client's side of the same-GPU handoff: a session's chunks loaded straight into device memory.

Negotiated once per client and device: when the daemon runs on this host (ServerInfo.host_id) with
an HBM tier, the client allocates a device buffer, exports it through CUDA IPC (ipc.py) and
attaches it; the daemon checks it is on its HBM tier's GPU (by UUID) and opens it. From then on a
load is one RPC: the daemon copies the chunks device to device into the buffer and answers their
offsets. When any step is not possible (no CUDA, another host or GPU, IPC refused, e.g. under a
sandbox) the loader remembers why (``reason``) and loads through the host path: the ordinary
``load_session``, then one upload from a pinned buffer.

The loader drives a client through the public calls named in ``DeviceClient`` (``Client`` is one, and
holds one loader per device: ``Client.device_loader``); this module imports no client.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from kvstore.cuda.ipc import DeviceBuffer, IpcUnavailable
from kvstore.errors import FailedPrecondition, InvalidArgument, KvstoreError
from kvstore.format.manifest import Manifest
from kvstore.transport import convert, shm
from kvstore.transport.framing import Blob
from kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    import torch

IPC, HOST = "ipc", "host"
MIN_BUFFER_BYTES = 64 << 20


class DeviceClient(Protocol):
    """What a loader needs of a client (``kvstore.client.Client``'s methods of these names)."""

    def info(self) -> pb.ServerInfo: ...

    def load_session(self, namespace: str, session_id: str, zero_copy: bool = False
                     ) -> tuple[Manifest, Iterator[tuple[int, Blob]]]: ...

    def attach_device_buffer(self, handle: pb.DeviceBufferHandle) -> str: ...

    def detach_device_buffer(self, buffer_id: str) -> None: ...

    def load_session_into_device_buffer(self, namespace: str, session_id: str, buffer_id: str
                                        ) -> pb.LoadSessionToDeviceResponse: ...


def device_of(device: torch.device | str | int | None) -> torch.device:
    """``device`` as a torch.device (default: the current CUDA device), with its index where CUDA has one."""
    import torch

    dev = torch.device(device if device is not None else "cuda")
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class DeviceLoader:
    """``load(namespace, session_id)`` -> (manifest, [(chunk index, uint8 device tensor)]).

    The tensors are views of one buffer this loader reuses: valid until its next load (clone what
    you keep). A load waits for the device's current stream first, so kernels still reading the
    previous load's views finish before the daemon overwrites them."""

    def __init__(self, client: DeviceClient, device: torch.device) -> None:
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
        self._buffer, self._buffer_id = buf, self._client.attach_device_buffer(handle)

    def _detach(self) -> None:
        if self._buffer_id:  # best effort: the daemon closes our oldest buffer when we attach more anyway
            with contextlib.suppress(KvstoreError):
                self._client.detach_device_buffer(self._buffer_id)
        self._buffer, self._buffer_id = None, ""

    def _load_ipc(self, namespace: str, session_id: str) -> tuple[Manifest, list[tuple[int, torch.Tensor]]]:
        for _ in range(3):
            try:
                r = self._client.load_session_into_device_buffer(namespace, session_id, self._buffer_id)
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
