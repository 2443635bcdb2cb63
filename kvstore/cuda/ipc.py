"""CUDA IPC for the same-GPU handoff: a client's device buffer exported, and opened by the daemon.

Tenant isolation decides the direction: the daemon never exports its HBM arena (a client that
mapped it could read every tenant's chunks). Instead each client allocates a device buffer of its
own and exports it; the daemon opens it once, at attach, and each load copies that caller's
chunks device to device into it. What the daemon can reach is what the client handed over.

torch carries the mechanics: ``UntypedStorage._share_cuda_`` gives the ``cudaIpcMemHandle`` of the
buffer's allocation plus a shared-memory reference counter (so the client's allocator keeps the
memory while the daemon has it open, even after the client drops its tensor) and an interprocess
event; ``UntypedStorage._new_shared_cuda`` opens them. CUDA IPC needs two processes on one GPU,
and may be refused (some sandboxes, e.g. gVisor, do not support it): every failure here raises
``IpcUnavailable`` and the caller falls back to the host path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class IpcUnavailable(RuntimeError):
    """CUDA IPC cannot be used here (no CUDA, another GPU, or the driver refused the handle)."""


@dataclass(frozen=True)
class IpcHandle:
    """What crosses the wire to let another process open a device buffer (proto DeviceBufferHandle)."""

    gpu_uuid: str
    handle: bytes  # cudaIpcMemHandle_t of the allocation holding the buffer
    storage_bytes: int  # the buffer's storage size
    storage_offset: int  # where the buffer starts in that allocation
    ref_counter_handle: bytes  # torch's shared-memory reference counter (keeps the memory alive)
    ref_counter_offset: int
    event_handle: bytes  # cudaIpcEventHandle_t: the buffer's last writes, waited on by the opener
    event_sync_required: bool
    size: int  # usable bytes


def gpu_uuid(device: torch.device | int) -> str:
    """The GPU's UUID: the same physical GPU has the same one in every process, whatever its index
    there (CUDA_VISIBLE_DEVICES may number GPUs differently in the client and the daemon)."""
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def device_of_uuid(uuid: str) -> int | None:
    """This process's index of the GPU with ``uuid``, or None if it cannot see it."""
    import torch

    if not torch.cuda.is_available():
        return None
    return next((i for i in range(torch.cuda.device_count()) if gpu_uuid(i) == uuid), None)


class DeviceBuffer:
    """A client's device buffer that the daemon writes loads into (opened through ``export``)."""

    def __init__(self, device: torch.device, size: int) -> None:
        import torch

        if device.type != "cuda" or not torch.cuda.is_available():
            raise IpcUnavailable(f"CUDA IPC needs a CUDA device, got {device}")
        self.tensor = torch.empty(size, dtype=torch.uint8, device=device)
        self.size = size
        self.device = self.tensor.device

    def export(self) -> IpcHandle:
        try:
            (_, handle, storage_bytes, storage_offset, ref_handle, ref_offset, event_handle,
             event_sync) = self.tensor.untyped_storage()._share_cuda_()
        except (RuntimeError, TypeError) as e:  # e.g. expandable segments, or a driver without IPC
            raise IpcUnavailable(f"cannot export the device buffer: {e}") from e
        return IpcHandle(gpu_uuid(self.device), bytes(handle), int(storage_bytes), int(storage_offset),
                         bytes(ref_handle or b""), int(ref_offset or 0), bytes(event_handle or b""), bool(event_sync),
                         self.size)


def open_handle(h: IpcHandle) -> torch.Tensor:
    """Open another process's exported buffer on this process's index of the same GPU: a uint8
    tensor of ``h.size`` bytes aliasing it. Raises ``IpcUnavailable`` if this process cannot see
    that GPU or the driver refuses the handle (same process, a sandbox, another GPU)."""
    import torch

    index = device_of_uuid(h.gpu_uuid)
    if index is None:
        raise IpcUnavailable(f"GPU {h.gpu_uuid} is not visible to this process")
    if h.size <= 0 or h.storage_offset < 0 or h.size > h.storage_bytes:
        raise IpcUnavailable(f"malformed buffer handle: size {h.size}, storage {h.storage_bytes}")
    try:
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            index, h.handle, h.storage_bytes, h.storage_offset, h.ref_counter_handle, h.ref_counter_offset,
            h.event_handle, h.event_sync_required)  # all bytes: torch checks PyBytes for each
    except (RuntimeError, TypeError, ValueError) as e:
        raise IpcUnavailable(f"cannot open the CUDA IPC handle: {e}") from e
    t = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
    t.set_(storage, 0, (h.size,), (1,))
    return t
