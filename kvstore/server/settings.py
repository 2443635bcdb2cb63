"""How the daemon's settings are named, read and typed: generated from the config dataclasses' own
fields, so that a setting, its default and its help are written once, on the field.

A setting is a field with ``option(help)`` metadata (``kvstore/tiers/config.py``) of ``DaemonConfig``
(the daemon's own: ``port``, ``data_dir``), of ``TlsConfig`` (``tls.cert_file``), or of a section: a
tier's config (``[hbm]``, ``[host]``, ``[ssd]``, ``[redis]``) or ``StoreConfig``'s own fields
(``[store]``). The setting ``ssd.zstd_level`` is the key ``zstd_level`` of the TOML table ``[ssd]``,
the flag ``--ssd-zstd-level`` and the variable ``KVSTORE_SSD_ZSTD_LEVEL``. Its default is the
config's own: a store's default host and ssd tiers (``StoreConfig()``), the class's otherwise. The
``[redis]`` and ``[hbm]`` sections add their tier only when ``url`` / ``capacity_bytes`` is given.

Before sections, these settings were flat (the TOML key ``zstd_level``, ``--zstd-level``,
``KVSTORE_CHUNK_TOKENS``): every old name still works, as an alias of its setting (``ALIASES``).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvstore.store.config import StoreConfig
from kvstore.tiers.config import (
    HbmTierConfig,
    HostTierConfig,
    InvalidSetting,
    RedisTierConfig,
    SsdTierConfig,
    TierConfig,
)


class ConfigError(ValueError):
    """A setting that cannot be used; ``keys`` are the settings at fault (``port``, ``tls.cert_file``),
    so that ``load_config`` can say where their values came from."""

    def __init__(self, message: str, *keys: str) -> None:
        super().__init__(message)
        self.keys = keys


def flag_name(name: str) -> str:
    """A setting's flag: ``--ssd-zstd-level`` for ``ssd.zstd_level``."""
    return "--" + name.replace(".", "-").replace("_", "-")


def env_name(name: str) -> str:
    """A setting's environment variable: ``KVSTORE_PORT``, ``KVSTORE_SSD_ZSTD_LEVEL``."""
    return "KVSTORE_" + name.replace(".", "_").upper()


@dataclass(frozen=True)
class Setting:
    name: str  # "port", "tls.cert_file", "ssd.zstd_level"
    type: str  # "int" | "float" | "bool" | "str"
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    adds_tier: bool = False  # giving it adds its section's tier (it has no default of its own)

    @property
    def flag(self) -> str:
        return flag_name(self.name)

    @property
    def env(self) -> str:
        return env_name(self.name)


def settings_of(config: Any, prefix: str = "", adds: str = "") -> list[Setting]:
    """The settings of a config dataclass instance (its defaults), named ``prefix + field``."""
    return [Setting(prefix + f.name, str(f.type), getattr(config, f.name), f.metadata["help"],
                    f.metadata["choices"], f.name == adds)
            for f in fields(config) if "help" in f.metadata]


@dataclass(frozen=True)
class Section:
    """A TOML table of store settings: a tier's config, or the store's own fields."""

    name: str
    default: Any  # the config whose values are the section's defaults
    adds: str = ""  # the field whose value adds the tier ("" = the tier is always there)


def _store_tier(cls: type) -> Any:
    return next(t for t in StoreConfig().tiers if isinstance(t, cls))


#: Fast to slow, then the store's own: the order of ``StoreConfig.tiers``.
SECTIONS = (Section("hbm", HbmTierConfig(), adds="capacity_bytes"), Section("host", _store_tier(HostTierConfig)),
            Section("ssd", _store_tier(SsdTierConfig)), Section("redis", RedisTierConfig(), adds="url"),
            Section("store", StoreConfig()))
SECTION_SETTINGS = [s for sec in SECTIONS for s in settings_of(sec.default, f"{sec.name}.", sec.adds)]

#: The flat names settings had before sections (their TOML keys; ``KVSTORE_`` + the name in capitals),
#: each an alias of its setting.
ALIASES = {
    "host_capacity_bytes": "host.capacity_bytes", "ssd_capacity_bytes": "ssd.capacity_bytes",
    "ssd_max_map_bytes": "ssd.max_map_bytes", "zstd_level": "ssd.zstd_level",
    "ssd_compact_records": "ssd.compact_records", "sync": "ssd.sync", "redis_url": "redis.url",
    "redis_namespace": "redis.namespace", "redis_ttl_s": "redis.ttl_s", "redis_cluster": "redis.cluster",
    "redis_share_sessions": "redis.share_sessions", "redis_wait_replicas": "redis.wait_replicas",
    "redis_wait_timeout_ms": "redis.wait_timeout_ms", "hbm_capacity_bytes": "hbm.capacity_bytes",
    "chunk_tokens": "store.chunk_tokens", "write_mode": "store.write_mode", "promote_on_read": "store.promote_on_read",
}
#: The old flags that are not also the new ones: flag -> (alias, the value a bare flag gives, None: takes one).
OLD_FLAGS: dict[str, tuple[str, bool | None]] = {
    "--zstd-level": ("zstd_level", None), "--no-sync": ("sync", False), "--chunk-tokens": ("chunk_tokens", None),
    "--write-mode": ("write_mode", None)}


#: The aliases that had no flag (a TOML key or a variable only).
_FLAGLESS = ("redis_namespace", "promote_on_read")


def old_flag(alias: str) -> str | None:
    """How an alias was spelled as a flag (``--zstd-level``, ``--no-sync``); None if it had none."""
    if alias in _FLAGLESS:
        return None
    return next((f for f, (a, _) in OLD_FLAGS.items() if a == alias), flag_name(alias))


def build_store(values: Mapping[str, Any], label: Callable[[str], str] = flag_name) -> StoreConfig:
    """The store the section settings in ``values`` (typed, by setting name) describe; a bad value
    is a ConfigError saying what ``label(setting)`` must be."""
    tiers: list[TierConfig] = []
    for sec in SECTIONS:
        given = {k[len(sec.name) + 1:]: v for k, v in values.items() if k.startswith(f"{sec.name}.")}
        try:
            if sec is SECTIONS[-1]:
                return StoreConfig(tiers=tuple(tiers), **given)
            if sec.adds and not given.get(sec.adds):  # no such tier; what was given must still be valid
                replace(sec.default, **{k: v for k, v in given.items() if k != sec.adds})
                continue
            tiers.append(replace(sec.default, **given))
        except InvalidSetting as e:
            name = f"{sec.name}.{e.field}"
            raise ConfigError(f"{label(name)} {e.requirement}", name) from None
    raise AssertionError("SECTIONS ends with the store's own")


def coerce(value: Any, typ: str, origin: str) -> Any:
    """``value`` as the setting's type: strings (from the environment, or quoted in TOML) are parsed;
    anything else must already be of that type."""
    if isinstance(value, str):
        try:
            if typ == "bool":
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            if typ == "int":
                return int(value)
            if typ == "float":
                return float(value)
        except ValueError:
            raise ValueError(f"{origin}: cannot read {value!r} as {typ}") from None
        return value
    ok = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}.get(typ, (object,))
    if not isinstance(value, ok) or (typ != "bool" and isinstance(value, bool)):
        raise ValueError(f"{origin}: must be {'a number' if typ == 'float' else typ}, got {value!r}")
    return value


class TomlFile:
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
            both = re.search(r"^\s*host\s*=", self.text.split("[", 1)[0], re.M) and re.search(
                r"^\s*\[\s*host\s*\]", self.text, re.M)  # TOML has one ``host``: the address or the table
            hint = "; the bind address and the [host] table are both `host`: give the address as [server] host"
            raise ConfigError(f"--config {path}: {e}{hint if both else ''}") from None

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
