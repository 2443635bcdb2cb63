"""kvstore as a secondary tier of vLLM 0.33's OffloadingConnector (its ``TieringOffloadingSpec``).

Loaded by vLLM from its tier config, no vLLM patch::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8e9,
        "secondary_tiers": [{"type": "KVStoreTier", "module_path": "kvstore.engines.vllm.tier",
                             "address": "127.0.0.1:50151", "namespace": "team-a"}]}}'

vLLM keeps only the prefix-cacheable groups in its CPU primary tier (for DeepSeek-V4.1 its planner
makes one: the compressed main KV and indexer K of the kv-source layers, packed by spec in one
padded block; the SWA window is never offloaded and vLLM replays the last 128 tokens itself), and
hands this tier byte blocks of that primary, one per ``OffloadKey`` (block hash + group). Each
becomes one page blob (``kvstore/format/page.py``) of the block's pages, as ``geometry.py`` derives
them from vLLM's OffloadingConfig (the stride's padding is not stored), under a key that hashes the
tenant's namespace, the engine's page layout (its fingerprint: model, the cache and indexer dtypes
vLLM uses, block size, parallelism) and the block hash, so blocks are never served across tenants
or engine configurations. A block no derived layout fits is stored whole as one opaque page:
``stats.opaque_blocks`` counts them and the tier says why once, at start.

Everything the scheduler calls is non-blocking:

- ``lookup``: answered from a per-step batch (vLLM's ``AsyncLookupManager``): one ``LookupKeys``
  call per tenant and step on a background thread, RETRY until it lands;
- ``submit_store`` / ``submit_load``: jobs on background threads; a store is one turn save (the
  job's page blobs and the request's page session, one durable transaction); a load writes each
  verified blob straight from the daemon's answer (the client's shared-memory arena when the daemon
  is on this host) into the primary's slot: one copy;
- a daemon that cannot be reached makes lookups misses and jobs failures for ``down_s`` seconds
  (no call is tried meanwhile): vLLM recomputes, never waits, never sees an exception.

Settings (keys of the tier's config, beside ``type`` and ``module_path``): ``address`` (the daemon,
default ``$KVSTORE_ADDRESS`` or 127.0.0.1:50151), ``namespace`` and ``token`` (the default tenant),
``tenants``, ``session_ttl_s`` (86400; 0 = kept until deleted), ``indexer_dtype`` (``mxfp4`` or
``fp8``; unset: the one whose pages fill vLLM's block, which is needed only when the block has room
for either), ``n_load_threads`` / ``n_store_threads`` (2 each), ``timeout_s`` (10, per call), ``down_s`` (5),
``arena_bytes`` (32 MiB of shared memory per job thread and tenant), ``enable_kv_events`` (BlockStored
events for what stores saved, when vLLM publishes KV events), ``locality``, ``backpressure``
(vLLM's own detector, which sees this tier's job results).

Tenants: a request sends its tenant's salt twice, as vLLM's ``cache_salt`` (which seeds vLLM's block
hashes, so its GPU and CPU caches and every OffloadKey are the tenant's own) and as
``kv_transfer_params["cache_salt"]`` (or ``"kvstore_tenant"``), which names an entry of the
``tenants`` map (``{"salt": {"namespace": ..., "token": ...}}``): the namespace and token its blocks
are kept under. vLLM 0.33 hands a tier ``kv_transfer_params`` and ``kv_hints``, never ``cache_salt``,
so the tier cannot compare the two: a request whose two disagree finds its own ``cache_salt``'s
blocks in vLLM's caches and none in kvstore (its keys are another tenant's hashes), and its new
blocks are kept in the namespace its ``kv_transfer_params`` names. Requests without a salt use the
tier's own ``namespace``/``token``; an unknown salt is never offloaded. ``kvstore_session`` names
the page session a request's blocks are kept under (an agent's conversation across turns; default:
one session per request), with the retention ``session_ttl_s`` (``kvstore evict`` / ``prefetch``
/ retention apply to it as to any session).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import vllm
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from kvstore.engines.pages.daemon import DaemonLink
from kvstore.engines.pages.sessions import Tenant, block_key
from kvstore.engines.vllm.geometry import INDEXER_DTYPES, Derived, EngineGroup, derive
from kvstore.engines.vllm.sessions import Sessions
from kvstore.engines.vllm.transfer import Transfer
from kvstore.errors import KvstoreError
from kvstore.format.manifest import Retention

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

log = logging.getLogger(__name__)
TESTED_VLLM = ("0.33.0",)


@dataclass
class TierStats:
    """What the tier did, for its user: ``opaque_blocks`` counts blocks stored whole because no derived page
    layout fits vLLM's (``geometry.py``): 0 for every layout vLLM's planner makes for V4.1."""

    blocks_stored: int = 0
    opaque_blocks: int = 0


def _model_shape(model: str) -> tuple[list[int] | None, int]:
    """The model's per-layer compression ratios and indexer head size, as vLLM read its config
    (None: not read, so every block is opaque)."""
    try:
        from vllm.transformers_utils.config import get_config

        hf = get_config(model, trust_remote_code=False)
    except Exception as e:  # an engine without this model's config here: opaque blocks, said once
        log.warning("kvstore tier: the config of %r could not be read (%s)", model, e)
        return None, 128
    ratios = getattr(hf, "compress_ratios", None)
    return ([int(r) for r in ratios] if ratios is not None else None), int(getattr(hf, "index_head_dim", 128))


class _Lookups(AsyncLookupManager):
    """vLLM's async lookups (a step's keys resolved on a background thread between steps), asked of
    the daemon in one ``LookupKeys`` call per tenant and step, not one per request.

    Why ``_worker`` is overridden (vLLM 0.33's private loop, copied with its grouping changed):
    vLLM's only public hook, ``batch_lookup(keys, req_context)``, is called once per request of a
    step, so N requests waiting on the same prefix cost N daemon round trips; nothing public hands
    a tier the step's whole batch. ``tests/engines/vllm_tier`` pins the loop's contract (one call per
    tenant and step; results as (key, generation, found))."""

    def __init__(self, tier: KVStoreTier, tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._lookup_keys(self._tier.sessions.tenant(req_context), keys)

    def _worker(self) -> None:
        while True:
            pending = self._lookup_queue.get()
            if pending is None:
                break
            by_tenant: dict[Tenant | None, list[tuple[OffloadKey, int]]] = {}
            for key, ctx, generation in pending:
                by_tenant.setdefault(self._tier.sessions.tenant(ctx), []).append((key, generation))
            results: list[tuple[OffloadKey, int, bool]] = []
            for tenant, entries in by_tenant.items():
                keys = list(dict.fromkeys(k for k, _ in entries))
                found = dict(zip(keys, self._tier._lookup_keys(tenant, keys)))
                results.extend((k, g, found[k]) for k, g in entries)
            if results:
                self._pending_results.put(results)


class KVStoreTier(SecondaryTierManager):
    """The SecondaryTierManager hooks: lookups, jobs and their results, requests' lifetimes.
    Tenants and page sessions are ``sessions.py``'s, the bytes' movement ``transfer.py``'s, the
    page layout ``geometry.py``'s."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 address: str = "", namespace: str = "vllm", token: str = "",
                 tenants: dict[str, dict[str, str]] | None = None, session_ttl_s: float = 86400.0,
                 indexer_dtype: str | None = None, n_load_threads: int = 2,
                 n_store_threads: int = 2, timeout_s: float = 10.0, down_s: float = 5.0, arena_bytes: int = 32 << 20,
                 enable_kv_events: bool = False, locality: str | None = None,
                 backpressure_detector: BackpressureDetector | None = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.geometry = self._layout(offloading_spec.config, indexer_dtype)
        self.layout = self.geometry.layout
        self.stats = TierStats()
        if self.geometry.opaque:  # shown once, counted per block stored (``stats``)
            log.warning("kvstore tier: vLLM's blocks match no derived page layout (%s): each is stored whole as one "
                        "opaque page (verified, no scale compression, block padding kept)", self.geometry.reason)
        self.daemon = DaemonLink(address, self.layout, timeout_s, down_s, arena_bytes, log)
        mapped = {salt: Tenant(t["namespace"], t.get("token", "")) for salt, t in (tenants or {}).items()}
        self.sessions = Sessions(self.layout, Tenant(namespace, token), mapped,
                                 Retention(ttl_s=session_ttl_s if session_ttl_s > 0 else None))
        self.transfer = Transfer(self.layout, primary_kv_view, self.block_size_bytes, self.daemon, self.sessions)
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._load_keys: dict[JobId, list[OffloadKey]] = {}
        self._pending = 0
        self._idle = threading.Condition()
        self._loads = ThreadPoolExecutor(n_load_threads, thread_name_prefix="kvstore_tier_load")
        self._stores = ThreadPoolExecutor(n_store_threads, thread_name_prefix="kvstore_tier_store")
        self._lookups = _Lookups(self, tier_type)
        # every job thread's client and the lookup client connected now, off the engine's thread: a
        # restarted engine's first lookups and loads do not pay for a connection, an arena and the layout
        for pool, role, n in ((self._loads, "load", n_load_threads), (self._stores, "store", n_store_threads)):
            for _ in range(n):
                pool.submit(self.daemon.warm, self.sessions.default, role)
        self._loads.submit(self.daemon.warm, self.sessions.default, "lookup")
        # KV events (BlockStored for what a store job saved), as vLLM's fs tier emits them: only when vLLM
        # publishes KV cache events at all
        self._events: list[OffloadingEvent] | None = (
            [] if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events else None)
        self._store_keys: dict[JobId, list[OffloadKey]] = {}
        if locality is not None:
            from vllm.v1.kv_offload.base import Locality
            self.locality = Locality(locality)

    @property
    def default(self) -> Tenant:
        return self.sessions.default

    @property
    def tenants(self) -> dict[str, Tenant]:
        return self.sessions.tenants

    # -- geometry ---------------------------------------------------------------------------------
    def _layout(self, cfg: Any, indexer_dtype: str | None) -> Derived:
        """The page layout of this engine's chunks, from its OffloadingConfig and its model's config."""
        copies = 1 if cfg.replicated_layout else max(1, cfg.parallel.world_size)
        stride = cfg.worker_kv_bytes_per_block * copies
        if not 0 < stride * cfg.cache.blocks_per_chunk <= self.block_size_bytes:
            stride = self.block_size_bytes // cfg.cache.blocks_per_chunk
        # an OffloadKey names its group by the KV cache config's group id (the scheduler's group_idx), not by
        # its place among the offloaded groups: V4.1's SWA groups are not offloaded but keep their ids
        groups = [EngineGroup(g.group_id, g.tokens_per_block, tuple(g.layer_names)) for g in cfg.groups]
        p = cfg.parallel
        fingerprint = {"tokens_per_hash": str(cfg.cache.tokens_per_hash), "tp_size": str(p.tp_size),
                       "tp_rank": "0" if cfg.replicated_layout else str(p.rank), "pp_size": str(p.pp_size),
                       "pcp_size": str(p.pcp_size), "dcp_size": str(p.dcp_size), "world_size": str(p.world_size),
                       "replicated": str(bool(cfg.replicated_layout)).lower(),
                       "canonical": str(bool(cfg.canonical_layout)).lower(), "engine_version": vllm.__version__}
        dtype = cfg.model.dtype  # ``auto`` / ``fp8`` arrive unresolved (as the model's dtype): geometry.py tries both
        ratios, head_dim = _model_shape(cfg.model.name)
        # the canonical byte layout, several TP copies per chunk: arrangements this derivation does not know
        direct = not cfg.canonical_layout and copies == 1
        sm100 = current_platform.is_device_capability_family(100)  # V4.1's own records (attention.py)
        return derive(cfg.model.name, dtype if direct else f"{dtype}+opaque", sm100, groups, stride,
                      cfg.cache.blocks_per_chunk, ratios, fingerprint,
                      INDEXER_DTYPES if indexer_dtype is None else (indexer_dtype,), head_dim)

    def _key(self, tenant: Tenant, key: OffloadKey) -> bytes:
        return block_key(self.layout, tenant, get_offload_group_idx(key), get_offload_block_hash(key))

    # -- scheduler side ---------------------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self.sessions.of_request(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self.sessions.of_request(req_context) is None or not self.daemon.available():
            return LookupResult.MISS
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        if found:
            return LookupResult.HIT
        return LookupResult.MISS

    def _lookup_keys(self, tenant: Tenant | None, keys: list[OffloadKey]) -> list[bool]:
        """Which of ``keys`` the daemon holds for ``tenant`` (the lookup thread; a failure is misses)."""
        if tenant is None or not self.daemon.available():
            return [False] * len(keys)
        try:
            pkeys = [self._key(tenant, k) for k in keys]
            where = self.daemon.client(tenant, "lookup").lookup_keys(tenant.namespace, pkeys)
        except Exception as e:  # any failure is misses, never the engine's exception
            self.daemon.failed("a lookup", e)
            return [False] * len(keys)
        return [w is not None for w in where]

    def submit_store(self, job_metadata: TransferJob) -> None:
        s = self.sessions.of_request(job_metadata.req_context)
        keys = list(job_metadata.keys)
        cids = [int(c) for c in job_metadata.chunk_ids]
        ctx = job_metadata.req_context
        ends = [ctx.get_offload_key_position(k) for k in keys]
        if self._events is not None:
            self._store_keys[job_metadata.job_id] = keys
        self.stats.blocks_stored += len(keys)
        if self.geometry.opaque:
            self.stats.opaque_blocks += len(keys)
        self._start()
        self._stores.submit(self._run, job_metadata.job_id, len(keys), self.transfer.store, s, keys, cids, ends)

    def submit_load(self, job_metadata: TransferJob) -> None:
        s = self.sessions.of_request(job_metadata.req_context)
        keys = list(job_metadata.keys)
        self._load_keys[job_metadata.job_id] = keys
        cids = [int(c) for c in job_metadata.chunk_ids]
        self._start()
        self._loads.submit(self._run, job_metadata.job_id, len(keys), self.transfer.load, s, keys, cids)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out: list[JobResult] = []
        while True:
            try:
                res = self._finished.get_nowait()
            except queue.Empty:
                return out
            keys = self._load_keys.pop(res.job_id, None)
            if keys is not None and not res.success:  # the lookups of what failed to load are misses now
                ok = set(res.successful_keys or ())
                self._lookups.mark_miss([k for k in keys if k not in ok])
            stored = self._store_keys.pop(res.job_id, None)
            if stored and res.success and self._events is not None:  # a router learns what this tier holds
                self._events.append(OffloadingEvent(keys=stored, medium=self.medium, removed=False,
                                                    locality=self.locality))
            out.append(res)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is not None:
            events, self._events = self._events, []
            yield from events

    def has_pending_work(self) -> bool:
        return self._pending > 0

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)
        self.sessions.finished(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def drain_jobs(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def shutdown(self) -> None:
        self.drain_jobs()
        self._lookups.shutdown()
        self._loads.shutdown(wait=True)
        self._stores.shutdown(wait=True)
        self.daemon.close()

    # -- jobs (background threads) ----------------------------------------------------------------
    def _start(self) -> None:
        with self._idle:
            self._pending += 1

    def _run(self, job_id: JobId, n: int, fn: Any, *args: Any) -> None:
        t0 = time.perf_counter()
        done: list[OffloadKey] | None = None
        try:
            ok, done = fn(*args)
        except Exception as e:  # any failure is the job's, never the engine's
            if isinstance(e, (KvstoreError, OSError)):
                self.daemon.failed(f"job {job_id}", e)
            else:
                log.exception("kvstore tier: job %d failed", job_id)
            ok = False
        partial = None if ok else (tuple(done) if done else None)
        self._finished.put(JobResult(job_id, ok, partial, time.perf_counter() - t0, n * self.block_size_bytes))
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()


__all__ = ["TESTED_VLLM", "KVStoreTier", "Tenant", "TierStats"]
