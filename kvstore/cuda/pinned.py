"""Page-locked host memory a client owns outright: anonymous memory of its own, registered with CUDA
(``cudaHostRegister``), for loads the daemon writes straight into a client's buffer and the client then
uploads in one DMA (the device loader's host path, kvstore/client/device_load.py).

Why not torch's ``pin_memory=True``: that memory comes from torch's caching host allocator, which keeps
a freed block cached for later pinned allocations of the process instead of returning it, so a loader
that grows its buffer from one session's size to a larger one's would leave the old block page-locked
for the life of the process. This buffer is unregistered and unmapped when the loader lets it go, and is
ordinary anonymous memory for the kernel (the daemon's ``process_vm_writev`` writes into it). Both kinds
upload at the same speed (H200: 52-53 GB/s, benchmarks/results/resume_geometry_gpu.md, which also found
the daemon's writes into ``pin_memory`` memory accepted there).

Registration needs CUDA; where there is none (or the driver refuses it) the buffer is plain memory
(``pinned`` False): still correct, its uploads only slower. This module imports without CUDA.
"""

from __future__ import annotations

import logging
import mmap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: sizes are rounded up to this (a buffer grown by a few chunks is not registered again)
GRANULE = 2 << 20
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process


def rounded(size: int) -> int:
    return max(GRANULE, -(-size // GRANULE) * GRANULE)


class HostBuffer:
    """``size`` bytes (rounded up to ``GRANULE``) of anonymous private memory, page-locked with
    ``cudaHostRegister`` when ``pin`` and CUDA allows; ``tensor`` is a uint8 CPU tensor over all of
    it. ``close()`` unregisters it; the memory itself goes with the last reference to the tensor."""

    def __init__(self, size: int, pin: bool) -> None:
        import torch

        self.size = rounded(size)
        self._map: mmap.mmap | None = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE)
        self.tensor: torch.Tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = pin and self._register()

    def _register(self) -> bool:
        import torch

        if not torch.cuda.is_available():
            return False
        rc = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.size, _PORTABLE))
        if rc != 0:
            log.warning("cudaHostRegister of %d bytes failed (cudaError %d): uploads from this buffer are "
                        "pageable copies", self.size, rc)
        return rc == 0

    def close(self) -> None:
        """Unregister (once the device is done with it: the caller synchronizes first) and let go."""
        import torch

        if self.pinned:
            self.pinned = False
            rc = int(torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr()))
            if rc != 0:
                log.warning("cudaHostUnregister failed (cudaError %d)", rc)
        self._map = None  # unmapped when the tensor (and any view of it) is gone
