"""SGLang 0.5.23's own HiCache L3 machinery for DeepSeek-V4.1 on a CPU machine, for the L3 backend tests.

Built from SGLang's code as a V4.1 deployment launched with ``--enable-hierarchical-cache
--hicache-mem-layout page_first --hicache-storage-backend <file|dynamic>
--hicache-storage-backend-extra-config '<json>' --enable-encoder-swa-bounded-replay`` builds it:

* the command line goes through SGLang's own ``prepare_server_args`` and is published with
  ``runtime_context.publish`` (the resolved ``get_memory()`` / ``get_exec()`` bags every pool and the
  controller read); the extra-config JSON is parsed by
  ``HybridCacheController.parse_storage_backend_extra_config``, as ``UnifiedRadixCache`` does;
* the device pools are SGLang's ``DeepSeekV4TokenToKVPool(device="cpu")`` with V4.1's compress ratios
  (43 layers: 0, 0, eighteen 2s, twenty-three 1s; kv-source layers 2, 8, 14 at ratio 2 and 20 at
  ratio 1) and the record family ``select_dsv4_kv_layout()`` picks on the GPU asked for;
* the host pools and the ``HybridCacheController`` come from SGLang's DSV4 stack strategy
  (``_select_strategy`` -> ``_DeepSeekV4Strategy.build`` -> ``build_deepseek_v4_hicache_stack``), which
  also yields the sidecar specs the radix cache turns into ``PoolTransfer``s; the controller attaches the
  storage backend through SGLang's ``StorageBackendFactory`` (so ``dynamic`` loads a backend from
  ``module_path``/``class_name`` and the ``SGLANG_TEST_HICACHE_BACKEND_*`` failure injector applies) and
  runs its real prefetch, prefetch-IO, prefetch-sync and backup threads.

What is patched or emulated, because it needs a GPU (nothing else is):

* the device-capability query while the record family is chosen (``torch.cuda.is_available``,
  ``get_device_capability``, ``torch.version.cuda``, only around ``select_dsv4_kv_layout()``), plus, for
  the SM100 family, ``--dsv4-attn-backend flashmla_mega``: what SGLang resolves ``auto`` to for a
  ``deepseek_v41`` checkpoint on SM100 (the placeholder model here has no checkpoint to resolve from);
* ``pool_host.common._cuda_host_register`` is a no-op and the DSV4 host pools get ``pin_memory=False``
  (cudaHostRegister / pinned memory need CUDA);
* the L1<->L2 copies: ``DeepSeekV4PagedHostPool.backup_from_device_all_layer`` /
  ``load_to_device_per_layer`` call ``sgl_kernel`` transfer kernels; here they copy whole page rows
  between the (CPU) device buffers and the host pool, as the kernels do for page-aligned transfers;
* the GPU token allocator (:class:`FakeDeviceAllocator`: sizes, no-op transfer-done events).

The scheduler-thread side of ``UnifiedRadixCache`` (a tree walk, no GPU) is replaced by the steps it
performs against the controller: ``write`` with the sidecar transfers, ``write_storage`` with the sidecar
transfers, ``prefetch``, then draining ``prefetch_hit_queue`` (``allocate_storage_hit`` ->
``prefetch_buffer``) and ``ack_prefetch_queue``.

API (see the tests in test_sglang_tier.py)::

    engine = Engine(family="sm100", storage_backend="file", extra_config={"file_storage_path": d})
    engine.geometry()                       # {pool name: PoolGeometry}
    stored = engine.write_through(tokens, cache_salt=None)   # -> Stored(keys, completed_tokens, pool_pages)
    engine.close()                          # detaches the backend: threads stopped, backend closed
    stop_orphaned_storage_threads()         # after an Engine(...) that raised: stops what SGLang left running
    fresh = Engine(...same storage...)      # a restarted engine: empty host pools, same L3
    loaded = fresh.prefetch(tokens, cache_salt=None)         # -> Loaded(hit_pages, hit_tokens, pool_pages, ...)
    loaded.pool_pages["deepseek_v4_c2"][i] == stored.pool_pages["deepseek_v4_c2"][i]   # bytes, bit-exact
    expected_page_bytes(pool, key, layer_num, item_bytes)   # what write_through put on the device

``page_keys(tokens, cache_salt)`` is SGLang's own key scheme (``get_storage_hash_str`` over a
``RadixKey``: the SHA-256 page chain seeded by ``storage_namespace_seed(extra_key, cache_salt)``).
``Engine(..., storage_backend="dynamic", extra_config={...})`` is the hook for any other backend.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from queue import Empty
from typing import Any

import cpu_shims

cpu_shims.install()

import torch  # noqa: E402
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.mem_cache import deepseek_v4_memory_pool as dsv4_pool  # noqa: E402
from sglang.srt.mem_cache.pool_host import common as pool_host_common  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

PAGE_TOKENS = 256
#: ``--served-model-name``: the model name SGLang hands its L3 backend (the model itself is a placeholder here)
SERVED_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"
#: DeepSeek-V4.1's compress ratio per layer and its kv-source layers (its config.json)
V41_COMPRESS_RATIOS: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 23
V41_KV_SOURCE_LAYERS: tuple[int, ...] = (2, 8, 14, 20)
V41_SLIDING_WINDOW = 128
V41_QK_NOPE_HEAD_DIM = 448
V41_QK_ROPE_HEAD_DIM = 64
V41_INDEX_HEAD_DIM = 128

#: the pools V4.1 writes to L3 with --enable-encoder-swa-bounded-replay (besides the data-less ``kv`` anchor)
V41_L3_POOLS: tuple[str, ...] = ("deepseek_v4_c2", "deepseek_v4_c2_indexer", "deepseek_v4_c1", "deepseek_v4_c1_indexer")


@dataclass(frozen=True)
class Family:
    """A deployment's record family: the GPU generation and the flags that deployment resolves to."""

    name: str
    capability: tuple[int, int]
    flags: tuple[str, ...]


FAMILIES: dict[str, Family] = {
    # Blackwell: V4.1's own records (SGLang resolves --dsv4-attn-backend auto to flashmla_mega for a
    # deepseek_v41 checkpoint on SM100, which selects the v41 layout: V41_FP4 for the ratio-1/2 caches)
    "sm100": Family("sm100", (10, 0), ("--dsv4-attn-backend", "flashmla_mega")),
    # Hopper (H100/H200): the V4 584-B records
    "hopper": Family("hopper", (9, 0), ()),
}


# --- what needs a GPU, patched once ---------------------------------------------------------------

def _no_host_register(buffer: torch.Tensor, registration_granularity_bytes: int | None = None) -> None:
    """cudaHostRegister needs CUDA; the host pools stay plain CPU memory."""


def _row_view(buffer: torch.Tensor) -> torch.Tensor:
    """A device buffer as [rows, bytes] (a view: writes reach SGLang's device pool)."""
    return buffer.view(torch.uint8).reshape(buffer.shape[0], -1)


def _host_rows(host_pool: Any, layer: int) -> torch.Tensor:
    if host_pool.layout == "page_first":
        return host_pool.kv_buffer[:, layer, :]
    if host_pool.layout == "layer_first":
        return host_pool.kv_buffer[layer]
    raise ValueError(f"unsupported host layout {host_pool.layout}")


def _emulated_backup(self: Any, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                     io_backend: str) -> None:
    """``backup_from_device_all_layer`` without ``sgl_kernel``: whole page rows, device -> host, every layer."""
    if not self._has_transfer_indices(host_indices, device_indices):
        return
    if host_indices.numel() % self.slot_page_size or device_indices.numel() % self.slot_page_size:
        raise self._unaligned_transfer_error(host_indices, device_indices)
    host_rows, device_rows = self._to_page_indices(host_indices), self._to_page_indices(device_indices)
    for layer in range(self.layer_num):
        _host_rows(self, layer)[host_rows] = _row_view(self.device_buffers[layer])[device_rows]


def _emulated_load(self: Any, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                   layer_id: int, io_backend: str, *args: Any, **kwargs: Any) -> None:
    """``load_to_device_per_layer`` without ``sgl_kernel``: whole page rows of one layer, host -> device."""
    if not self._has_transfer_indices(host_indices, device_indices):
        return
    host_rows, device_rows = self._to_page_indices(host_indices), self._to_page_indices(device_indices)
    _row_view(self.device_buffers[layer_id])[device_rows] = _host_rows(self, layer_id)[host_rows]


_patched = False


def _patch_gpu_paths() -> None:
    global _patched
    if _patched:
        return
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool, DeepSeekV4StateHostPool

    pool_host_common._cuda_host_register = _no_host_register
    for cls in (DeepSeekV4PagedHostPool, DeepSeekV4StateHostPool):
        original_init = cls.__init__

        def init_unpinned(self: Any, *args: Any, _init: Any = original_init, **kwargs: Any) -> None:
            kwargs["pin_memory"] = False
            _init(self, *args, **kwargs)

        cls.__init__ = init_unpinned  # type: ignore[method-assign]
    DeepSeekV4PagedHostPool.backup_from_device_all_layer = _emulated_backup  # type: ignore[method-assign]
    DeepSeekV4PagedHostPool.load_to_device_per_layer = _emulated_load  # type: ignore[method-assign]
    _patched = True


@contextlib.contextmanager
def _device_capability(capability: tuple[int, int]) -> Iterator[None]:
    """The CUDA capability SGLang's layout choice reads, for the duration of that choice only."""
    saved = (torch.cuda.is_available, torch.cuda.get_device_capability, torch.version.cuda)
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    torch.cuda.get_device_capability = lambda device=None: capability  # type: ignore[assignment]
    torch.version.cuda = "12.9"  # type: ignore[misc]
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.get_device_capability, torch.version.cuda = saved  # type: ignore[misc]


# --- SGLang's key scheme --------------------------------------------------------------------------

def radix_key(tokens: Sequence[int], cache_salt: str | None = None) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens), cache_salt=cache_salt)


def page_keys(tokens: Sequence[int], cache_salt: str | None = None) -> list[str]:
    """SGLang's L3 page keys for ``tokens`` (whole pages only): ``get_storage_hash_str`` of a ``RadixKey``."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    whole = len(tokens) // PAGE_TOKENS * PAGE_TOKENS
    keys = get_storage_hash_str(radix_key(tokens[:whole], cache_salt), None, page_size=PAGE_TOKENS)
    return list(keys)


def expected_page_bytes(pool: str, key: str, layer_num: int, item_bytes: int) -> bytes:
    """The bytes :meth:`Engine.write_through` puts in ``pool``'s page for ``key`` (all layers, page_first order)."""
    seed = int.from_bytes(hashlib.sha256(f"{pool}/{key}".encode()).digest()[:8], "little") & (2**63 - 1)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (layer_num * item_bytes,), dtype=torch.uint8, generator=generator).numpy().tobytes()


# --- the engine -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class PoolGeometry:
    name: str
    layer_num: int
    item_bytes: int  # bytes per layer per page
    page_tokens: int
    host_pages: int
    hit_policy: str  # a sidecar's PoolHitPolicy value; "component" for a tree component's own pool (swa)

    @property
    def page_bytes(self) -> int:
        return self.layer_num * self.item_bytes

    @property
    def bytes_per_token(self) -> float:
        return self.page_bytes / self.page_tokens


@dataclass
class Stored:
    keys: list[str]
    completed_tokens: int  # what the backup thread reports stored (the KV anchor's pages)
    pool_results: dict[str, list[bool]]  # per sidecar pool, batch_set_v2's verdict per page
    pool_pages: dict[str, list[bytes]]  # per pool, the bytes written per page


@dataclass
class Loaded:
    keys: list[str]
    queried_tokens: int  # the hit the query thread (batch_exists_v2) reported
    hit_tokens: int  # tokens loaded into host pages by the prefetch-IO thread
    pool_hits: dict[str, int]  # the sidecar (non-KV-derived) pools' loaded pages, from the ack
    pool_pages: dict[str, list[bytes]] = field(default_factory=dict)  # per pool, the loaded pages' bytes

    @property
    def hit_pages(self) -> int:
        return self.hit_tokens // PAGE_TOKENS


class FakeDeviceAllocator:
    """The GPU token allocator, as far as the HiCache stack and controller use it."""

    def __init__(self, kvcache: Any, full_tokens: int) -> None:
        self._kvcache = kvcache
        self.size_full = full_tokens
        self.size = full_tokens
        self.swa_attn_allocator = self  # the swa entry takes its alloc/free (never called here)
        self.c128_attn_allocator = None

    def get_kvcache(self) -> Any:
        return self._kvcache

    def set_hicache_transfer_done_event(self, key: Any, event: Any) -> None:
        pass

    def alloc(self, need_size: int) -> torch.Tensor | None:
        raise AssertionError("the harness never allocates device slots through the controller")

    def free(self, indices: torch.Tensor) -> None:
        raise AssertionError("the harness never frees device slots through the controller")


class _Handle:
    """A request as the prefetch path sees it (``CacheRequestHandle``: its ``rid``)."""

    _count = 0

    def __init__(self) -> None:
        _Handle._count += 1
        self.rid = f"harness-{_Handle._count}"


class _TreeCache:
    """What the DSV4 strategy reads from ``UnifiedRadixCache``: its components and its host evictor."""

    def __init__(self, components: set[Any]) -> None:
        self.components = {c: None for c in components}

    def evict_host(self, num_tokens: int, component: Any = None) -> int:
        return 0  # nothing to evict: the harness frees what it allocates


def server_argv(family: Family, storage_backend: str, extra_config: dict[str, Any], *, replay: bool,
                hicache_ratio: float, mem_layout: str = "page_first") -> list[str]:
    argv = ["--model-path", "dummy", "--served-model-name", SERVED_MODEL, "--device", "cpu",
            "--page-size", str(PAGE_TOKENS),
            "--enable-hierarchical-cache", "--hicache-mem-layout", mem_layout,
            "--hicache-ratio", str(hicache_ratio), "--hicache-write-policy", "write_through",
            "--hicache-storage-backend", storage_backend,
            "--hicache-storage-backend-extra-config", json.dumps(extra_config), *family.flags]
    if replay:
        argv.append("--enable-encoder-swa-bounded-replay")
    return argv


def stop_orphaned_storage_threads() -> int:
    """Stop the storage threads of controllers nobody holds any more, and return how many there were.

    A backend that raises in ``register_mem_host_pool_v2`` or ``on_host_pools_registered`` fails the engine's
    start (the exception leaves ``Engine(...)``), but SGLang registers those pools after the base attach has
    started the controller's four storage threads, and does not stop them on that failure."""
    from sglang.srt.managers.cache_controller import HiCacheController

    def orphan(thread: threading.Thread) -> Any:
        owner = getattr(getattr(thread, "_target", None), "__self__", None)
        if isinstance(owner, HiCacheController) and not getattr(owner, "_harness_owned", False):
            return owner
        return None

    owners = [owner for t in threading.enumerate() if (owner := orphan(t)) is not None]
    for controller in {id(c): c for c in owners}.values():
        controller._stop_storage_threads()
    return len(owners)


class Engine:
    """One engine's HiCache side: SGLang's V4.1 device pools, its DSV4 host stack and controller, attached
    to an L3 backend. ``replay=False`` builds the stack as a deployment without
    ``--enable-encoder-swa-bounded-replay`` does (an ``swa`` pool is registered with the backend)."""

    def __init__(self, family: str, storage_backend: str, extra_config: dict[str, Any], *, replay: bool = True,
                 device_pages: int = 12, hicache_ratio: float = 2.0, prefetch_threshold: int | None = None,
                 mem_layout: str = "page_first") -> None:
        _patch_gpu_paths()
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _select_strategy
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.runtime_context import get_memory, get_serving

        self.family = FAMILIES[family]
        config = dict(extra_config)
        if prefetch_threshold is not None:
            config["prefetch_threshold"] = prefetch_threshold
        self.server_args = prepare_server_args(
            server_argv(self.family, storage_backend, config, replay=replay, hicache_ratio=hicache_ratio,
                        mem_layout=mem_layout))
        runtime_context.publish(self.server_args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0))
        memory = get_memory()
        (storage_extra, self.prefetch_threshold, _, _, self.pass_prefix_keys) = (
            HybridCacheController.parse_storage_backend_extra_config(memory.hicache_storage_backend_extra_config))

        with _device_capability(self.family.capability):
            kv_layout, compressed_option = dsv4_pool.select_dsv4_kv_layout()
        full_tokens = device_pages * PAGE_TOKENS
        self.kvcache = dsv4_pool.DeepSeekV4TokenToKVPool(
            max_num_reqs=2, num_req_slots=3, swa_size=full_tokens, c4_size=0, c128_size=0, c4_state_pool_size=0,
            c128_state_pool_size=0, page_size=PAGE_TOKENS, swa_page_size=PAGE_TOKENS,
            sliding_window=V41_SLIDING_WINDOW, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
            c128_state_dtype=torch.float32, qk_nope_head_dim=V41_QK_NOPE_HEAD_DIM,
            qk_rope_head_dim=V41_QK_ROPE_HEAD_DIM, indexer_head_dim=V41_INDEX_HEAD_DIM,
            layer_num=len(V41_COMPRESS_RATIOS), start_layer=0, end_layer=len(V41_COMPRESS_RATIOS),
            device="cpu", enable_memory_saver=False,
            compression_ratios=list(V41_COMPRESS_RATIOS), kv_source_layers=list(V41_KV_SOURCE_LAYERS),
            full_size=full_tokens, kv_layout=kv_layout, compressed_kv_layout=compressed_option)
        self.kv_layout = kv_layout
        self.allocator = FakeDeviceAllocator(self.kvcache, full_tokens)
        self.device_pages = device_pages

        from sglang.srt.mem_cache.cache_init_params import CacheInitParams

        params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.allocator,
                                 page_size=PAGE_TOKENS)
        components = {ComponentType.FULL}
        if self.kvcache.swa_kv_pool is not None:
            components.add(ComponentType.SWA)
        tree = _TreeCache(components)
        strategy = _select_strategy(self.kvcache, components)
        self.strategy_name = type(strategy).__name__
        self.load_cache_event = threading.Event()
        result = strategy.build(cache=tree, kvcache=self.kvcache, params=params, server_args=self.server_args,
                                load_cache_event=self.load_cache_event, storage_backend=memory.hicache_storage_backend,
                                storage_backend_extra_config=storage_extra,
                                prefetch_threshold=self.prefetch_threshold,
                                model_name=get_serving().served_model_name)  # as SGLang's assembler passes it
        self.host_pool_group = result.host_pool_group
        self.controller = result.cache_controller
        self.controller._harness_owned = True
        self.sidecars = list(result.sidecars)
        self._closed = False

    # -- introspection ----------------------------------------------------------------------------

    @property
    def storage_backend(self) -> Any:
        return self.controller.storage_backend

    def pool_names(self) -> list[str]:
        return [str(entry.name.value) for entry in self.host_pool_group.entries]

    def geometry(self) -> dict[str, PoolGeometry]:
        policies = {str(s.pool_name.value): str(s.hit_policy.value) for s in self.sidecars}
        out = {}
        for entry in self.host_pool_group.entries:
            pool = entry.host_pool
            name = str(entry.name.value)
            if not hasattr(pool, "item_bytes"):
                continue  # the kv anchor: a LogicalHostPool without data
            out[name] = PoolGeometry(name, pool.layer_num, pool.item_bytes, pool.page_size,
                                     getattr(pool, "num_host_pages", 0), policies.get(name, "component"))
        return out

    def _data_entries(self) -> list[Any]:
        """The KV-derived sidecar pools (the ones written per KV page): name -> host pool entry."""
        names = {s.pool_name for s in self.sidecars if str(s.indices_from_pool.value) == "kv"}
        return [e for e in self.host_pool_group.entries if e.name in names]

    def _sidecar_transfers(self, keys: list[str] | None) -> list[Any]:
        """``UnifiedRadixCache._build_sidecar_transfers``: one PoolTransfer per KV-derived sidecar spec."""
        from sglang.srt.mem_cache.hicache_storage import PoolTransfer

        return [PoolTransfer(name=s.pool_name, keys=keys, hit_policy=s.hit_policy,
                             indices_from_pool=s.indices_from_pool)
                for s in self.sidecars if str(s.indices_from_pool.value) == "kv"]

    # -- the operations ---------------------------------------------------------------------------

    def write_through(self, tokens: Sequence[int], cache_salt: str | None = None, *, after: int = 0,
                      timeout: float = 30.0) -> Stored:
        """Fill the device pages of ``tokens`` (whole pages) with bytes derived from each page's key, write them
        to host (``controller.write``, emulated copy) and then to L3 (``write_storage`` -> backup thread).
        ``after``: pages of ``tokens`` the tree holds already (an earlier turn's node): only the pages after
        them are written, as the radix tree backs up a child node, with the earlier pages' keys as
        ``prefix_keys`` when ``hicache_storage_pass_prefix_keys`` is set (``[]`` for a child of the root)."""
        chain = page_keys(tokens, cache_salt)
        keys = chain[after:]
        if not keys:
            raise ValueError("no whole page")
        if len(keys) >= self.device_pages:
            raise ValueError(f"{len(keys)} pages do not fit the {self.device_pages}-page device pool")
        device_pages = list(range(1, len(keys) + 1))  # page 0 is the allocator's padding page
        written: dict[str, list[bytes]] = {}
        for entry in self._data_entries():
            pool, name = entry.host_pool, str(entry.name.value)
            written[name] = []
            for page, key in zip(device_pages, keys, strict=True):
                data = expected_page_bytes(name, key, pool.layer_num, pool.item_bytes)
                rows = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(pool.layer_num, pool.item_bytes)
                for layer in range(pool.layer_num):
                    _row_view(pool.device_buffers[layer])[page] = rows[layer]
                written[name].append(data)
        device_indices = torch.cat([torch.arange(p * PAGE_TOKENS, (p + 1) * PAGE_TOKENS, dtype=torch.int64)
                                    for p in device_pages])
        cc = self.controller
        host_indices = cc.write(device_indices, node_id=1, extra_pools=self._sidecar_transfers(keys))
        if host_indices is None:
            raise RuntimeError("host pool full")
        for ack in list(cc.ack_write_queue):
            ack.finish_event.synchronize()
        cc.ack_write_queue.clear()
        span = tokens[after * PAGE_TOKENS:len(chain) * PAGE_TOKENS]
        prefix = chain[:after] if self.pass_prefix_keys else None
        op_id = cc.write_storage(host_indices, radix_key(span, cache_salt), keys, prefix,
                                 extra_pools=self._sidecar_transfers(keys))
        operation = self._wait_backup(op_id, timeout)
        results = {str(k.value) if hasattr(k, "value") else str(k): v
                   for k, v in (operation.pool_storage_result.extra_pool_hit_pages or {}).items()}
        cc.mem_pool_host.free(host_indices)
        return Stored(keys, operation.completed_tokens, results, written)

    def _wait_backup(self, op_id: int, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                operation = self.controller.ack_backup_queue.get(timeout=0.05)
            except Empty:
                continue
            if operation.id == op_id:
                return operation
        raise TimeoutError("the backup thread did not acknowledge the storage write")

    def prefetch(self, tokens: Sequence[int], cache_salt: str | None = None, *, timeout: float = 30.0) -> Loaded:
        """Prefetch ``tokens`` from L3 into fresh host pages through the controller's prefetch path, as the
        radix cache's scheduler loop drives it, and read back the loaded pages' bytes."""
        keys = page_keys(tokens, cache_salt)
        whole = len(keys) * PAGE_TOKENS
        cc = self.controller
        operation = cc.prefetch(_Handle(), radix_key(tokens[:whole], cache_salt), None, None,
                                extra_pools=self._sidecar_transfers(None))
        deadline = time.monotonic() + timeout
        hit = self._drain(cc.prefetch_hit_queue, operation, deadline)
        queried = hit.storage_hit_count
        if queried < self.prefetch_threshold or operation.is_terminated():
            return Loaded(keys, queried, 0, {})
        host_indices, alloc_len = cc.allocate_storage_hit(operation, queried, allow_partial=True,
                                                          min_tokens=self.prefetch_threshold,
                                                          evict_host=lambda n: 0)
        if host_indices is None:
            raise RuntimeError("no host space for the prefetch")
        operation.storage_hit_count = alloc_len
        operation.hash_value = operation.hash_value[: alloc_len // PAGE_TOKENS]
        operation.host_indices = host_indices
        cc.prefetch_buffer.put(operation)
        completed, pool_hits = 0, {}
        while True:
            ack = self._drain(cc.ack_prefetch_queue, operation, deadline)
            if ack.completed_tokens is not None:
                completed = ack.completed_tokens
            if ack.pool_hits:  # the reduced per-pool counts of the non-kv-derived sidecars (none under replay)
                pool_hits.update({name: v for k, v in ack.pool_hits.items()
                                  if (name := str(getattr(k, "value", k))) in self.pool_names()})
            if ack.completed_req:
                break
        loaded = Loaded(keys, queried, completed, pool_hits)
        pages = completed // PAGE_TOKENS
        for entry in self._data_entries():
            pool = entry.host_pool
            rows = pool._to_page_indices(host_indices[: pages * PAGE_TOKENS]) if pages else []
            loaded.pool_pages[str(entry.name.value)] = [  # the pool's own gather: page_first or layer_first
                pool.get_data_page(int(r) * PAGE_TOKENS, flat=True).contiguous().numpy().tobytes() for r in rows]
        cc.mem_pool_host.free(host_indices)
        return loaded

    @staticmethod
    def _drain(queue: Any, operation: Any, deadline: float) -> Any:
        while time.monotonic() < deadline:
            try:
                item = queue.get(timeout=0.05)
            except Empty:
                continue
            if getattr(item, "operation", item) is operation:
                return item
        raise TimeoutError("the controller's threads did not answer in time")

    def close(self) -> None:
        """Stop the controller's storage threads and close the backend (``detach_storage_backend``)."""
        if not self._closed:
            self._closed = True
            if self.controller.enable_storage:
                self.controller.detach_storage_backend()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
