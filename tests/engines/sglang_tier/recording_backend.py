"""SGLang's ``HiCacheFile`` loaded as a ``dynamic`` backend that records how the controller calls it.

Loaded by SGLang's ``StorageBackendFactory`` from ``{"backend_name": "recording-file", "module_path":
"recording_backend", "class_name": "RecordingHiCacheFile", ...}``, constructed as ``cls(storage_config, kwargs)``
like any dynamic backend (kvstore's included). Every HiCacheStorage entry point appends a :class:`Call` to
``CALLS`` (thread name, method, page keys, pools, extra_info) and then runs HiCacheFile's own code."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig


@dataclass
class Call:
    thread: str
    method: str
    keys: int = 0  # page keys in the call (the v2 calls: per transfer; the most of them)
    pools: list[str] = field(default_factory=list)
    prefix_keys: int | None = None  # len(extra_info.prefix_keys), None when absent
    extra: Any = None  # extra_info.extra_info


CALLS: list[Call] = []
CONFIGS: list[HiCacheStorageConfig] = []
_lock = threading.Lock()


def _name(pool: Any) -> str:
    return str(getattr(pool, "value", pool))


def _record(method: str, *, keys: int = 0, pools: list[str] | None = None, extra_info: Any = None) -> None:
    prefix = getattr(extra_info, "prefix_keys", None)
    with _lock:
        CALLS.append(Call(threading.current_thread().name, method, keys, pools or [],
                          None if prefix is None else len(prefix), getattr(extra_info, "extra_info", None)))


class RecordingHiCacheFile(HiCacheFile):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any]) -> None:
        CONFIGS.append(storage_config)
        _record("__init__")
        super().__init__(storage_config)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        _record("register_mem_pool_host")
        super().register_mem_pool_host(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        _record("register_mem_host_pool_v2", pools=[_name(host_pool_name)])
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def on_host_pools_registered(self) -> None:
        _record("on_host_pools_registered")
        super().on_host_pools_registered()

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        _record("batch_exists", keys=len(keys), extra_info=extra_info)
        return super().batch_exists(keys, extra_info)

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        _record("batch_exists_v2", keys=len(keys), pools=[_name(t.name) for t in pool_transfers or []],
                extra_info=extra_info)
        return super().batch_exists_v2(keys, pool_transfers, extra_info)

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        _record("batch_get_v1", keys=len(keys), extra_info=extra_info)
        return super().batch_get_v1(keys, host_indices, extra_info)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        _record("batch_set_v1", keys=len(keys), extra_info=extra_info)
        return super().batch_set_v1(keys, host_indices, extra_info)

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        _record("batch_get_v2", keys=max((len(t.keys or []) for t in transfers), default=0),
                pools=[_name(t.name) for t in transfers], extra_info=extra_info)
        return super().batch_get_v2(transfers, extra_info)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        _record("batch_set_v2", keys=max((len(t.keys or []) for t in transfers), default=0),
                pools=[_name(t.name) for t in transfers], extra_info=extra_info)
        return super().batch_set_v2(transfers, extra_info)

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        _record("batch_get", keys=len(keys))
        return super().batch_get(keys, target_locations, target_sizes)

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        _record("batch_set", keys=len(keys))
        return super().batch_set(keys, values, target_locations, target_sizes)

    def close(self) -> None:
        _record("close")
        parent = getattr(super(), "close", None)  # HiCacheFile has none
        if parent is not None:
            parent()


class SwaRefusingHiCacheFile(RecordingHiCacheFile):
    """A backend that refuses an ``swa`` pool at registration, as an L3 store of V4.1's prefix-cacheable pools
    only should: what SGLang does with that refusal is what the tests check."""

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if _name(host_pool_name) == "swa":
            raise ValueError("swa pool refused: launch with --enable-encoder-swa-bounded-replay")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
