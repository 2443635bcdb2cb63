"""The daemon's one frozen config, built in one place from defaults < TOML file < environment < flags.

Its store is a ``StoreConfig`` whose tiers and own settings come in sections (``[host]``, ``[ssd]``,
``[redis]``, ``[hbm]``, ``[store]``), each the fields of that config, with that config's defaults
(``settings.py``; docs/CONFIG.md lists them all). Environment variables are ``KVSTORE_<NAME>``:
``KVSTORE_PORT``, ``KVSTORE_TLS_CERT_FILE``, ``KVSTORE_SSD_ZSTD_LEVEL``.

In a TOML file the daemon's own settings are top-level keys (or the table ``[server]``: a file that
has a ``[host]`` table gives the bind address as ``[server] host``, TOML allowing one ``host``).
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvstore.defaults import DEFAULT_PORT
from kvstore.server.settings import (
    ALIASES,
    SECTION_SETTINGS,
    SECTIONS,
    ConfigError,
    Setting,
    TomlFile,
    build_store,
    coerce,
    env_name,
    flag_name,
    old_flag,
    settings_of,
)
from kvstore.store import StoreConfig
from kvstore.tiers import SsdTierConfig
from kvstore.tiers.config import option

__all__ = ["SETTINGS", "ConfigError", "DaemonConfig", "TlsConfig", "env_names", "load_config", "setting"]


def setting(name: str) -> str:
    """How an operator names a setting in a message: its flag (``--tls-cert-file`` for ``tls.cert_file``)."""
    return flag_name(name)


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str = field(default="", metadata=option("server certificate (PEM); with the key, turns TLS on"))
    key_file: str = field(default="", metadata=option("server private key (PEM)"))
    client_ca_file: str = field(default="", metadata=option(
        "require client certificates signed by this CA (mutual TLS)"))

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


@dataclass(frozen=True)
class DaemonConfig:
    host: str = field(default="127.0.0.1", metadata=option("address to bind"))
    port: int = field(default=DEFAULT_PORT, metadata=option("port; 0 picks a free one and prints it"))
    data_dir: str = field(default="kvstore-data", metadata=option("where the LMDB tier lives (<data_dir>/ssd)"))
    shared_memory: bool = field(default=True, metadata=option("offer same-host transfers through /dev/shm"))
    tokens_file: str = field(default="", metadata=option("TOML [tokens] table of per-namespace bearer tokens"))
    metrics_port: int = field(default=0, metadata=option("serve Prometheus metrics on this port; 0 = none"))
    log_format: str = field(default="json", metadata=option("log lines as", choices=("json", "text")))
    log_level: str = field(default="INFO", metadata=option("DEBUG, INFO, WARNING, ERROR or CRITICAL"))
    allow_insecure_remote: bool = field(default=False, metadata=option(
        "permit a non-loopback bind without TLS and tokens"))
    grace_s: float = field(default=10.0, metadata=option("shutdown: in-flight RPCs get this long to finish"))
    health_interval_s: float = field(default=5.0, metadata=option(
        "every tier is probed this often for the health service"))
    tls: TlsConfig = field(default_factory=TlsConfig)
    #: The store and its tiers (the sections); its ssd tier lives in ``data_dir``, whatever path it names.
    store: StoreConfig = field(default_factory=StoreConfig)

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
        path = str(Path(self.data_dir) / "ssd")
        object.__setattr__(self, "store", replace(self.store, tiers=tuple(
            replace(t, path=path) if isinstance(t, SsdTierConfig) else t for t in self.store.tiers)))

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
        return self.store


def _nonneg(v: Any) -> bool:
    return isinstance(v, int | float) and v >= 0


_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("port", lambda v: isinstance(v, int) and 0 <= v < 65536, "0-65535 (0 picks a free port)"),
    ("metrics_port", lambda v: isinstance(v, int) and 0 <= v < 65536, "0-65535 (0 = no metrics)"),
    ("log_format", lambda v: v in ("json", "text"), "json or text"),
    ("grace_s", _nonneg, ">= 0"),
    ("health_interval_s", lambda v: isinstance(v, int | float) and v > 0, "> 0"),
)

#: Every setting by name: the daemon's own, TLS, then the sections'.
SETTINGS: dict[str, Setting] = {s.name: s for s in [*settings_of(DaemonConfig()), *settings_of(TlsConfig(), "tls."),
                                                    *SECTION_SETTINGS]}
_TABLES = ("server", "tls", *(sec.name for sec in SECTIONS))


def _env_vars() -> dict[str, str]:
    """Every variable read, a setting's or an alias's, and the setting it sets."""
    out = {s.env: s.name for s in SETTINGS.values()}
    for alias, name in ALIASES.items():
        if out.setdefault(env_name(alias), name) != name:
            raise AssertionError(f"${env_name(alias)} would name two settings")
    return out


_ENV = _env_vars()


def env_names() -> list[str]:
    """Every environment variable the daemon's config reads."""
    return list(_ENV)


def _toml_settings(toml: TomlFile) -> Iterator[tuple[str, Any, str]]:
    """(setting, value, where) for each setting a --config file sets."""
    for key, value in toml.data.items():
        table = key if key in _TABLES and (isinstance(value, dict) or key != "host") else ""
        if table and not isinstance(value, dict):
            raise ConfigError(f"{toml.origin(key)}: must be a table ([{key}])")
        if not table:
            name = key if key in SETTINGS else ALIASES.get(key)
            if name is None:
                raise ConfigError(_unknown(toml, key, [*_TABLES, *(n for n in SETTINGS if "." not in n), *ALIASES]))
            yield name, value, toml.origin(key)
            continue
        prefix = "" if table == "server" else f"{table}."
        known = [n[len(prefix):] for n in SETTINGS if n.startswith(prefix) and "." not in n[len(prefix):]]
        if unknown := sorted(set(value) - set(known)):
            raise ConfigError("; ".join(_unknown(toml, k, known, table) for k in unknown))
        for k, v in value.items():
            yield prefix + k, v, toml.origin(k, table)


def _unknown(toml: TomlFile, key: str, known: list[str], table: str = "") -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"{toml.origin(key, table)} is not a setting" + (f" (did you mean {close[0]!r}?)" if close else "")


def _override(key: str) -> tuple[str, str]:
    """The setting an override (a flag's argparse dest) sets, and how the operator spelled it."""
    if key in SETTINGS:
        return key, setting(key)
    if key.startswith("tls_") and f"tls.{key[4:]}" in SETTINGS:  # the dests of the --tls-* flags
        return f"tls.{key[4:]}", setting(f"tls.{key[4:]}")
    if key in ALIASES:
        return ALIASES[key], old_flag(key) or setting(ALIASES[key])
    raise ConfigError(f"unknown setting {key!r}")


def load_config(toml_path: str | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> DaemonConfig:
    """defaults < TOML file < environment (KVSTORE_*) < explicit overrides (CLI flags by argparse dest,
    a setting's name or an old flat name; None = unset). Every error is a ValueError (a ConfigError)
    in one line that says where the bad value came from: the flag, the variable, or the file and line."""
    env = os.environ if env is None else env
    sources = [list(_toml_settings(TomlFile(toml_path))) if toml_path else [],
               [(_ENV[var], env[var], f"${var}") for var in _ENV if var in env],
               [(name, v, where) for k, v in (overrides or {}).items() if v is not None
                for name, where in [_override(k)]]]
    values: dict[str, Any] = {}  # setting -> value
    origin: dict[str, str] = {}  # setting -> where its value came from
    for source in sources:  # each overrides the ones before it
        seen: dict[str, str] = {}
        for name, value, where in source:
            if name in seen:  # an old spelling and the new one, say: which was meant?
                raise ConfigError(f"{seen[name]} and {where} are one setting ({setting(name)}): give it once", name)
            seen[name] = origin[name] = where
            values[name] = value
    typed = {name: coerce(v, SETTINGS[name].type, origin[name]) for name, v in values.items()}

    def label(name: str) -> str:  # the flag the operator typed, an old spelling included
        return origin[name] if origin.get(name, "").startswith("--") else setting(name)

    try:
        return DaemonConfig(**{k: v for k, v in typed.items() if k in SETTINGS and "." not in k},
                            tls=TlsConfig(**{k[4:]: v for k, v in typed.items() if k.startswith("tls.")}),
                            store=build_store(typed, label))
    except ConfigError as e:
        came = [origin[k] for k in e.keys if k in origin and not origin[k].startswith("--")]
        raise ConfigError(f"{e} (from {', '.join(came)})" if came else str(e), *e.keys) from None


def reference() -> str:
    """The settings as docs/CONFIG.md lists them (``python -m kvstore.server.config`` prints it)."""

    def shown(s: Setting) -> str:
        if s.adds_tier or s.default == "":
            return "none"
        return ("on" if s.default else "off") if s.type == "bool" else f"`{s.default}`"

    rows = ["| TOML | flag | environment | default | what |", "|---|---|---|---|---|"]
    for s in SETTINGS.values():
        table, _, key = s.name.rpartition(".")
        rows.append(f"| {f'`[{table}] {key}`' if table else f'`{key}`'} | `{s.flag}` | `{s.env}` | {shown(s)} | "
                    f"{s.help} |")
    rows += ["", "| old TOML key | old flag | old variable | now |", "|---|---|---|---|"]
    for alias, name in ALIASES.items():
        new = SETTINGS[name]
        flag, env = old_flag(alias), env_name(alias)
        rows.append(f"| `{alias}` | {'none' if flag is None else f'`{flag}`' if flag != new.flag else 'the same'} | "
                    f"{f'`{env}`' if env != new.env else 'the same'} | `[{name.replace('.', '] ')}` |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(reference(), end="")
