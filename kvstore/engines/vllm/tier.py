"""kvstore as a secondary tier of vLLM 0.33's OffloadingConnector (its ``TieringOffloadingSpec``).

Loaded by vLLM from its tier config, no vLLM patch::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8e9,
        "secondary_tiers": [{"type": "KVStoreTier", "module_path": "kvstore.engines.vllm.tier",
                             "address": "127.0.0.1:50151", "namespace": "team-a"}]}}'

vLLM keeps only the prefix-cacheable groups in its CPU primary tier (for DeepSeek-V4.1: the
compressed main KV and indexer K of the kv-source layers; the SWA window is never offloaded and
vLLM replays the last 128 tokens itself), and hands this tier byte blocks of that primary, one per
``OffloadKey`` (block hash + group). Each becomes one page blob (``kvstore/format/page.py``) under a key
that hashes the tenant's namespace, the engine's page layout (its fingerprint: model, cache dtypes,
block size, parallelism) and the block hash, so blocks are never served across tenants or engine
configurations. Everything the scheduler calls is non-blocking:

- ``lookup``: answered from a per-step batch (vLLM's ``AsyncLookupManager``): one ``LookupKeys``
  call per request per step on a background thread, RETRY until it lands;
- ``submit_store`` / ``submit_load``: jobs on background threads; a store is one turn save (the
  job's page blobs and the request's page session, one durable transaction); a load writes each
  verified blob straight from the daemon's answer (the client's shared-memory arena when the daemon
  is on this host) into the primary's slot: one copy;
- a daemon that cannot be reached makes lookups misses and jobs failures for ``down_s`` seconds
  (no call is tried meanwhile): vLLM recomputes, never waits, never sees an exception.

Settings (keys of the tier's config, beside ``type`` and ``module_path``): ``address`` (the daemon,
default ``$KVSTORE_ADDRESS`` or 127.0.0.1:50151), ``namespace`` and ``token`` (the default tenant),
``tenants``, ``session_ttl_s`` (86400; 0 = kept until deleted), ``indexer_dtype`` (``mxfp4`` or
``fp8``: the engine's indexer cache), ``mxfp8_record`` (V4.1's 528-B fp8_ds_mla record, SM100),
``n_load_threads`` / ``n_store_threads`` (2 each), ``timeout_s`` (10, per call), ``down_s`` (5),
``arena_bytes`` (32 MiB of shared memory per job thread and tenant), ``enable_kv_events`` (BlockStored
events for what stores saved, when vLLM publishes KV events), ``locality``, ``backpressure``
(vLLM's own detector, which sees this tier's job results).

Tenants: ``kv_transfer_params["cache_salt"]`` (or ``"kvstore_tenant"``) names an entry of the
``tenants`` map (``{"salt": {"namespace": ..., "token": ...}}``); requests without one use the
tier's own ``namespace``/``token``; an unknown salt is never offloaded. ``kvstore_session`` names
the page session a request's blocks are kept under (an agent's conversation across turns; default:
one session per request), with the retention ``session_ttl_s`` (``kvstore evict`` / ``prefetch``
/ retention apply to it as to any session).
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import vllm
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

from kvstore.client import Client
from kvstore.engines.vllm.geometry import EngineGroup, page_layout
from kvstore.errors import FailedPrecondition, KvstoreError, NotFound, Unavailable
from kvstore.format import page
from kvstore.format.manifest import Manifest, Retention
from kvstore.format.page_layout import GroupSpec, PageLayout

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

log = logging.getLogger(__name__)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:\-]")
#: Page sessions whose keys a tier remembers (older ones are read back from the daemon when saved again).
MAX_SESSIONS = 4096
TESTED_VLLM = ("0.33.0",)


@dataclass(frozen=True)
class Tenant:
    namespace: str
    token: str = ""


@dataclass
class _Session:
    """A page session as this tier last saved it: every block key it names, in the order saved.

    A session only grows: each save names everything the last one did plus the new blocks, so a
    turn whose prefix stayed in vLLM's CPU tier (and was never looked up here) frees nothing. The
    first save in this process starts from the daemon's version, if there is one."""

    tenant: Tenant
    session_id: str
    held: dict[bytes, int] = field(default_factory=dict)  # page key -> end token (0: not known here)
    loaded: bool = False  # the daemon's version was read
    version: int = 0  # the version last saved or read: the base of the next save, whichever thread makes it
    lock: threading.Lock = field(default_factory=threading.Lock)  # one turn save at a time


class _Lookups(AsyncLookupManager):
    """vLLM's async lookups (a step's keys resolved on a background thread between steps), asked of
    the daemon in one ``LookupKeys`` call per tenant and step, not one per request: the base class's
    worker loop (vLLM 0.33) with its per-request grouping replaced."""

    def __init__(self, tier: KVStoreTier, tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._lookup_keys(self._tier._tenant(req_context), keys)

    def _worker(self) -> None:
        while True:
            pending = self._lookup_queue.get()
            if pending is None:
                break
            by_tenant: dict[Tenant | None, list[tuple[OffloadKey, int]]] = {}
            for key, ctx, generation in pending:
                by_tenant.setdefault(self._tier._tenant(ctx), []).append((key, generation))
            results: list[tuple[OffloadKey, int, bool]] = []
            for tenant, entries in by_tenant.items():
                keys = list(dict.fromkeys(k for k, _ in entries))
                found = dict(zip(keys, self._tier._lookup_keys(tenant, keys)))
                results.extend((k, g, found[k]) for k, g in entries)
            if results:
                self._pending_results.put(results)


class KVStoreTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 address: str = "", namespace: str = "vllm", token: str = "",
                 tenants: dict[str, dict[str, str]] | None = None, session_ttl_s: float = 86400.0,
                 indexer_dtype: str = "mxfp4", mxfp8_record: bool = False, n_load_threads: int = 2,
                 n_store_threads: int = 2, timeout_s: float = 10.0, down_s: float = 5.0, arena_bytes: int = 32 << 20,
                 enable_kv_events: bool = False, locality: str | None = None,
                 backpressure_detector: BackpressureDetector | None = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        cfg = offloading_spec.config
        self.address = address
        self.default = Tenant(namespace, token)
        self.tenants = {salt: Tenant(t["namespace"], t.get("token", "")) for salt, t in (tenants or {}).items()}
        self.retention = Retention(ttl_s=session_ttl_s if session_ttl_s > 0 else None)
        self.timeout_s = timeout_s
        self.arena_bytes = arena_bytes  # per job thread and tenant, when the daemon is on this host
        self.down_s = down_s
        self._down_until = 0.0
        self.layout = self._layout(cfg, indexer_dtype, mxfp8_record)
        self._flat = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 else primary_kv_view
        self._clients: dict[tuple[Tenant, str, int], Client] = {}
        self._clients_lock = threading.Lock()
        self._registered: set[Tenant] = set()  # page layouts are per namespace: registered by each tenant
        #: each request's page session; None: its tenant is unknown, it is never offloaded
        self._requests: dict[str, _Session | None] = {}
        self._sessions: OrderedDict[tuple[Tenant, str], _Session] = OrderedDict()  # the most recent MAX_SESSIONS
        self._sessions_lock = threading.Lock()  # job threads and the scheduler both reach sessions
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._load_keys: dict[JobId, list[OffloadKey]] = {}
        self._pending = 0
        self._idle = threading.Condition()
        self._loads = ThreadPoolExecutor(n_load_threads, thread_name_prefix="kvstore_tier_load")
        self._stores = ThreadPoolExecutor(n_store_threads, thread_name_prefix="kvstore_tier_store")
        self._lookups = _Lookups(self, tier_type)
        self._local = threading.local()  # each store thread's encode buffer
        # KV events (BlockStored for what a store job saved), as vLLM's fs tier emits them: only when vLLM
        # publishes KV cache events at all
        self._events: list[OffloadingEvent] | None = (
            [] if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events else None)
        self._store_keys: dict[JobId, list[OffloadKey]] = {}
        if locality is not None:
            from vllm.v1.kv_offload.base import Locality
            self.locality = Locality(locality)

    # -- geometry ---------------------------------------------------------------------------------
    def _layout(self, cfg: Any, indexer_dtype: str, mxfp8_record: bool) -> PageLayout:
        """The page layout of this engine's chunks, from its OffloadingConfig (read at run time)."""
        copies = 1 if cfg.replicated_layout else max(1, cfg.parallel.world_size)
        block_bytes = cfg.worker_kv_bytes_per_block * copies * cfg.cache.blocks_per_chunk
        if not 0 < block_bytes <= self.block_size_bytes:
            block_bytes = self.block_size_bytes
        # an OffloadKey names its group by the KV cache config's group id (the scheduler's group_idx), not by
        # its place among the offloaded groups: V4.1's SWA groups are not offloaded but keep their ids
        groups = [EngineGroup(g.group_id, g.tokens_per_block, tuple(g.layer_names)) for g in cfg.groups]
        p = cfg.parallel
        fingerprint = {"tokens_per_hash": str(cfg.cache.tokens_per_hash), "tp_size": str(p.tp_size),
                       "tp_rank": "0" if cfg.replicated_layout else str(p.rank), "pp_size": str(p.pp_size),
                       "pcp_size": str(p.pcp_size), "dcp_size": str(p.dcp_size), "world_size": str(p.world_size),
                       "replicated": str(bool(cfg.replicated_layout)).lower(),
                       "canonical": str(bool(cfg.canonical_layout)).lower(), "engine_version": vllm.__version__}
        # the canonical byte layout, several TP copies per chunk: arrangements geometry.py does not derive, so
        # every block is kept whole (an unknown cache dtype is the same: one opaque page per block)
        direct = not cfg.canonical_layout and copies == 1
        return page_layout(cfg.model.name, cfg.model.dtype if direct else f"{cfg.model.dtype}+opaque", indexer_dtype,
                           groups, block_bytes, cfg.cache.blocks_per_chunk, fingerprint, mxfp8_record=mxfp8_record)

    # -- the daemon -------------------------------------------------------------------------------
    def _client(self, tenant: Tenant, role: str) -> Client:
        """A client of ``tenant`` for this thread: a job thread's own (a zero-copy load reads its
        blobs in the client's arena, which the next call of that client reuses), or the lookup
        thread's, which needs no arena."""
        arena = 0 if role == "lookup" else self.arena_bytes
        with self._clients_lock:
            c = self._clients.get((tenant, role, threading.get_ident()))
            if c is None:
                c = Client(address=self.address, token=tenant.token, timeout_s=self.timeout_s, retries=0,
                           shared_memory=arena > 0, arena_bytes=arena)
                self._clients[(tenant, role, threading.get_ident())] = c
        if tenant not in self._registered:
            c.register_layout(self.layout.definition(), tenant.namespace)
            self._registered.add(tenant)
        return c

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, e: Exception) -> None:
        """A call failed. An unreachable daemon (UNAVAILABLE, a deadline, a socket error) is not
        asked again for ``down_s``: lookups are misses and jobs failures meanwhile, without a call.
        Any other answer (a full disk, a refused blob) fails only its own call: the daemon is up."""
        if not _unreachable(e):
            log.warning("kvstore tier: %s failed: %s: %s", what, type(e).__name__, e)
            return
        if self._available():
            log.warning("kvstore tier: %s failed (%s); treating kvstore as down for %.0f s", what, e, self.down_s)
        self._down_until = time.monotonic() + self.down_s
        self._registered.clear()  # a restarted daemon may be a fresh one

    def _tenant(self, ctx: ReqContext) -> Tenant | None:
        params = ctx.kv_transfer_params or {}
        salt = params.get("kvstore_tenant") or params.get("cache_salt")
        if not salt:
            return self.default
        return self.tenants.get(str(salt))

    def _request(self, ctx: ReqContext) -> _Session | None:
        """The page session of a request (None: not offloaded), made at its first sight."""
        if ctx.req_id not in self._requests:
            params = ctx.kv_transfer_params or {}
            tenant = self._tenant(ctx)
            sid = _session_id(str(params.get("kvstore_session") or f"vllm-{ctx.req_id}"))
            self._requests[ctx.req_id] = self._session(tenant, sid) if tenant else None
        return self._requests[ctx.req_id]

    def _session(self, tenant: Tenant, sid: str) -> _Session:
        with self._sessions_lock:
            s = self._sessions.get((tenant, sid))
            if s is None:
                s = self._sessions[(tenant, sid)] = _Session(tenant, sid)
                while len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
            self._sessions.move_to_end((tenant, sid))
            return s

    def _key(self, tenant: Tenant, key: OffloadKey) -> bytes:
        return page.page_key(self.layout.layout_id, tenant.namespace, get_offload_group_idx(key),
                             get_offload_block_hash(key))

    # -- scheduler side ---------------------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._request(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._request(req_context) is None or not self._available():
            return LookupResult.MISS
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        if found:
            return LookupResult.HIT
        return LookupResult.MISS

    def _lookup_keys(self, tenant: Tenant | None, keys: list[OffloadKey]) -> list[bool]:
        """Which of ``keys`` the daemon holds for ``tenant`` (the lookup thread; a failure is misses)."""
        if tenant is None or not self._available():
            return [False] * len(keys)
        try:
            where = self._client(tenant, "lookup").lookup_keys(tenant.namespace, [self._key(tenant, k) for k in keys])
        except Exception as e:  # any failure is misses, never the engine's exception
            self._failed("a lookup", e)
            return [False] * len(keys)
        return [w is not None for w in where]

    def submit_store(self, job_metadata: TransferJob) -> None:
        s = self._request(job_metadata.req_context)
        keys = list(job_metadata.keys)
        cids = [int(c) for c in job_metadata.chunk_ids]
        ctx = job_metadata.req_context
        ends = [ctx.get_offload_key_position(k) for k in keys]
        if self._events is not None:
            self._store_keys[job_metadata.job_id] = keys
        self._start()
        self._stores.submit(self._run, job_metadata.job_id, len(keys), self._store, s, keys, cids, ends)

    def submit_load(self, job_metadata: TransferJob) -> None:
        s = self._request(job_metadata.req_context)
        keys = list(job_metadata.keys)
        self._load_keys[job_metadata.job_id] = keys
        cids = [int(c) for c in job_metadata.chunk_ids]
        self._start()
        self._loads.submit(self._run, job_metadata.job_id, len(keys), self._load, s, keys, cids)

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
        self._requests.pop(req_context.req_id, None)

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
        with self._clients_lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()

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
                self._failed(f"job {job_id}", e)
            else:
                log.exception("kvstore tier: job %d failed", job_id)
            ok = False
        partial = None if ok else (tuple(done) if done else None)
        self._finished.put(JobResult(job_id, ok, partial, time.perf_counter() - t0, n * self.block_size_bytes))
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def _group(self, key: OffloadKey) -> GroupSpec:
        g = self.layout.group(get_offload_group_idx(key))
        if g is None:
            raise page.PageError(f"vLLM offloads group {get_offload_group_idx(key)}, which this layout lacks")
        return g

    def _slot(self, cid: int, key: OffloadKey) -> memoryview:
        """The bytes of the primary's slot ``cid`` that are ``key``'s group's (geometry.py)."""
        start = cid * self.block_size_bytes
        return self._flat[start : start + self._group(key).block_bytes]

    def _store(self, s: _Session | None, keys: list[OffloadKey], cids: list[int], ends: list[int | None]
               ) -> tuple[bool, None]:
        if s is None or not self._available():
            return False, None
        client = self._client(s.tenant, "store")
        for batch in self._batches(keys):  # a turn save per arena's worth (a long prefill's step is more)
            bkeys = [keys[i] for i in batch]
            pkeys = [self._key(s.tenant, k) for k in bkeys]
            self._save(client, s, pkeys, self._encode(bkeys, pkeys, [cids[i] for i in batch]),
                       [ends[i] for i in batch])
        return True, None

    def _save(self, client: Client, s: _Session, pkeys: list[bytes], blobs: list[memoryview],
              ends: list[int | None]) -> None:
        """One turn save of the session: the new blobs and the manifest naming all it held before."""
        with s.lock:  # a session's turns are saved one after another: each names all the last one did
            for attempt in range(2):
                if not s.loaded:
                    self._catch_up(client, s)
                new = {pk: (end or 0) for pk, end in zip(pkeys, ends) if pk not in s.held}
                fresh = [b for pk, b in zip(pkeys, blobs) if pk in new]
                tokens = max([0, *s.held.values(), *new.values()])
                m = Manifest(s.session_id, s.tenant.namespace, self.layout.layout_id, tokens, 0,
                             (*s.held, *new), b"", (), retention=self.retention,
                             metadata={"engine": "vllm", "model": self.layout.name})
                try:
                    s.version = client.save_session(m, fresh, base=s.version).manifest.generation
                except FailedPrecondition:  # saved meanwhile through another engine or daemon: merge, once
                    if attempt:
                        raise
                    s.loaded = False
                    continue
                s.held.update(new)
                return

    def _encode(self, keys: list[OffloadKey], pkeys: list[bytes], cids: list[int]) -> list[memoryview]:
        """The job's page blobs, encoded into one buffer this thread reuses (a fresh buffer per blob
        would fault in every page; the arena copy that follows reads them while they are warm)."""
        sizes = [page.blob_bytes(self._group(k), len(get_offload_block_hash(k))) for k in keys]
        buf: bytearray | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < sum(sizes):
            buf = self._local.buf = bytearray(sum(sizes))
        view, at, out = memoryview(buf), 0, []
        for k, pk, cid, n in zip(keys, pkeys, cids, sizes):
            dest = view[at : at + n]
            page.encode_into(self.layout, get_offload_group_idx(k), get_offload_block_hash(k), pk,
                             np.frombuffer(self._slot(cid, k), dtype=np.uint8), dest)
            out.append(dest)
            at += n
        return out

    def _catch_up(self, client: Client, s: _Session) -> None:
        """Start from the daemon's version of the session, if it has one."""
        try:
            m, _ = client.get_session(s.tenant.namespace, s.session_id)
        except NotFound:
            m = None
        if m is not None and m.layout_id != self.layout.layout_id:  # never clobber another kind of session
            raise FailedPrecondition(f"session {s.session_id!r} of namespace {s.tenant.namespace!r} holds another "
                                     f"layout's data ({m.layout_id.hex()}): its blocks are not saved under it")
        s.version = m.generation if m is not None else 0
        if m is not None:
            s.held = {**dict.fromkeys(m.chunk_keys, 0), **s.held}
            if m.chunk_keys:
                s.held[m.chunk_keys[-1]] = max(s.held[m.chunk_keys[-1]], m.token_count)
        s.loaded = True

    def _load(self, s: _Session | None, keys: list[OffloadKey], cids: list[int]) -> tuple[bool, list[OffloadKey]]:
        if s is None or not self._available():
            return False, []
        tenant = s.tenant
        client = self._client(tenant, "load")
        pkeys = [self._key(tenant, k) for k in keys]
        loaded: set[int] = set()
        for batch in self._batches(keys):  # each answer fits the arena: no stream, no copy but the one
            for j, blob in client.load_chunks(tenant.namespace, [pkeys[i] for i in batch], zero_copy=True):
                i = batch[j]
                try:
                    page.check_known(blob, self.layout, pkeys[i])
                except page.PageError as e:
                    log.warning("kvstore tier: block %s refused (%s): a miss", pkeys[i].hex(), e)
                    continue
                page.decode_into(blob, self.layout, np.frombuffer(self._slot(cids[i], keys[i]), dtype=np.uint8))
                loaded.add(i)
        done = [k for i, k in enumerate(keys) if i in loaded]
        return len(loaded) == len(keys), done

    def _batches(self, keys: list[OffloadKey]) -> list[list[int]]:
        """The job's keys cut into runs whose blobs fit one arena (one batch each, when it is larger)."""
        out: list[list[int]] = [[]]
        room = self.arena_bytes
        for i, k in enumerate(keys):
            n = page.blob_bytes(self._group(k), len(get_offload_block_hash(k)))
            if out[-1] and n > room:
                out.append([])
                room = self.arena_bytes
            out[-1].append(i)
            room -= n
        return out


def _unreachable(e: Exception) -> bool:
    """Whether a failed call says the daemon cannot be reached (rather than answering no)."""
    return isinstance(e, (Unavailable, OSError)) or type(e) is KvstoreError  # KvstoreError: a deadline


def _session_id(raw: str) -> str:
    """A kvstore session id from a request's: unsafe characters replaced, at most 128, starting
    with a letter or digit."""
    sid = _UNSAFE.sub("_", raw)[:127]
    return sid if sid[:1].isalnum() else f"s{sid}"[:128]


__all__ = ["TESTED_VLLM", "KVStoreTier", "Tenant"]
