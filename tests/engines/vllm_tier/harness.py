"""vLLM 0.33's own serving stack on a CPU machine, for the tier tests and benchmarks/vllm_tier/.

Built top down from vLLM's code, as a deployment builds it: ``EngineArgs`` parses the real command
line (``--model`` a local DeepSeek-V4.1-shaped ``config.json`` without weights, ``--kv-cache-dtype``,
``--kv-transfer-config`` the README's JSON), ``create_engine_config()`` makes the VllmConfig,
V4.1's own attention modules (built on the meta device) publish their KV cache specs, vLLM's
planner (``get_global_kv_cache_groups``, ``get_kv_cache_configs``, ``generate_scheduler_kv_cache_config``)
lays the blocks out, vLLM's ``Scheduler`` builds the OffloadingConnector (scheduler role, which
loads ``KVStoreTier`` from the tier config) and the worker-role connector registers the KV caches
``allocate_kv_cache`` allocates (on the CPU). Emulated, because they need a GPU: the
GPU<->CPU copy engine (``CPUOffloadingWorker`` is CUDA-only: ``emulated.CopyWorker`` copies whole packed
blocks between the KV cache tensor and the CPU tier's shared region, as it does) and the model
forward (``Engine.forward`` writes each newly computed block's bytes, a function of vLLM's block
hash, and, as V4.1 does, leaves the cached global KV of replayed tokens alone). What the CPU
platform decides differently from a GPU one is set back after ``create_engine_config()``: block
size 256 and prefix caching on (the CPU platform forces 16 and off for MLA), and the device
capability the record family needs (SM100 for Blackwell's ``nvfp4_ds_mla``; 9.0 for Hopper).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # the GPU default: it turns on bounded replay

import numpy as np
import torch
from emulated import NoEvent, copy_engine_emulated
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability

MODEL_DIR = Path(__file__).resolve().parent / "deepseek_v41"
BLOCK_TOKENS = 256
REPLAY_TOKENS = 128  # V4.1's SlidingWindowMLASpec(bounded_replay=True).prefix_replay_tokens


@dataclass(frozen=True)
class Family:
    """A deployment's record family: the command-line flags and the GPU they need."""

    name: str
    flags: tuple[str, ...]
    capability: tuple[int, int]


#: what deployments run: Blackwell with the MXFP4 indexer, Hopper's V4 584-B records, the indexer's ``auto``
#: default (fp8) on Blackwell, and Hopper's ``--kv-cache-dtype auto``
FAMILIES = {
    "blackwell": Family("blackwell", ("--kv-cache-dtype", "nvfp4_ds_mla",
                                      "--attention-config", '{"indexer_kv_dtype": "mxfp4"}'), (10, 0)),
    "hopper": Family("hopper", ("--kv-cache-dtype", "fp8_ds_mla"), (9, 0)),
    "indexer-auto": Family("indexer-auto", ("--kv-cache-dtype", "nvfp4_ds_mla"), (10, 0)),
    # what most of today's fleet types: vLLM resolves it to fp8_ds_mla in V4.1's attention (in the workers: the
    # scheduler, and so the tier, sees the model's dtype)
    "hopper-auto": Family("hopper-auto", ("--kv-cache-dtype", "auto"), (9, 0)),
}


def use_family(family: Family) -> None:
    """The device capability V4.1's cache modules and the tier read (the CPU platform has none)."""
    cap = DeviceCapability(*family.capability)
    type(current_platform).get_device_capability = classmethod(lambda cls, device_id=0: cap)  # type: ignore


def kv_transfer_config(tiers: list[dict[str, Any]], cpu_bytes: int, **extra: Any) -> dict[str, Any]:
    """The README's ``--kv-transfer-config``."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
                                          "secondary_tiers": tiers, **extra}}


def kvstore_tier(address: str, **extra: Any) -> dict[str, Any]:
    return {"type": "KVStoreTier", "module_path": "kvstore.engines.vllm.tier", "address": address, **extra}


def fs_tier(root: str, **extra: Any) -> dict[str, Any]:
    return {"type": "fs", "root_dir": root, **extra}


def engine_config(family: Family, transfer: dict[str, Any], max_model_len: int, kv_events: bool = False) -> VllmConfig:
    """vLLM's own config from the command line a deployment types."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    use_family(family)
    argv = ["--model", str(MODEL_DIR), *family.flags, "--kv-transfer-config", json.dumps(transfer),
            "--max-model-len", str(max_model_len),
            "--skip-tokenizer-init", "--language-model-only", "--load-format", "dummy"]  # no tokenizer here
    if kv_events:
        argv += ["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "null"}']
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(argv)
    cfg = EngineArgs.from_cli_args(args).create_engine_config()
    cfg.cache_config.block_size = BLOCK_TOKENS  # what the GPU platform resolves for V4.1 (the CPU one: 16)
    cfg.cache_config.enable_prefix_caching = True
    return cfg


@cache
def _distributed() -> None:
    from vllm.distributed import init_distributed_environment

    torch.cuda.Event = NoEvent  # type: ignore[misc,assignment]
    port = 20000 + os.getpid() % 20000
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="gloo")


def layer_specs(cfg: VllmConfig) -> dict[str, Any]:
    """The KV cache specs V4.1's own attention modules publish. Not through the model runner's
    ``get_kv_cache_spec``: its ``customize_attention_spec`` asks each layer's attention backend for kernel
    block sizes, and on the CPU platform the SWA and compressor caches get CPU backends whose alignments
    multiply the block stride (9.9 MB instead of 460 KB for Hopper)."""
    from vllm.distributed import initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.models.deepseek_v41.nvidia.model import _select_dsv4_attn_cls

    with set_current_vllm_config(cfg):
        _distributed()
        if not model_parallel_is_initialized():
            initialize_model_parallel(1, 1)
        attn = _select_dsv4_attn_cls(cfg)
        with torch.device("meta"):
            _layers = [attn(cfg, prefix=f"model.layers.{i}.attn")
                       for i in range(cfg.model_config.hf_config.num_hidden_layers)]
        ctx = cfg.compilation_config.static_forward_context
        return {n: spec for n, m in ctx.items() if (spec := m.get_kv_cache_spec(cfg)) is not None}


def plan(cfg: VllmConfig, specs: dict[str, Any], kv_bytes: int) -> tuple[Any, Any]:
    """vLLM's planner, as the engine core runs it: (the workers' KV cache config, the scheduler's)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    with set_current_vllm_config(cfg):
        names = [layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(cfg))]
    resolve_kv_cache_layout(cfg, [names], list(specs.values()))
    groups = get_global_kv_cache_groups(cfg, [specs])
    (worker,) = get_kv_cache_configs(cfg, [specs], [kv_bytes], groups)
    worker.kv_cache_layout = cfg.cache_config.kv_cache_layout
    sched = generate_scheduler_kv_cache_config([worker])
    cfg.cache_config.num_gpu_blocks = sched.num_blocks
    return worker, sched


@cache
def planned(family: Family, max_model_len: int, kv_bytes: int) -> tuple[Any, Any]:
    """vLLM's planner output for one family (the same for every tier config: computed once)."""
    cfg = engine_config(family, kv_transfer_config([], 1 << 20), max_model_len)
    return plan(cfg, layer_specs(cfg), kv_bytes)


@dataclass
class Sent:
    """A request as the engine saw it: its prompt, vLLM's block hashes, what the first schedule found cached."""

    req_id: str
    tokens: list[int]
    salt: str | None
    hashes: list[bytes] = field(default_factory=list)
    first_computed: int | None = None  # num_computed_tokens when first scheduled (a hit, minus the replay)
    loaded: list[bool] = field(default_factory=list)  # per block of the hit: its KV came back bit-equal
    finished: bool = False


class Engine:
    """One vLLM engine: its Scheduler (with the connector's scheduler role and the tier) and a worker
    (the connector's worker role, the KV cache tensor, the emulated copy engine and forward)."""

    def __init__(self, family: Family, tiers: list[dict[str, Any]], cpu_bytes: int = 64 << 20,
                 max_model_len: int = 16384, kv_bytes: int = 768 << 20, kv_events: bool = False,
                 **extra: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        self.family = family
        worker_cfg, sched_cfg = planned(family, max_model_len, kv_bytes)
        self.cfg = engine_config(family, kv_transfer_config(tiers, cpu_bytes, tier_poll_interval_s=0, **extra),
                                 max_model_len, kv_events)
        self.cfg.kv_transfer_config.engine_id = f"kvstore-test-{uuid.uuid4().hex[:8]}"
        self.cfg.cache_config.kv_cache_layout = worker_cfg.kv_cache_layout
        self.cfg.cache_config.num_gpu_blocks = sched_cfg.num_blocks
        self.kv_cache_config = worker_cfg
        block_size, hash_size = resolve_kv_cache_block_sizes(sched_cfg, self.cfg)
        self.hash_size = hash_size
        self.scheduler = Scheduler(vllm_config=self.cfg, kv_cache_config=sched_cfg,
                                   structured_output_manager=StructuredOutputManager(self.cfg),
                                   block_size=block_size, hash_block_size=hash_size, log_stats=True)
        self.published: list[Any] = []  # the KV event batches the scheduler published
        publish = self.scheduler.kv_event_publisher.publish
        self.scheduler.kv_event_publisher.publish = lambda b: (self.published.append(b), publish(b))[-1]
        hash_fn = get_hash_fn_by_name(self.cfg.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(hash_size, hash_fn, self.cfg.num_hash_lookahead_tokens)
        # the worker: vLLM's KV cache allocation (on the CPU) registered with the worker-role connector
        self.kv_caches = allocate_kv_cache(worker_cfg, torch.device("cpu"),
                                           self.cfg.cache_config.get_resolved_kv_cache_layout())
        self.worker = KVConnectorFactory.create_connector(self.cfg, KVConnectorRole.WORKER, worker_cfg)
        with copy_engine_emulated():
            self.worker.register_kv_caches(self.kv_caches)
        self.group = self.offloaded_group()
        self.stride, self.extent = self.block_geometry()
        storage = next(iter(self.kv_caches.values())).untyped_storage()
        self.buf = torch.tensor([], dtype=torch.uint8).set_(storage).numpy()  # the KV cache's bytes
        self.sent: dict[str, Sent] = {}

    # -- what vLLM's planner made ------------------------------------------------------------------
    def offloaded_group(self) -> int:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids

        (gid,) = get_offloading_group_ids(self.kv_cache_config)
        return gid

    def block_geometry(self) -> tuple[int, int]:
        """(the block stride, where the offloaded group's pages end) from vLLM's KVCacheTensors."""
        names = set(self.kv_cache_config.kv_cache_groups[self.group].layer_names)
        mine = [t for t in self.kv_cache_config.kv_cache_tensors if set(t.layers) <= names]
        ends = [t.offset + len(t.layers) * t.layer_stride for t in mine]
        return mine[0].block_stride, max(ends)

    @property
    def connector(self) -> Any:
        return self.scheduler.get_kv_connector()

    @property
    def manager(self) -> Any:
        return self.connector.scheduler.manager

    @property
    def tiers(self) -> list[Any]:
        return self.manager.secondary_tiers

    # -- requests ----------------------------------------------------------------------------------
    def send(self, req_id: str, tokens: Sequence[int], salt: str | None = None,
             params: dict[str, Any] | None = None) -> Sent:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params} if params else None)
        req = Request(req_id, list(tokens), sp, None, cache_salt=salt, block_hasher=self.hasher)
        self.scheduler.add_request(req)
        s = self.sent[req_id] = Sent(req_id, list(tokens), salt, [bytes(h) for h in req.block_hashes])
        return s

    def block_hash(self, s: Sent, j: int) -> bytes:
        """vLLM's hash of block ``j`` of a request (the last of its hash blocks)."""
        per = BLOCK_TOKENS // self.hash_size
        return s.hashes[(j + 1) * per - 1]

    def page_bytes(self, s: Sent, j: int) -> np.ndarray:
        """What the forward computes for block ``j`` of a request: the offloaded group's pages."""
        seed = int.from_bytes(self.block_hash(s, j)[:8], "little")
        return np.random.default_rng(seed).integers(0, 256, self.extent, dtype=np.uint8)

    def gpu_block(self, block_id: int) -> np.ndarray:
        at = block_id * self.stride
        return self.buf[at : at + self.extent]

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[self.group])

    def forward(self, so: Any) -> None:
        """The model's forward, emulated for the offloaded group: each block completed in this step gets its
        bytes; blocks under a prefix hit are not written (V4.1 pads the replayed tokens' global KV slots)."""
        for req_id, n in so.num_scheduled_tokens.items():
            s = self.sent[req_id]
            req = self.scheduler.requests[req_id]
            start = req.num_computed_tokens - n  # schedule() already counted this step's tokens
            ids = self.block_ids(req_id)
            if s.first_computed is None:  # the hit is in the KV cache now: what came back, block by block
                s.first_computed = start
                hit = -(-start // BLOCK_TOKENS)
                s.loaded = [bool(np.array_equal(self.gpu_block(ids[j]), self.page_bytes(s, j))) for j in range(hit)]
            cached = -(-s.first_computed // BLOCK_TOKENS)  # the hit, in blocks (it ends on a block boundary)
            for j in range(max(cached, start // BLOCK_TOKENS), (start + n) // BLOCK_TOKENS):
                at = ids[j] * self.stride
                self.buf[at : at + self.extent] = self.page_bytes(s, j)

    def step(self) -> Any:
        """One engine step: schedule, the worker's connector hooks around the forward, update."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        w = self.worker
        meta = so.kv_connector_metadata
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        with set_forward_context(None, self.cfg), copy_engine_emulated():
            w.start_load_kv(None)
            self.forward(so)
            w.wait_for_save()
            sending, recving = w.get_finished(so.finished_req_ids)
        out = KVConnectorOutput(finished_sending=sending or None, finished_recving=recving or None,
                                kv_connector_stats=w.get_kv_connector_stats(),
                                kv_connector_worker_meta=w.build_connector_worker_meta())
        w.clear_connector_metadata()
        ids = list(so.num_scheduled_tokens)
        sampled = [[1] if self._prefilled(r, so) else [] for r in ids]
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled, kv_connector_output=out)
        outputs = self.scheduler.update_from_output(so, mro)
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.sent[o.request_id].finished = True
        return so

    def _prefilled(self, req_id: str, so: Any) -> bool:
        return self.scheduler.requests[req_id].num_computed_tokens >= self.scheduler.requests[req_id].num_prompt_tokens

    def run(self, timeout_s: float = 120.0) -> None:
        """Step until every request finished and every store (into every tier) completed."""
        t0 = time.monotonic()
        while True:
            self.step()
            busy = self.scheduler.has_requests() or any(not s.finished for s in self.sent.values())
            with self.manager.lock:
                busy = busy or self.manager.has_pending_work()
            if not busy:
                return
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError("the engine did not finish its requests and stores")
            time.sleep(0.002)

    def serve(self, req_id: str, tokens: Sequence[int], salt: str | None = None,
              params: dict[str, Any] | None = None, timeout_s: float = 120.0) -> Sent:
        s = self.send(req_id, tokens, salt, params)
        self.run(timeout_s)
        return s

    def hit_tokens(self, s: Sent) -> int:
        """The prefix hit vLLM found for a request (its first schedule's computed tokens plus the replay)."""
        assert s.first_computed is not None
        return s.first_computed + REPLAY_TOKENS if s.first_computed else 0

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()
        # the KV cache tensor is referenced from cycles (the publisher's hook, the connector's worker): drop it
        # now rather than at the next cycle collection, or a benchmark's engines pile up gigabytes
        self.kv_caches.clear()
        self.buf = np.zeros(0, np.uint8)
        self.worker = None
        gc.collect()


def prompt(seed: str, blocks: int, tail: int = 10) -> list[int]:
    """A prompt of ``blocks`` full blocks and a few more tokens (the last block is never offloaded)."""
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "little"))
    return [int(t) for t in rng.integers(100, 120_000, blocks * BLOCK_TOKENS + tail)]
