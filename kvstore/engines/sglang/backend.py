"""kvstore as SGLang's HiCache L3 for DeepSeek-V4.1: a multi-pool (v2) ``HiCacheStorage`` backend.

Loaded by SGLang 0.5.23 itself, no SGLang patch::

    python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V4.1-Flash \\
      --enable-hierarchical-cache --hicache-mem-layout page_first --enable-encoder-swa-bounded-replay \\
      --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvstore", "module_path": "kvstore.engines.sglang.backend", "class_name": "KVStoreHiCache",
        "address": "127.0.0.1:50151", "namespace": "team-a", "token": "...", "hicache_storage_pass_prefix_keys": true}'

What is stored: the pages of SGLang's V4.1 host pools (``deepseek_v4_c2``, ``deepseek_v4_c2_indexer``,
``deepseek_v4_c1``, ``deepseek_v4_c1_indexer``: the FP4 global KV, 890 B/token on SM100), each page
one page blob (``kvstore/format/page.py``) of the pool's group in a page layout (``geometry.py``) whose
fingerprint holds the model, every pool's geometry and record layout, and the ranks SGLang passes, so
pages are never served across tenants, record layouts or parallel configurations. Never the SWA
window: an ``swa`` pool (SGLang registers one without ``--enable-encoder-swa-bounded-replay``) is
refused at attach, with a message naming the flag. SGLang's ``kv`` anchor (a ``LogicalHostPool``,
0-byte pages) is not stored: a page "exists" for it when every pool holds it.

- ``batch_exists_v2``: one ``LookupKeys`` call for every pool's key of every page; the consecutive
  prefix whose every pool holds the page;
- ``batch_get_v2``: every pool's pages in one ``load_page_regions`` call (one round trip): the daemon
  writes each verified page into its host slot, in its pool's buffer (``page_first`` host memory: one
  copy after the daemon's tier); a page missing, damaged or refused is a ``False`` and its slot is
  left alone;
- ``batch_set_v2``: every pool's pages in one turn save (an append) of their conversation's page
  session (``save_page_regions``: the daemon reads the pages from their host slots itself and commits
  them durably with the session's new version, one transaction);
- it never raises into SGLang on the data path: a daemon that cannot be reached makes every call a
  miss or a ``False`` for ``down_s`` seconds (no call is tried meanwhile), and SGLang recomputes.

Sessions: the pages of one conversation (SGLang's keys are a SHA-256 chain from the sequence start,
seeded by ``cache_salt``) are one page session, ``sglang-<layout>-<its first page's key>``, so
``kvstore sessions ls``, ``evict``, ``prefetch``, retention and ``bytes-per-token`` see them: a write
whose first page follows the last page of a conversation this server wrote joins its session, any
other starts one (a branch off a shared prompt, or the first turn after a restart). SGLang
hands a backend the chain's earlier keys only with ``"hicache_storage_pass_prefix_keys": true``;
without it each write is its own session.

Tenants: one server, one tenant: its ``namespace`` and ``token`` (SGLang's ``cache_salt`` separates
its own requests' keys; the namespace separates servers, teams and engines sharing a daemon).

Settings (keys of the extra config beside SGLang's own): ``address`` (default ``$KVSTORE_ADDRESS`` or
127.0.0.1:50151), ``namespace`` (``sglang``), ``token``, ``session_ttl_s`` (86400; 0 = kept until
deleted), ``timeout_s`` (10, per call), ``down_s`` (5), ``arena_bytes`` (32 MiB of shared memory per
I/O thread, where the daemon cannot reach SGLang's memory itself).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import sglang
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from kvstore.client.calls import PageLoad, PageSlots
from kvstore.engines.pages.daemon import DaemonLink
from kvstore.engines.pages.records import Record
from kvstore.engines.pages.sessions import PageSession, PageSessions, Tenant, block_key, session_id
from kvstore.engines.sglang.geometry import (
    ANCHOR,
    SWA_POOLS,
    Geometry,
    Pool,
    SwaPoolRefused,
    derive,
    fit,
    indexer_records,
    main_record,
)
from kvstore.engines.sglang.host import HostPages
from kvstore.format import page
from kvstore.format.manifest import Retention

log = logging.getLogger(__name__)
TESTED_SGLANG = ("0.5.23",)
#: Pages remembered: their kvstore keys, the ones every pool was seen to hold (stored here, or found by a
#: query: the anchor's write and read that follow need no lookup), and conversations' last pages.
RECENT = 1 << 16


@dataclass(frozen=True)
class BackendConfig:
    """The backend's settings, from SGLang's extra config (its own keys and the factory's ignored)."""

    address: str = ""
    namespace: str = "sglang"
    token: str = ""
    session_ttl_s: float = 86400.0
    timeout_s: float = 10.0
    down_s: float = 5.0
    arena_bytes: int = 32 << 20

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> BackendConfig:
        extra = extra or {}
        kinds = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for name, kind in kinds.items():
            if name in extra and extra[name] is not None:
                cast = {"str": str, "float": float, "int": int}[str(kind)]
                try:
                    values[name] = cast(extra[name])
                except (TypeError, ValueError):
                    raise ValueError(f"kvstore HiCache backend: {name}={extra[name]!r} is not a {kind}") from None
        values["address"] = values.get("address") or os.environ.get("KVSTORE_ADDRESS", "127.0.0.1:50151")
        return cls(**values)


def page_hash(key: str) -> bytes:
    """The engine hash of an SGLang page key (a 64-hex SHA-256 for V4.1; another key's bytes, or their
    blake2b-256 past 64 bytes)."""
    if len(key) == 64:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    raw = key.encode()
    return raw if 0 < len(raw) <= page.MAX_HASH_BYTES else hashlib.blake2b(raw, digest_size=32).digest()


def _records() -> tuple[list[Record], list[Record]]:
    """The records SGLang's V4.1 pools may hold here: the main-KV layouts of the arrangement SGLang's
    ``select_dsv4_kv_layout`` picks (interleaved only under ``SGLANG_DSV4_KV_LAYOUT=v41_new``), and the
    fused indexer records (none on ROCm, whose AITER indexer pages group their rows)."""
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout
    from sglang.srt.environ import envs
    from sglang.srt.utils import is_hip

    interleaved = str(envs.SGLANG_DSV4_KV_LAYOUT.get()).lower() == "v41_new"
    mains = [r for r in (main_record(k) for k in KVLayout if k.is_interleaved == interleaved) if r is not None]
    return mains, [] if is_hip() else indexer_records()


#: One pool's pages of a call: its name, SGLang's keys, its host pages and the host page of each key.
Work = tuple[str, list[str], HostPages, list[int]]


def _name(pool_name: Any) -> str:
    return str(getattr(pool_name, "value", pool_name))


class KVStoreHiCache(HiCacheStorage):
    """SGLang's HiCacheStorage hooks on kvstore's daemon (``host.py`` finds the pages in host memory,
    ``geometry.py`` lays them out, ``kvstore/engines/pages/`` holds the tenants, sessions and daemon link)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.config = BackendConfig.from_extra(storage_config.extra_config)
        self.tenant = Tenant(self.config.namespace, self.config.token)
        self.retention = Retention(ttl_s=self.config.session_ttl_s if self.config.session_ttl_s > 0 else None)
        self.registered_pools: dict[str, Any] = {}
        self.geometry: Geometry | None = None
        self.host: dict[str, HostPages] = {}
        self.daemon: DaemonLink | None = None
        self.sessions: PageSessions | None = None
        self._keys: dict[tuple[str, str], bytes] = {}
        #: SGLang keys of pages every pool was seen to hold lately (the anchor's answer without a call)
        self._known: OrderedDict[str, None] = OrderedDict()
        #: the last page key of each conversation this server wrote lately -> its session (``_session``)
        self._tails: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()  # guards _known and _tails (SGLang's I/O threads share them)

    # -- attach -----------------------------------------------------------------------------------
    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        name = _name(host_pool_name)
        if name in SWA_POOLS:  # refused where it is registered, not found out as a 0% hit rate later
            derive(self.storage_config.model_name or "", [self._pool(name, host_pool, *_records())], {})
        self.registered_pools[name] = host_pool
        if self.geometry is not None and name != ANCHOR:  # a pool after the attach: the layout changes with it
            self.on_host_pools_registered()

    def on_host_pools_registered(self) -> None:
        """Every pool known: the page layout derived (SwaPoolRefused for an ``swa`` pool, which fails
        SGLang's attach) and registered with the daemon, the I/O threads' clients made lazily."""
        records = _records()
        pools = {n: self._pool(n, p, *records) for n, p in self.registered_pools.items() if n != ANCHOR}
        self.geometry = derive(self.storage_config.model_name or "unknown", list(pools.values()), self._fingerprint())
        self.host = {n: HostPages(pools[n], self.registered_pools[n]) for n in self.geometry.groups}
        if self.geometry.opaque:
            log.warning("kvstore HiCache backend: no record SGLang can pick fills the pages of pool(s) %s as their "
                        "size says: they are stored whole (verified, bit-exact, no scale compression)",
                        list(self.geometry.opaque))
        if self.daemon is not None:
            self.daemon.close()
        self.daemon = DaemonLink(self.config.address, self.geometry.layout, self.config.timeout_s,
                                 self.config.down_s, self.config.arena_bytes, log)
        self.sessions = PageSessions(self.geometry.layout, self.tenant, self.retention)
        self.daemon.warm(self.tenant, "lookup")  # the layout registered now: the first query does not pay for it
        log.info("kvstore HiCache backend: %d pools, %.1f B/token, layout %s, namespace %r, daemon %s",
                 len(self.host), self.geometry.bytes_per_token, self.geometry.layout.layout_hex[:12],
                 self.tenant.namespace, self.config.address)

    @staticmethod
    def _pool(name: str, host_pool: Any, mains: list[Record], indexers: list[Record]) -> Pool:
        return fit(name, int(getattr(host_pool, "layer_num", 0)), int(getattr(host_pool, "item_bytes", 0)),
                   int(getattr(host_pool, "page_size", 0)), mains, indexers)

    def _fingerprint(self) -> dict[str, str]:
        """The ranks that make a page another configuration's. MLA KV is the same on every TP rank (only
        the storage writer stores it, every rank loads it), so the TP rank is left out for it, as
        SGLang's own file backend leaves it out of its file names."""
        c = self.storage_config
        return {"engine_version": sglang.__version__, "tp_size": str(c.tp_size), "pp_rank": str(c.pp_rank),
              "pp_size": str(c.pp_size), "attn_cp_rank": str(c.attn_cp_rank), "attn_cp_size": str(c.attn_cp_size),
              "dcp_rank": str(c.dcp_rank), "dcp_size": str(c.dcp_size),
              "tp_rank": "replicated" if c.is_mla_model else str(c.tp_rank)}

    # -- keys -------------------------------------------------------------------------------------
    def _key(self, pool: str, key: str) -> bytes:
        """The kvstore key of ``pool``'s page of SGLang's ``key`` (the same page is asked for by the query,
        the anchor and the load: computed once, kept for the last ``RECENT`` pages)."""
        got = self._keys.get((pool, key))
        if got is None:
            assert self.geometry is not None
            got = block_key(self.geometry.layout, self.tenant, self.geometry.groups[pool], page_hash(key))
            if len(self._keys) >= RECENT:
                self._keys.clear()
            self._keys[(pool, key)] = got
        return got

    def _ready(self) -> bool:
        return self.geometry is not None and self.daemon is not None and self.daemon.available()

    def _present(self, keys: Sequence[str], pools: Sequence[str]) -> dict[str, list[bool]]:
        """For each pool, which of ``keys``' pages the daemon holds (one call; a failure: none)."""
        if not keys or not pools or not self._ready():
            return {p: [False] * len(keys) for p in pools}
        assert self.daemon is not None
        try:
            pkeys = [self._key(p, k) for p in pools for k in keys]
            where = self.daemon.client(self.tenant, "lookup").lookup_keys(self.tenant.namespace, pkeys)
        except Exception as e:  # a miss, never SGLang's exception
            self.daemon.failed("a lookup", e)
            return {p: [False] * len(keys) for p in pools}
        n = len(keys)
        return {p: [w is not None for w in where[i * n:(i + 1) * n]] for i, p in enumerate(pools)}

    def _anchored(self, keys: Sequence[str]) -> list[bool]:
        """Whether every pool holds each page (the ``kv`` anchor's answer)."""
        if self.geometry is None:
            return [False] * len(keys)
        present = self._present(keys, list(self.geometry.groups))
        return [all(present[p][i] for p in present) for i in range(len(keys))]

    # -- v2: the pools' pages ---------------------------------------------------------------------
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        try:
            return self._exists(keys, pool_transfers or [])
        except Exception:  # never into SGLang: a miss
            log.exception("kvstore HiCache backend: a query failed")
            return PoolTransferResult(0, {}, [])

    def _exists(self, keys: list[str], transfers: list[PoolTransfer]) -> PoolTransferResult:
        if self.geometry is None:
            return PoolTransferResult(0, {}, [])
        names = list(self.geometry.groups)
        present = self._present(keys, names)
        kv_pages = next((i for i in range(len(keys)) if not all(present[p][i] for p in names)), len(keys))
        self._saw(keys[:kv_pages])
        hits: dict[str, int] = {ANCHOR: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for t in transfers:
            name = _name(t.name)
            has = present.get(name, [False] * len(keys))
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = next((i for i in range(kv_pages) if not has[i]), kv_pages)
                ok = set(range(1, boundary + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(t.keys or ()))
                ok = {n for n in range(1, kv_pages + 1) if all(has[max(0, n - trailing):n])}
                boundary = max(ok, default=0)
            else:  # a policy this backend does not answer: no prefix of the pool is restorable
                ok, boundary = set(), 0
            if boundary:
                hits[name] = boundary
            restorable &= ok
        final = max(restorable, default=0)
        return PoolTransferResult(final, hits, sorted(restorable))

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Every pool's pages of the call in one load (``Client.load_page_regions``): one round trip, the
        daemon writing each verified page into its host slot, whichever pool's buffer it is in."""
        out, work = self._work(transfers)
        try:
            out.update(self._load(work))
        except Exception as e:  # any failure is misses, never SGLang's exception
            if self.daemon is not None:
                self.daemon.failed(f"loading {sum(len(w[1]) for w in work)} pages of {[w[0] for w in work]}", e)
            out.update({name: [False] * len(keys) for name, keys, _, _ in work})
        return out

    def _work(self, transfers: list[PoolTransfer]) -> tuple[dict[str, list[bool]], list[Work]]:
        """The pages of a load or a store, pool by pool, where they lie in host memory (each pool's host
        pages and their rows); the pools with nothing to move answered at once (every page a ``False``: not a
        pool of this layout, not whole pages, the daemon down)."""
        out: dict[str, list[bool]] = {}
        work: list[Work] = []
        ready = self._ready()
        for t in transfers:
            name, keys = _name(t.name), list(t.keys or ())
            hp = self.host.get(name)
            rows = None
            if keys and hp is not None and ready and t.host_indices is not None:
                rows = hp.rows(t.host_indices, len(keys))
                if rows is None:
                    log.error("kvstore HiCache backend: %s: %d host indices for %d pages of %d tokens", name,
                              t.host_indices.numel(), len(keys), hp.pool.page_tokens)
            if hp is not None and rows is not None:
                work.append((name, keys, hp, rows))
            else:
                out[name] = [False] * len(keys)
        return out, work

    def _load(self, work: list[Work]) -> dict[str, list[bool]]:
        """One ``load_page_regions`` call for every pool of ``work``: a page_first pool's pages straight into
        their host slots, a layout without slots into a scratch buffer of its own, then set by the pool. A
        page whose payload is not the pool's page size is a miss."""
        if not work:
            return {}
        assert self.daemon is not None
        runs: list[PageLoad] = []
        scratch: list[bool] = []  # per pool: loaded into a scratch buffer, then set by the pool
        for name, keys, hp, rows in work:
            pkeys = [self._key(name, k) for k in keys]
            size, region = hp.pool.page_bytes, hp.region
            scratch.append(region is None)
            if region is not None:  # the daemon writes each verified page into its host slot
                runs.append(PageLoad(region, pkeys, hp.offsets(rows), size))
            else:  # a layout without slots: loaded here, set by the pool
                runs.append(PageLoad(bytearray(size * len(keys)), pkeys, [i * size for i in range(len(keys))], size))
        placed = self.daemon.client(self.tenant, "load").load_page_regions(self.tenant.namespace, runs)
        out: dict[str, list[bool]] = {}
        for (name, keys, hp, rows), got, set_by_pool in zip(work, placed, scratch):
            ok = [False] * len(keys)
            for i, view in got:
                if len(view) == hp.pool.page_bytes:
                    if set_by_pool:
                        hp.write(rows[i], view)
                    ok[i] = True
            out[name] = ok
        return out

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Every pool's pages of the call in one turn save of their conversation's session: one call, one
        durable commit (the daemon reads the pages from each pool's host slots)."""
        prefix = list(extra_info.prefix_keys) if extra_info is not None and extra_info.prefix_keys is not None else None
        out, work = self._work(transfers)
        try:
            done = self._store(work, prefix)
        except Exception as e:  # a store that fails is False: SGLang keeps the pages in host memory
            if self.daemon is not None:
                self.daemon.failed(f"storing {sum(len(w[1]) for w in work)} pages", e)
            done = False
        for name, keys, _, _ in work:
            out[name] = [done] * len(keys)
        return out

    def _session_prefix(self) -> str:
        """What this server's session ids start with: its layout's (a chain of the same tokens under another
        record layout or configuration is another session)."""
        assert self.geometry is not None
        return f"sglang-{self.geometry.layout.layout_hex[:12]}-"

    def _session(self, keys: list[str], prefix: list[str] | None) -> PageSession:
        """The session of a write: the conversation whose last page its first page follows (SGLang's
        ``prefix_keys``), else a new one named by its first page. A branch (a page followed by another
        conversation's already) starts its own session; its prefix stays in the session that wrote it."""
        assert self.sessions is not None
        with self._lock:
            sid = self._tails.get(prefix[-1]) if prefix else None
        return self.sessions.session(self.tenant, sid or session_id(f"{self._session_prefix()}{keys[0][:32]}"))

    def _store(self, work: list[Work], prefix: list[str] | None) -> bool:
        if not work:
            return True
        if not self._ready() or self.sessions is None:
            return False
        assert self.daemon is not None and self.geometry is not None
        client = self.daemon.client(self.tenant, "store")
        layout, start = self.geometry.layout, len(prefix) if prefix is not None else None
        pkeys: list[bytes] = []
        ends: list[int | None] = []
        items: list[tuple[HostPages, int, int, bytes]] = []  # (pool, group, host page, SGLang's hash)
        for name, keys, hp, rows in work:
            group = self.geometry.groups[name]
            for i, k in enumerate(keys):
                pkeys.append(self._key(name, k))
                ends.append(None if start is None else (start + i + 1) * hp.pool.page_tokens)
                items.append((hp, group, rows[i], page_hash(k)))
        chain = work[0][1]
        s = self._session(chain, prefix)
        regions = {id(hp): hp.region for _, _, hp, _ in work}
        if all(r is not None for r in regions.values()):  # the daemon reads each page from its host slot
            def send(m: Any, fresh: list[int], base: int) -> Any:
                runs: dict[int, list[int]] = {}  # pool by pool, in order: the new blobs are every region's, in turn
                for i in fresh:
                    runs.setdefault(id(items[i][0]), []).append(i)
                return client.save_page_regions(m, layout, [
                    PageSlots(regions[pool], [items[i][2] * items[i][0].pool.page_bytes for i in run],
                              items[run[0]][0].pool.page_bytes, [items[i][1] for i in run], [items[i][3] for i in run])
                    for pool, run in runs.items()], base)

            self.sessions.save(client, s, pkeys, list(range(len(items))), ends, send)
        else:  # a layout without slots: the pages gathered by the pool and sealed here
            blobs = [page.encode(layout, group, h, pk, hp.read(row)) for (hp, group, row, h), pk in zip(items, pkeys)]
            self.sessions.save(client, s, pkeys, blobs, ends)
        if {name for name, _, _, _ in work} == set(self.geometry.groups):  # every pool of these pages: anchored
            self._saw(list(set.intersection(*(set(keys) for _, keys, _, _ in work))))
        with self._lock:
            if prefix:
                self._tails.pop(prefix[-1], None)
            self._tails[chain[-1]] = s.session_id
            while len(self._tails) > RECENT:
                self._tails.popitem(last=False)
        return True

    # -- v1: the 0-byte kv anchor -----------------------------------------------------------------
    def _saw(self, keys: Sequence[str]) -> None:
        """``keys``' pages are held by every pool (stored here just now, or found by a query)."""
        with self._lock:
            for k in keys:
                self._known[k] = None
                self._known.move_to_end(k)
            while len(self._known) > RECENT:
                self._known.popitem(last=False)

    def _known_lately(self, keys: Sequence[str]) -> bool:
        with self._lock:
            return all(k in self._known for k in keys)

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """The anchor's pages hold no bytes: a write "succeeds" when every pool holds the pages (the
        pools' writes come first, in the same backup)."""
        try:
            return self._known_lately(keys) or all(self._anchored(keys))
        except Exception:
            log.exception("kvstore HiCache backend: an anchor write failed")
            return False

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key])

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """The anchor's (0-byte) pages: each returned when every pool holds the page, else None."""
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        try:  # a prefetch reads what its query just found: answered without a call (the pools' reads decide)
            anchored = [True] * len(keys) if self._known_lately(keys) else self._anchored(keys)
        except Exception:
            log.exception("kvstore HiCache backend: an anchor read failed")
            anchored = [False] * len(keys)
        return [(t if t is not None else torch.empty(0, dtype=torch.uint8)) if a else None
                for t, a in zip(targets, anchored)]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def exists(self, key: str) -> bool:
        try:
            return self._anchored([key])[0]
        except Exception:
            log.exception("kvstore HiCache backend: a query failed")
            return False

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        try:
            anchored = self._anchored(keys)
        except Exception:
            log.exception("kvstore HiCache backend: a query failed")
            return 0
        return next((i for i, a in enumerate(anchored) if not a), len(keys))

    # -- admin ------------------------------------------------------------------------------------
    def clear(self) -> bool:
        """SGLang's ``/clear_hicache_storage_backend``: this server's page sessions (its layout's, in its
        namespace) deleted from the daemon; other configurations' and other tenants' sessions stay."""
        if self.geometry is None or self.daemon is None:
            return False
        try:
            client = self.daemon.client(self.tenant, "lookup")
            gone = 0
            for s in client.list_sessions(self.tenant.namespace):
                if s.session_id.startswith(self._session_prefix()):
                    client.delete_session(self.tenant.namespace, s.session_id)
                    gone += 1
            log.info("kvstore HiCache backend: cleared %d sessions of namespace %r", gone, self.tenant.namespace)
            assert self.sessions is not None
            self.sessions = PageSessions(self.sessions.layout, self.tenant, self.retention)  # none is held now
            with self._lock:
                self._known.clear()
                self._tails.clear()
            return True
        except Exception as e:
            self.daemon.failed("clearing the storage", e)
            return False

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.close()


__all__ = ["TESTED_SGLANG", "BackendConfig", "KVStoreHiCache", "SwaPoolRefused", "page_hash"]
