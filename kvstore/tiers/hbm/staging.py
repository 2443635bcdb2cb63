"""Host bytes into the HBM arena at PCIe speed: pinned, reused staging buffers on copy lanes.

A copy from pageable memory is staged by the driver through its own small pinned buffer, one
piece at a time (7-19 GB/s on H200 hosts, against ~55 GB/s from pinned memory). Here each lane
(a thread with its own CUDA stream and a few pinned buffers, allocated once) copies its share of
a batch into one buffer with the CPU while its previous buffer is on its way to the device, and
several lanes run at once, so neither the CPU copy nor the DMA engine waits for the other. numpy
releases the GIL for large copies, and CUDA calls release it too, so the lanes run in parallel.
The plan (which bytes go where) is pure logic in tiers/hbm/alloc.py.

Measured (benchmarks/gpu/hbm.py, H200 in a VM): the DMA side keeps up, the CPU copy out of the
caller's pageable bytes does not: puts run at 7-8 GB/s, about the driver's own pageable H2D there,
and more lanes do not scale it. Reaching pinned speed needs the source to be pinned already (e.g.
the daemon's shared-memory arenas registered with cudaHostRegister), which skips this copy.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from kvstore.tiers.hbm.alloc import Segment, plan_uploads

if TYPE_CHECKING:
    import torch

    from kvstore.tiers.config import HbmTierConfig


class _Lane:
    """One copy lane: a CUDA stream and a ring of pinned staging buffers, each with the event that
    says when the DMA reading it has finished (so the CPU may fill it again)."""

    def __init__(self, device: torch.device, buffer_bytes: int, buffers: int) -> None:
        import torch

        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.buffers = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(buffers)]
        self.arrays = [b.numpy() for b in self.buffers]
        self.events = [torch.cuda.Event() for _ in range(buffers)]

    def upload(self, arena: torch.Tensor, segments: list[Segment], sources: list[np.ndarray]) -> None:
        import torch

        ring = len(self.buffers)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for j, seg in enumerate(segments):
                b = j % ring
                self.events[b].synchronize()  # the DMA that last read this buffer is done
                dst = self.arrays[b]
                for i, within, pos, n in seg.pieces:
                    dst[pos:pos + n] = sources[i][within:within + n]
                buf = self.buffers[b]
                for pos, dev, n in seg.copies:
                    arena[dev:dev + n].copy_(buf[pos:pos + n], non_blocking=True)
                self.events[b].record(self.stream)
        self.stream.synchronize()


class Stager:
    """The tier's copy lanes. ``upload`` returns once every byte is in the arena; callers
    serialize calls (the tier holds its lock), the lanes of one call run concurrently."""

    def __init__(self, device: torch.device, config: HbmTierConfig) -> None:
        self.buffer_bytes = config.staging_bytes
        self._lanes = [_Lane(device, config.staging_bytes, config.staging_buffers) for _ in range(config.copy_lanes)]
        self._pool = (ThreadPoolExecutor(config.copy_lanes - 1, thread_name_prefix="hbm-copy")
                      if config.copy_lanes > 1 else None)

    def upload(self, arena: torch.Tensor, blocks: list[tuple[int, int]], values: list[memoryview]) -> None:
        """Copy ``values`` (host bytes, sizes > 0) into ``arena`` at the offsets of ``blocks``
        ((offset, size), in the same order)."""
        plan = plan_uploads(blocks, len(self._lanes), self.buffer_bytes)
        sources = [np.frombuffer(v, dtype=np.uint8) for v in values]
        pending = []
        if self._pool is not None:
            pending = [self._pool.submit(lane.upload, arena, segs, sources)
                       for lane, segs in zip(self._lanes[1:], plan[1:])]
        try:
            if plan:
                self._lanes[0].upload(arena, plan[0], sources)
        finally:
            for f in pending:  # every lane finished (or failed) before the caller may reuse the blocks
                f.exception()
        for f in pending:
            f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._lanes = []
