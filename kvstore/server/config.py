"""The daemon's one frozen config, built in one place from defaults < TOML file < environment < flags.
Its defaults for store and tier settings are the store's and tiers' own (defined once, there).

Environment variables are ``KVSTORE_<FIELD>`` (``KVSTORE_TLS_CERT_FILE`` for nested fields).
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvstore.defaults import DEFAULT_PORT
from kvstore.store import StoreConfig
from kvstore.store.config import DEFAULT_HOST_CAPACITY_BYTES
from kvstore.tiers import HbmTierConfig, HostTierConfig, RedisTierConfig, SsdTierConfig


class ConfigError(ValueError):
    """A setting that cannot be used; ``keys`` are the settings at fault (``port``, ``tls.cert_file``),
    so that ``load_config`` can say where their values came from."""

    def __init__(self, message: str, *keys: str) -> None:
        super().__init__(message)
        self.keys = keys


#: Settings with no flag of their own: a TOML key or a KVSTORE_* variable only.
FLAGLESS = ("redis_namespace", "promote_on_read", "grace_s", "health_interval_s")
_FLAGS = {"sync": "--no-sync", "shared_memory": "--no-shared-memory"}


def setting(name: str) -> str:
    """How an operator names a setting: its flag (``--tls-cert-file`` for ``tls.cert_file``), or, for one
    without a flag, its TOML key and environment variable."""
    if name in FLAGLESS:
        return f"{name} (TOML key; ${env_name(name)})"
    return _FLAGS.get(name) or "--" + name.replace(".", "-").replace("_", "-")


def env_name(name: str) -> str:
    """The environment variable of a setting: ``KVSTORE_PORT``, ``KVSTORE_TLS_CERT_FILE``."""
    return "KVSTORE_" + name.replace(".", "_").upper()


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
    health_interval_s: float = 5.0  # every tier is probed this often for the health service (server/health.py)
    tls: TlsConfig = field(default_factory=TlsConfig)

    def __post_init__(self) -> None:
        for name, ok, want in _RULES:
            value = getattr(self, name)
            if not ok(value):
                raise ConfigError(f"{setting(name)} must be {want}, got {value!r}", name)
        if bool(self.tls.cert_file) != bool(self.tls.key_file):
            given, missing = ("tls.cert_file", "tls.key_file") if self.tls.cert_file else ("tls.key_file",
                                                                                             "tls.cert_file")
            raise ConfigError(f"TLS needs both {setting('tls.cert_file')} and {setting('tls.key_file')}: "
                              f"{setting(given)} is set, {setting(missing)} is not", given)
        if self.tls.client_ca_file and not self.tls.enabled:
            raise ConfigError(f"mutual TLS ({setting('tls.client_ca_file')}) needs {setting('tls.cert_file')} and "
                              f"{setting('tls.key_file')} too", "tls.client_ca_file")
        if not self.loopback and not self.allow_insecure_remote and not (self.tls.enabled and self.tokens_file):
            raise ConfigError(f"refusing to listen on {self.host} (not a loopback address) without TLS and bearer "
                              f"tokens: configure --tls-cert-file/--tls-key-file and --tokens-file, or pass "
                              f"--allow-insecure-remote", "host")
        self.store_config()  # validate the store/tier sections now, with their own messages

    @property
    def loopback(self) -> bool:
        """Whether ``host`` is a loopback address, or a name that resolves to loopback addresses only.
        A name that does not resolve is a ConfigError (it could not be bound either)."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            pass
        try:
            found = socket.getaddrinfo(self.host, None, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            why = e.strerror if isinstance(e, socket.gaierror) else str(e)
            raise ConfigError(f"--host {self.host!r} does not resolve ({why}): give an address of this host, "
                              f"e.g. 127.0.0.1 or 0.0.0.0", "host") from None
        return all(ipaddress.ip_address(str(a[4][0]).split("%")[0]).is_loopback for a in found)

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


def _nonneg(v: Any) -> bool:
    return isinstance(v, int | float) and v >= 0


_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("port", lambda v: isinstance(v, int) and 0 <= v < 65536, "0-65535 (0 picks a free port)"),
    ("metrics_port", lambda v: isinstance(v, int) and 0 <= v < 65536, "0-65535 (0 = no metrics)"),
    ("log_format", lambda v: v in ("json", "text"), "json or text"),
    ("host_capacity_bytes", _nonneg, ">= 0 (0 = unlimited)"),
    ("ssd_capacity_bytes", _nonneg, ">= 0 (0 = unlimited)"),
    ("ssd_max_map_bytes", _nonneg, ">= 0 (0 = no limit)"),
    ("hbm_capacity_bytes", _nonneg, ">= 0 (0 = no HBM tier)"),
    ("zstd_level", lambda v: isinstance(v, int) and 0 <= v <= 22, "0 (off) to 22"),
    ("redis_ttl_s", _nonneg, ">= 0 (0 = no expiry)"),
    ("redis_wait_replicas", _nonneg, ">= 0 (0 = do not wait)"),
    ("redis_wait_timeout_ms", lambda v: isinstance(v, int | float) and v > 0, "> 0"),
    ("chunk_tokens", lambda v: isinstance(v, int) and v > 0 and v % 2 == 0, "a positive even number"),
    ("write_mode", lambda v: v in ("through", "back"), "through or back"),
    ("grace_s", _nonneg, ">= 0"),
    ("health_interval_s", lambda v: isinstance(v, int | float) and v > 0, "> 0"),
)


def env_names() -> list[str]:
    """Every environment variable the daemon's config reads."""
    names = [env_name(f.name) for f in fields(DaemonConfig) if f.name != "tls"]
    return names + [env_name(f"tls.{f.name}") for f in fields(TlsConfig)]


def _coerce(value: Any, typ: Any, origin: str) -> Any:
    """``value`` as the setting's type: strings (from the environment, or quoted in TOML) are parsed;
    anything else must already be of that type."""
    t = str(typ)
    if isinstance(value, str):
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
            raise ValueError(f"{origin}: cannot read {value!r} as {t}") from None
        return value
    ok = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}.get(t, (object,))
    if not isinstance(value, ok) or (t != "bool" and isinstance(value, bool)):
        raise ValueError(f"{origin}: must be {'a number' if t == 'float' else t}, got {value!r}")
    return value


class _Toml:
    """A --config file: its settings, and the line each was set on (for messages)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"--config {path}: {e.strerror or e}") from None
        try:
            self.data = tomllib.loads(self.text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config {path}: {e}") from None

    def origin(self, key: str, table: str = "") -> str:
        """``file line N: key`` (the line where ``key`` is set in ``[table]``), or ``file: key``."""
        current, pattern = "", re.compile(rf"""\s*(["']?){re.escape(key)}\1\s*=""")
        for i, line in enumerate(self.text.splitlines(), 1):
            header = re.match(r"\s*\[\s*([^\]]+?)\s*\]", line)
            if header:
                current = header.group(1)
            elif current == table and pattern.match(line):
                return f"{self.path} line {i}: {f'{table}.' if table else ''}{key}"
        return f"{self.path}: {f'{table}.' if table else ''}{key}"


def _unknown(toml: _Toml, keys: set[str], known: list[str], table: str = "") -> str:
    parts = []
    for key in sorted(keys):
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        parts.append(f"{toml.origin(key, table)} is not a setting" + (f" (did you mean {close[0]!r}?)" if close
                                                                      else ""))
    return "; ".join(parts)


def load_config(toml_path: str | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> DaemonConfig:
    """defaults < TOML file < environment (KVSTORE_*) < explicit overrides (CLI flags, None = unset).
    Every error is a ValueError (a ConfigError) in one line that says where the bad value came from:
    the flag, the variable, or the file and line."""
    known = {f.name: f.type for f in fields(DaemonConfig) if f.name != "tls"}
    tls_known = {f.name: f.type for f in fields(TlsConfig)}
    values: dict[str, Any] = {}  # setting -> value; TLS settings as "tls.NAME"
    origin: dict[str, str] = {}  # setting -> where its value came from
    if toml_path:
        toml = _Toml(toml_path)
        data = dict(toml.data)
        tls = data.pop("tls", {})
        if not isinstance(tls, dict):
            raise ConfigError(f"{toml.origin('tls')}: must be a table ([tls])")
        if unknown := set(data) - set(known):
            raise ConfigError(_unknown(toml, unknown, list(known)))
        if unknown := set(tls) - set(tls_known):
            raise ConfigError(_unknown(toml, unknown, list(tls_known), "tls"))
        for k, v in [*data.items(), *((f"tls.{k}", v) for k, v in tls.items())]:
            table, _, key = k.rpartition(".")
            values[k], origin[k] = v, toml.origin(key, table)
    env = os.environ if env is None else env
    for name in [*known, *(f"tls.{k}" for k in tls_known)]:
        if (v := env.get(env_name(name))) is not None:
            values[name], origin[name] = v, f"${env_name(name)}"
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        name = f"tls.{k[4:]}" if k.startswith("tls_") else k
        if name.removeprefix("tls.") not in (tls_known if name.startswith("tls.") else known):
            raise ConfigError(f"unknown setting {k!r}")
        values[name], origin[name] = v, setting(name)
    typed = {}
    for name, v in values.items():
        typ = tls_known[name[4:]] if name.startswith("tls.") else known[name]
        typed[name] = _coerce(v, typ, origin[name])
    tls_values = {k[4:]: v for k, v in typed.items() if k.startswith("tls.")}
    try:
        return DaemonConfig(**{k: v for k, v in typed.items() if not k.startswith("tls.")},
                            tls=TlsConfig(**tls_values))
    except ConfigError as e:
        where = [origin[k] for k in e.keys if k in origin and origin[k] != setting(k)]
        raise ConfigError(f"{e} (from {', '.join(where)})" if where else str(e), *e.keys) from None
