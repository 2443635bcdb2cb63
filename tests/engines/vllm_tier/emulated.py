"""What needs a GPU, emulated on the CPU for tests/engines/vllm_tier/harness.py: the GPU<->CPU copy engine and
the CUDA events V4.1's attention makes when it is built."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class NoEvent:  # V4.1's attention makes CUDA events in __init__; the CPU build of torch has none
    def __init__(self, *a: Any, **k: Any) -> None: ...
    def record(self, *a: Any, **k: Any) -> None: ...
    def wait(self, *a: Any, **k: Any) -> None: ...


class CopyWorker:
    """The GPU<->CPU copy engine (``CPUOffloadingWorker``, CUDA-only), emulated on the CPU: whole packed
    blocks between the KV cache tensor and this worker's view of the CPU tier's shared region, as the
    real one sets them up (``create_next_worker_view``)."""

    def __init__(self, kv_caches: Any, spec: Any) -> None:
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

        assert spec.blocks_per_chunk == 1 and len(kv_caches.tensors) == 1, "one packed tensor, a block per chunk"
        self.region = SharedOffloadRegion(engine_id=spec.config.engine_id, num_chunks=spec.num_chunks, rank=0,
                                          kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
                                          cpu_page_size=spec.cpu_page_size_per_worker)
        t = kv_caches.tensors[0]
        self.gpu = t.tensor.view(torch.int8).view(-1, t.page_size_bytes)
        self.cpu = self.region.create_next_worker_view(t.page_size_bytes)
        self.done: list[Any] = []

    def _copy(self, job_id: int, src: torch.Tensor, src_ids: Any, dst: torch.Tensor, dst_ids: Any) -> bool:
        from vllm.v1.kv_offload.base import TransferResult

        s, d = [int(i) for i in src_ids], [int(i) for i in dst_ids]
        assert len(s) == len(d)
        dst[d] = src[s]
        self.done.append(TransferResult(job_id, True, len(s) * src.shape[1], 0.0))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, self.gpu, src_spec.block_ids, self.cpu, dst_spec.block_ids)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        return self._copy(job_id, self.cpu, src_spec.block_ids, self.gpu, dst_spec.block_ids)

    def get_finished(self) -> list[Any]:
        out, self.done = self.done, []
        return out

    def wait(self, job_ids: set[int]) -> None: ...

    def shutdown(self) -> None:
        self.gpu = self.cpu = torch.zeros(0, dtype=torch.int8)  # the KV cache and the region: not held past here
        self.region.cleanup()


@contextlib.contextmanager
def copy_engine_emulated() -> Iterator[None]:
    """``TieringOffloadingSpec.get_worker`` hands out ``CopyWorker`` instead of the CUDA one."""
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    real = TieringOffloadingSpec.get_worker

    def get_worker(self: Any, kv_caches: Any) -> Any:
        if getattr(self, "_emulated", None) is None:
            self._emulated = CopyWorker(kv_caches, self)
        return self._emulated

    TieringOffloadingSpec.get_worker = get_worker  # type: ignore[method-assign]
    try:
        yield
    finally:
        TieringOffloadingSpec.get_worker = real  # type: ignore[method-assign]
