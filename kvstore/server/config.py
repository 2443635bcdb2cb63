"""The daemon's one frozen config, built in one place from defaults < TOML file < environment < flags.
Its defaults for store and tier settings are the store's and tiers' own (defined once, there).

Environment variables are ``KVSTORE_<FIELD>`` (``KVSTORE_TLS_CERT_FILE`` for nested fields).
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvstore.defaults import DEFAULT_PORT
from kvstore.store import StoreConfig
from kvstore.store.config import DEFAULT_HOST_CAPACITY_BYTES
from kvstore.tiers import HbmTierConfig, HostTierConfig, RedisTierConfig, SsdTierConfig


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str = ""  # server certificate (PEM); with key_file, turns TLS on
    key_file: str = ""
    client_ca_file: str = ""  # when set, clients must present a certificate signed by this CA (mTLS)

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


@dataclass(frozen=True)
class DaemonConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # 0 = pick a free port (printed on start)
    data_dir: str = "kvstore-data"
    host_capacity_bytes: int = DEFAULT_HOST_CAPACITY_BYTES
    ssd_capacity_bytes: int = 0  # 0 = unlimited
    ssd_max_map_bytes: int = 0  # hard limit of the LMDB file: past it saves fail (RESOURCE_EXHAUSTED); 0 = none
    zstd_level: int = SsdTierConfig.zstd_level  # 0 = off
    ssd_compact_records: bool = SsdTierConfig.transform_chunks  # record flag 2: ~4% smaller, ~10x slower codec
    sync: bool = SsdTierConfig.sync  # fsync every acknowledged write
    redis_url: str = ""  # adds a shared Redis tier after the ssd tier
    redis_namespace: str = "kvstore"
    redis_ttl_s: int = 0  # 0 = no expiry
    redis_cluster: bool = RedisTierConfig.cluster  # redis_url names a node of a Redis Cluster
    redis_share_sessions: bool = RedisTierConfig.share_sessions  # publish and resume sessions across daemons
    redis_wait_replicas: int = RedisTierConfig.wait_replicas  # a save waits for this many replicas (WAIT)
    redis_wait_timeout_ms: int = RedisTierConfig.wait_timeout_ms
    hbm_capacity_bytes: int = 0  # > 0 adds an HBM tier in front (needs CUDA)
    chunk_tokens: int = StoreConfig.chunk_tokens
    write_mode: str = StoreConfig.write_mode
    promote_on_read: bool = StoreConfig.promote_on_read
    shared_memory: bool = True  # offer same-host transfers through /dev/shm
    tokens_file: str = ""  # TOML [tokens] table: per-namespace bearer tokens
    metrics_port: int = 0  # > 0 serves Prometheus metrics on host:metrics_port
    log_format: str = "json"  # json | text
    log_level: str = "INFO"
    allow_insecure_remote: bool = False  # permit a non-loopback bind without TLS and tokens
    grace_s: float = 10.0  # shutdown: in-flight RPCs get this long to finish
    tls: TlsConfig = field(default_factory=TlsConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be 0-65535, got {self.port}")
        if self.log_format not in ("json", "text"):
            raise ValueError(f"log_format must be json or text, got {self.log_format!r}")
        if bool(self.tls.cert_file) != bool(self.tls.key_file):
            raise ValueError("TLS needs both cert_file and key_file")
        if self.tls.client_ca_file and not self.tls.enabled:
            raise ValueError("mutual TLS (client_ca_file) needs cert_file and key_file too")
        if not self.loopback and not self.allow_insecure_remote and not (self.tls.enabled and self.tokens_file):
            raise ValueError(f"refusing to listen on {self.host} without TLS and bearer tokens; "
                             f"configure both or pass --allow-insecure-remote")
        self.store_config()  # validate the store/tier sections now, with their own messages

    @property
    def loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def store_config(self) -> StoreConfig:
        tiers: list[Any] = []
        if self.hbm_capacity_bytes:
            tiers.append(HbmTierConfig(capacity_bytes=self.hbm_capacity_bytes))
        tiers.append(HostTierConfig(capacity_bytes=self.host_capacity_bytes))
        limit = self.ssd_max_map_bytes
        tiers.append(SsdTierConfig(path=str(Path(self.data_dir) / "ssd"), capacity_bytes=self.ssd_capacity_bytes,
                                   zstd_level=self.zstd_level, sync=self.sync, max_map_size=limit,
                                   transform_chunks=self.ssd_compact_records,
                                   map_size=min(SsdTierConfig.map_size, limit) if limit else SsdTierConfig.map_size))
        if self.redis_url:
            tiers.append(RedisTierConfig(url=self.redis_url, namespace=self.redis_namespace,
                                         ttl_s=self.redis_ttl_s or None, cluster=self.redis_cluster,
                                         share_sessions=self.redis_share_sessions,
                                         wait_replicas=self.redis_wait_replicas,
                                         wait_timeout_ms=self.redis_wait_timeout_ms))
        return StoreConfig(tiers=tuple(tiers), write_mode=self.write_mode, promote_on_read=self.promote_on_read,
                           chunk_tokens=self.chunk_tokens)


def _coerce(value: Any, typ: Any, name: str) -> Any:
    if not isinstance(value, str):
        return value
    t = str(typ)
    try:
        if t == "bool":
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if t == "int":
            return int(value)
        if t == "float":
            return float(value)
    except ValueError:
        raise ValueError(f"{name}: cannot read {value!r} as {t}") from None
    return value


def load_config(toml_path: str | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> DaemonConfig:
    """defaults < TOML file < environment (KVSTORE_*) < explicit overrides (CLI flags, None = unset)."""
    merged: dict[str, Any] = {}
    tls: dict[str, Any] = {}
    if toml_path:
        data = tomllib.loads(Path(toml_path).read_text())
        tls.update(data.pop("tls", {}))
        merged.update(data)
    env = os.environ if env is None else env
    for f in fields(DaemonConfig):
        if f.name == "tls":
            for tf in fields(TlsConfig):
                if (v := env.get(f"KVSTORE_TLS_{tf.name.upper()}")) is not None:
                    tls[tf.name] = v
        elif (v := env.get(f"KVSTORE_{f.name.upper()}")) is not None:
            merged[f.name] = v
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k.startswith("tls_"):
            tls[k[4:]] = v
        else:
            merged[k] = v
    known = {f.name: f.type for f in fields(DaemonConfig)}
    unknown = set(merged) - set(known)
    if unknown:
        raise ValueError(f"unknown config keys: {', '.join(sorted(unknown))}")
    tls_known = {f.name: f.type for f in fields(TlsConfig)}
    if set(tls) - set(tls_known):
        raise ValueError(f"unknown [tls] keys: {', '.join(sorted(set(tls) - set(tls_known)))}")
    values = {k: _coerce(v, known[k], k) for k, v in merged.items()}
    values["tls"] = TlsConfig(**{k: _coerce(v, tls_known[k], f"tls.{k}") for k, v in tls.items()})
    return DaemonConfig(**values)
