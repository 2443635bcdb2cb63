"""vLLM 0.33's own offloading stack on a CPU machine, for the tier tests and benchmarks/vllm_tier/bench_vllm_tier.py.

Built from vLLM's classes, not copies of them: DeepSeek-V4.1's per-layer KV cache specs are the
``MLAAttentionSpec``s its attention and indexer layers publish (``vllm/models/deepseek_v41/
attention.py``: nvfp4_ds_mla main records of 288 B, MXFP4 indexer records of 68 B, 512-B aligned
pages, ratio 2 for layers 2, 8, 14 and 1 for layer 20); the prefix-cacheable groups are vLLM's
``UniformTypeKVCacheSpecs`` of them; the block stride is what vLLM's planner computes
(``_get_kv_cache_bytes_per_block``); the OffloadingConfig is what ``build_offloading_config`` fills;
the manager is ``TieringOffloadingSpec.get_manager()``: a real CPU primary tier in shared memory
with the secondary tiers below it. Only the GPU worker is absent: a test writes the pages into
the primary's slots itself, as the GPU->CPU copy would.
"""

from __future__ import annotations

import hashlib
import itertools
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.v1.core.kv_cache_planning import _get_kv_cache_bytes_per_block
from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"
SOURCES = ((2, 2), (8, 2), (14, 2), (20, 1))  # kv-source layer, compress ratio
BLOCK_TOKENS = 256
#: The KV cache config's ids of the two offloaded groups. Not 0 and 1: V4.1's SWA and compressor-state
#: groups are not offloaded but keep their ids, and an OffloadKey names its group by that id.
V41_GROUP_IDS = (1, 3)


class _Layout:
    is_block_outermost = True


def v41_layer_specs(block_size: int = BLOCK_TOKENS, cache_dtype: str = "nvfp4_ds_mla") -> dict[str, MLAAttentionSpec]:
    """The specs DeepSeek-V4.1's kv-source layers publish (attention.py get_kv_cache_spec)."""
    record = {"nvfp4_ds_mla": 288, "fp8_ds_mla": 584}[cache_dtype]
    align = 512 if cache_dtype == "nvfp4_ds_mla" else 576
    specs: dict[str, MLAAttentionSpec] = {}
    for layer, ratio in SOURCES:
        specs[f"model.layers.{layer}.self_attn.mla_attn"] = MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=512, dtype=torch.uint8, tokens_per_state=ratio,
            cache_dtype_str=cache_dtype, alignment=align, model_version="deepseek_v4", state_content_bytes=record)
        specs[f"model.layers.{layer}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=68, dtype=torch.uint8, tokens_per_state=ratio,
            alignment=align)
    return specs


def v41_groups(specs: dict[str, MLAAttentionSpec]) -> list[KVCacheGroupSpec]:
    """The prefix-cacheable groups: the ratio-2 sources together, the ratio-1 source alone."""
    out = []
    for ratio in (2, 1):
        mine = {n: s for n, s in specs.items() if s.tokens_per_state == ratio}
        uniform = UniformTypeKVCacheSpecs.from_specs(mine)
        assert uniform is not None
        out.append(KVCacheGroupSpec(list(mine), uniform))
    return out


def offloading_config(tiers: list[dict[str, Any]], cpu_bytes: int, cache_dtype: str = "nvfp4_ds_mla",
                      engine_id: str | None = None, kv_events: bool = False) -> OffloadingConfig:
    groups = v41_groups(v41_layer_specs(cache_dtype=cache_dtype))
    per_block = _get_kv_cache_bytes_per_block(groups, _Layout())  # type: ignore[arg-type]
    return OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(tokens_per_block=BLOCK_TOKENS, layer_names=tuple(g.layer_names),
                                           group_id=gid) for gid, g in zip(V41_GROUP_IDS, groups)),
        worker_kv_bytes_per_block=per_block, enable_kv_cache_events=kv_events,
        extra_config={"cpu_bytes_to_use": cpu_bytes, "secondary_tiers": tiers, "tier_poll_interval_s": 0},
        engine_id=engine_id or f"kvstore-test-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name=MODEL, dtype=cache_dtype, max_model_len=1 << 20),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False))


def kvstore_tier(address: str, **extra: Any) -> dict[str, Any]:
    return {"type": "KVStoreTier", "module_path": "kvstore.engines.vllm.tier", "address": address, **extra}


def fs_tier(root: str, **extra: Any) -> dict[str, Any]:
    return {"type": "fs", "root_dir": root, **extra}


def block_hashes(seed: str, n: int) -> list[bytes]:
    """Chained 32-byte block hashes, as vLLM's sha256 prefix hashing makes them."""
    out, parent = [], b"\0" * 32
    for i in range(n):
        parent = hashlib.sha256(parent + f"{seed}/{i}".encode()).digest()
        out.append(parent)
    return out


@dataclass
class Engine:
    """The scheduler side of one vLLM engine's offloading: its manager and CPU primary tier."""

    spec: TieringOffloadingSpec
    manager: Any

    @classmethod
    def start(cls, tiers: list[dict[str, Any]], cpu_bytes: int = 256 << 20, **kw: Any) -> Engine:
        spec = TieringOffloadingSpec(offloading_config(tiers, cpu_bytes, **kw))
        return cls(spec, spec.get_manager())

    @property
    def groups(self) -> int:
        return len(self.spec.config.groups)

    @property
    def group_ids(self) -> tuple[int, ...]:
        return tuple(g.group_id for g in self.spec.config.groups)

    @property
    def tiers(self) -> list[Any]:
        return self.manager.secondary_tiers

    @property
    def stride(self) -> int:
        return self.tiers[0].block_size_bytes if self.tiers else self.spec.kv_bytes_per_chunk

    def view(self) -> memoryview:
        return self.manager.primary_tier.get_kv_memoryview().cast("B")

    def extent(self, key: bytes) -> int:
        """How many leading bytes of ``key``'s slot are its group's pages (what must round-trip)."""
        from vllm.v1.kv_offload.base import get_offload_group_idx

        lay = self.tiers[0].layout
        g = lay.group(get_offload_group_idx(key))
        return g.block_bytes if g is not None else self.stride

    def step(self, new: Sequence[str] = ()) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=list(new), preempted_req_ids=[]))

    def request(self, req_id: str, params: dict[str, Any] | None = None) -> ReqContext:
        ctx = ReqContext(req_id=req_id, kv_transfer_params=params)
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def finish(self, ctx: ReqContext) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(ctx)

    def store(self, ctx: ReqContext, keys: Sequence[bytes], fill: Callable[[int, memoryview], None]) -> None:
        """What the connector does for new blocks: allocate primary slots, write them (the GPU
        copy), complete the store (which cascades to every secondary tier)."""
        with self.manager.lock:
            for i, k in enumerate(keys):  # keys are block-major: every group's key of a block
                ctx.set_offload_key_position(k, (i // self.groups + 1) * BLOCK_TOKENS)
            out = self.manager.prepare_store(keys, ctx)
            assert out is not None, "primary tier full"
            view, stride = self.view(), self.stride
            for k, cid in zip(out.keys_to_store, out.store_spec.chunk_ids):
                fill(keys.index(k), view[int(cid) * stride : (int(cid) + 1) * stride])
            self.manager.complete_store(out.keys_to_store, ctx)

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        t0 = time.monotonic()
        while True:
            self.step()
            with self.manager.lock:
                busy = self.manager.has_pending_work()
            if not busy:
                return
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError("offloading jobs did not finish")
            time.sleep(0.002)

    def drop_primary(self) -> None:
        """Forget the CPU primary's contents (as a restart of vLLM would)."""
        with self.manager.lock:
            self.manager.reset_cache()
            self.manager.on_reset_flushed()  # the workers' late copies are flushed (there are none here)
        self.step()

    def lookup(self, ctx: ReqContext, key: bytes, timeout_s: float = 30.0) -> LookupResult:
        """Ask until the answer is final: HIT (in the primary, promoted from a tier if need be) or MISS."""
        t0 = time.monotonic()
        while True:
            with self.manager.lock:
                r = self.manager.lookup(key, ctx)
            if r in (LookupResult.HIT, LookupResult.MISS):
                return r
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"lookup stayed {r}")
            self.step()
            time.sleep(0.001)

    def read(self, ctx: ReqContext, keys: Sequence[bytes]) -> list[bytes]:
        """The primary's bytes of ``keys`` (all must be HIT), as the CPU->GPU load would read them."""
        with self.manager.lock:
            spec = self.manager.prepare_load(keys, ctx)
            view, stride = self.view(), self.stride
            out = [bytes(view[int(c) * stride : (int(c) + 1) * stride]) for c in spec.chunk_ids]
            self.manager.complete_load(keys, ctx)
        return out

    def shutdown(self) -> None:
        self.manager.shutdown()


def keys_of(hashes: Sequence[bytes], group_ids: Sequence[int] = V41_GROUP_IDS) -> list[bytes]:
    """Every offloaded group's OffloadKey of each block, block-major."""
    return [make_offload_key(h, g) for h, g in itertools.product(hashes, group_ids)]


def page_filler(seed: int) -> Callable[[int, memoryview], None]:
    """Deterministic pseudo-random page bytes for block i (what the GPU copy would have written)."""
    def fill(i: int, slot: memoryview) -> None:
        rng = np.random.default_rng((seed, i))
        slot[:] = rng.integers(0, 256, len(slot), dtype=np.uint8).tobytes()
    return fill


def expected(seed: int, i: int, size: int) -> bytes:
    buf = bytearray(size)
    page_filler(seed)(i, memoryview(buf))
    return bytes(buf)
