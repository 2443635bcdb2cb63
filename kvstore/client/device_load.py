"""The client's side of the same-GPU handoff: a session's chunks loaded straight into device memory.

Negotiated once per client and device: when the daemon runs on this host (ServerInfo.host_id) with
an HBM tier, the client allocates a device buffer, exports it through CUDA IPC (ipc.py) and
attaches it; the daemon checks it is on its HBM tier's GPU (by UUID) and opens it. From then on a
load is one RPC: the daemon copies the chunks device to device into the buffer and answers their
offsets. When any step is not possible (no CUDA, another host or GPU, IPC refused, e.g. under a
sandbox) the loader remembers why (``reason``) and loads through the host path: ``load_session_into``
one page-locked host buffer the loader keeps (kvstore/cuda/pinned.py: on the daemon's host the daemon
writes the chunks there itself, one copy from its tier), then one upload of all of it into a device
buffer the loader also keeps. Both buffers grow when a session needs more, sized from its manifest.

The loader drives a client through the public calls named in ``DeviceClient`` (``Client`` is one, and
holds one loader per device: ``Client.device_loader``); this module imports no client.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Protocol

from kvstore.cuda.ipc import DeviceBuffer, IpcUnavailable
from kvstore.cuda.pinned import HostBuffer
from kvstore.errors import FailedPrecondition, InvalidArgument, KvstoreError, ResourceExhausted
from kvstore.format import chunk
from kvstore.format.layout import layout_by_id
from kvstore.format.manifest import Manifest
from kvstore.transport import convert, shm
from kvstore.transport.cma import address_of
from kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    import torch

IPC, HOST = "ipc", "host"
MIN_BUFFER_BYTES = 64 << 20


class DeviceClient(Protocol):
    """What a loader needs of a client (``kvstore.client.Client``'s methods of these names)."""

    def info(self) -> pb.ServerInfo: ...

    def get_session(self, namespace: str, session_id: str) -> tuple[Manifest, dict[str, int]]: ...

    def load_session_into(self, namespace: str, session_id: str, out: Any
                          ) -> tuple[Manifest, list[tuple[int, memoryview]]]: ...

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
    previous load's views finish before the daemon overwrites them. ``ipc=False``: the host path
    only (no negotiation; e.g. to measure it beside the IPC path)."""

    def __init__(self, client: DeviceClient, device: torch.device, ipc: bool = True) -> None:
        self._client = client
        self.device = device
        self.path = ""  # IPC or HOST once negotiated
        self.reason = ""  # why HOST, when it is
        self._ipc = ipc
        self._buffer: DeviceBuffer | None = None
        self._buffer_id = ""
        self._host: HostBuffer | None = None  # the host path's page-locked buffer, kept and grown
        self._staged: torch.Tensor | None = None  # the host path's device buffer, kept and grown
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
        elif not self._ipc:
            self._fall_back("the host path was asked for")
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
        """``load_session_into`` the kept host buffer, then one upload of the bytes it placed into the kept
        device buffer, synchronized (the next load writes the host buffer again). A buffer too small
        is grown to what the session's manifest says it needs, and the load asked again."""
        import torch

        cuda = self.device.type == "cuda"
        if self._host is None:
            self._grow(self._session_bytes(self._client.get_session(namespace, session_id)[0]))
        for _ in range(3):
            assert self._host is not None
            try:
                manifest, placed = self._client.load_session_into(namespace, session_id, self._host.tensor)
            except ResourceExhausted:  # the session outgrew the buffer (nothing was placed): size it again
                need = self._session_bytes(self._client.get_session(namespace, session_id)[0])
                self._grow(need if need > self._host.size else 2 * self._host.size)
                continue
            sizes = [len(v) for _, v in placed]
            used = sum(sizes)
            self._check_packed(placed, used)
            if not cuda:  # the host buffer is the device's memory: its views, no copy
                return manifest, list(zip((i for i, _ in placed), self._host.tensor[:used].split(sizes)))
            if self._staged is None or self._staged.numel() < used:
                self._staged = None  # the old one is freed once the caller drops the last load's views
                self._staged = torch.empty(self._host.size, dtype=torch.uint8, device=self.device)
            dev = self._staged[:used]
            dev.copy_(self._host.tensor[:used], non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()  # the host buffer is written again next load
            return manifest, list(zip((i for i, _ in placed), dev.split(sizes)))
        raise KvstoreError("load_session_into did not fit the host buffer after 3 resizes")

    def _check_packed(self, placed: list[tuple[int, memoryview]], used: int) -> None:
        """``load_session_into`` packs the chunks back to back from the buffer's start, in order: the views
        are cut from that (one split, not a slice per chunk); its ends are checked against the buffer."""
        assert self._host is not None
        base = self._host.tensor.data_ptr()
        first, last = (placed[0][1], placed[-1][1]) if placed else (None, None)
        if first is not None and last is not None and (address_of(first) != base
                                                       or address_of(last) + len(last) != base + used):
            raise KvstoreError("load_session_into did not pack the chunks from the buffer's start")

    def _session_bytes(self, manifest: Manifest) -> int:
        """What a load of ``manifest``'s chunks places: each a chunk of its chunk_tokens tokens. A layout
        this client does not know (an engine's): twice the buffer it has."""
        lay = layout_by_id(manifest.layout_id)
        if lay is None:
            return 2 * (self._host.size if self._host is not None else MIN_BUFFER_BYTES)
        return len(manifest.chunk_keys) * chunk.encoded_size(lay, manifest.chunk_tokens)

    def _grow(self, need: int) -> None:
        """A host buffer of at least ``need`` bytes (and ``MIN_BUFFER_BYTES``), replacing a smaller one."""
        if self._host is not None and self._host.size >= need:
            return
        self._release_host()
        self._host = HostBuffer(max(need, MIN_BUFFER_BYTES), pin=self.device.type == "cuda")

    def _release_host(self) -> None:
        if self._host is not None:
            self._host.close()  # nothing reads it: every upload from it was synchronized
        self._host = self._staged = None

    def close(self) -> None:
        with self._lock:
            self._detach()
            self._release_host()
