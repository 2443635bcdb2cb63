"""The daemon's config: sections built from the tier configs' own fields, flags generated from them,
every old name still working (TOML key, variable, flag), and docs/CONFIG.md listing them all.
The one-line messages of mistakes are tested through `kvstore serve` in test_cli.py."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cli.main import build_parser
from cli.serve_cmd import config_of
from kvstore.server.config import SETTINGS, ConfigError, DaemonConfig, load_config, reference
from kvstore.server.settings import ALIASES, OLD_FLAGS, old_flag
from kvstore.store import StoreConfig
from kvstore.tiers import HbmTierConfig, HostTierConfig, RedisTierConfig, SsdTierConfig
from tests.helpers.daemon import REPO

#: A value other than the default for each aliased setting.
VALUES: dict[str, Any] = {
    "host.capacity_bytes": 12345, "ssd.capacity_bytes": 6789, "ssd.max_map_bytes": 1 << 31, "ssd.zstd_level": 7,
    "ssd.compact_records": True, "ssd.sync": False, "redis.url": "redis://10.0.0.5:7000/0",
    "redis.namespace": "team", "redis.ttl_s": 60, "redis.cluster": True, "redis.share_sessions": True,
    "redis.wait_replicas": 2, "redis.wait_timeout_ms": 250, "hbm.capacity_bytes": 1 << 20,
    "store.chunk_tokens": 512, "store.write_mode": "back", "store.promote_on_read": False,
}


def serve(*flags: str, env: dict[str, str] | None = None) -> DaemonConfig:
    """The config `kvstore serve FLAGS` runs with, in environment ``env`` (nothing else)."""
    return config_of(build_parser().parse_args(["serve", *flags]), env or {})


def tier(config: DaemonConfig, cls: type) -> Any:
    return next((t for t in config.store.tiers if isinstance(t, cls)), None)


def value_of(config: DaemonConfig, name: str) -> Any:
    section, _, key = name.partition(".")
    owner = config.store if section == "store" else tier(config, {
        "host": HostTierConfig, "ssd": SsdTierConfig, "redis": RedisTierConfig, "hbm": HbmTierConfig}[section])
    return getattr(owner, key)


def test_the_defaults_are_the_stores_own(tmp_path: Path) -> None:
    d = DaemonConfig(data_dir=str(tmp_path))
    ssd = SsdTierConfig(path=str(tmp_path / "ssd"))
    assert d.store == replace(StoreConfig(), tiers=(StoreConfig().tiers[0], ssd)) == d.store_config()
    assert serve("--data-dir", str(tmp_path)) == d  # no Redis, no HBM tier unless asked for


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_every_old_name_still_sets_its_setting(alias: str, tmp_path: Path) -> None:
    """An old TOML key, variable and flag each give the same config as the new name."""
    name, value = ALIASES[alias], VALUES[ALIASES[alias]]
    s = SETTINGS[name]
    text = str(value).lower() if isinstance(value, bool) else repr(value)
    section, _, key = name.partition(".")
    base = ("--redis-url", "redis://r:1/0") if section == "redis" and key != "url" else ()  # a tier to set
    new = serve(*base, "--config", _toml(tmp_path / "new.toml", f"[{section}]\n{key} = {text}\n"))
    assert value_of(new, name) == value and new != serve(*base)
    assert serve(*base, "--config", _toml(tmp_path / "old.toml", f"{alias} = {text}\n")) == new
    assert serve(*base, env={f"KVSTORE_{alias.upper()}": str(value)}) == new
    assert serve(*base, env={s.env: str(value)}) == new
    flag = old_flag(alias)
    if flag is None:
        return
    if s.type == "bool":  # the value differs from the default: the bare old flag (--no-sync, --redis-cluster)
        assert serve(*base, flag) == new == serve(*base, s.flag if value else f"--no-{s.flag[2:]}")
    else:
        assert serve(*base, flag, str(value)) == new == serve(*base, s.flag, str(value))


def test_the_old_flags_that_differ_are_hidden_aliases() -> None:
    help_text = _serve_help(build_parser())
    for flag in OLD_FLAGS:
        assert f" {flag} " not in help_text and f" {flag}," not in help_text
    for s in SETTINGS.values():
        assert s.flag in help_text


def _serve_help(parser: argparse.ArgumentParser) -> str:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"].format_help()


def _toml(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_sections_in_toml_environment_and_flags(tmp_path: Path) -> None:
    toml = _toml(tmp_path / "c.toml", 'data_dir = "/srv/kv"\n[ssd]\nzstd_level = 5\nsync = false\n'
                                      '[redis]\nurl = "redis://r:1/0"\n[store]\nchunk_tokens = 128\n')
    c = serve("--config", toml, "--redis-ttl-s", "9", env={"KVSTORE_SSD_ZSTD_LEVEL": "6"})
    assert [type(t) for t in c.store.tiers] == [HostTierConfig, SsdTierConfig, RedisTierConfig]
    ssd, redis = tier(c, SsdTierConfig), tier(c, RedisTierConfig)
    assert (ssd.path, ssd.zstd_level, ssd.sync) == ("/srv/kv/ssd", 6, False)  # the variable beats the file
    assert (redis.url, redis.ttl_s, c.store.chunk_tokens) == ("redis://r:1/0", 9, 128)


def test_the_prefetch_cap_per_namespace_is_a_store_setting(tmp_path: Path) -> None:
    """`[store] max_prefetch_per_namespace` (16 unless set) from the file, the variable and the flag, in
    `kvstore serve --help`; the daemon's prefetcher takes it from the store (test_quota_accounting.py)."""
    assert serve().store.max_prefetch_per_namespace == 16
    toml = _toml(tmp_path / "c.toml", "[store]\nmax_prefetch_per_namespace = 4\n")
    assert serve("--config", toml).store.max_prefetch_per_namespace == 4
    env = {"KVSTORE_STORE_MAX_PREFETCH_PER_NAMESPACE": "5"}
    assert serve("--config", toml, env=env).store.max_prefetch_per_namespace == 5
    assert serve("--store-max-prefetch-per-namespace", "6", env=env).store.max_prefetch_per_namespace == 6
    assert "--store-max-prefetch-per-namespace" in _serve_help(build_parser())


def test_redis_and_hbm_tiers_are_added_by_their_url_and_capacity() -> None:
    assert [t.capacity_bytes for t in serve("--hbm-capacity-bytes", "4096").store.tiers[:1]] == [4096]
    assert tier(serve("--hbm-capacity-bytes", "0"), HbmTierConfig) is None
    assert tier(serve("--redis-ttl-s", "5"), RedisTierConfig) is None  # ignored without a URL, as before
    with pytest.raises(ConfigError, match=r"^--redis-ttl-s must be >= 0 \(0 = no expiry\), got -1$"):
        serve("--redis-ttl-s", "-1")  # but checked all the same


def test_the_bind_address_beside_a_host_table(tmp_path: Path) -> None:
    both = _toml(tmp_path / "both.toml", '[server]\nhost = "localhost"\n[host]\ncapacity_bytes = 77\n')
    c = serve("--config", both)
    assert (c.host, tier(c, HostTierConfig).capacity_bytes) == ("localhost", 77)
    assert serve("--config", _toml(tmp_path / "flat.toml", 'host = "localhost"\n')).host == "localhost"
    clash = _toml(tmp_path / "clash.toml", 'host = "localhost"\n[host]\ncapacity_bytes = 77\n')
    with pytest.raises(ConfigError, match=r"give the address as \[server\] host"):
        serve("--config", clash)


def test_one_source_may_not_name_a_setting_twice(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--ssd-zstd-level and --zstd-level are one setting"):
        serve("--ssd-zstd-level", "3", "--zstd-level", "4")
    with pytest.raises(ConfigError, match=r"line 1: zstd_level and .* line 3: ssd.zstd_level are one setting"):
        serve("--config", _toml(tmp_path / "two.toml", "zstd_level = 2\n[ssd]\nzstd_level = 3\n"))
    with pytest.raises(ConfigError, match=r"are one setting \(--store-chunk-tokens\)"):
        serve(env={"KVSTORE_CHUNK_TOKENS": "128", "KVSTORE_STORE_CHUNK_TOKENS": "64"})
    assert tier(serve("--zstd-level", "4", env={"KVSTORE_SSD_ZSTD_LEVEL": "3"}), SsdTierConfig).zstd_level == 4


@pytest.mark.parametrize(("flags", "env", "message"), [
    (("--zstd-level", "30"), {}, "--zstd-level must be 0 (off) to 22, got 30"),  # the spelling typed
    (("--ssd-zstd-level", "30"), {}, "--ssd-zstd-level must be 0 (off) to 22, got 30"),
    ((), {"KVSTORE_ZSTD_LEVEL": "30"}, "--ssd-zstd-level must be 0 (off) to 22, got 30 (from $KVSTORE_ZSTD_LEVEL)"),
    (("--store-write-mode", "back", "--store-chunk-tokens", "3"), {},
     "--store-chunk-tokens must be a positive even number, got 3"),
    (("--ssd-max-map-bytes", "-1"), {}, "--ssd-max-map-bytes must be >= 0 (0 = no limit), got -1"),
    (("--host-capacity-bytes", "-1"), {}, "--host-capacity-bytes must be >= 0 (0 = unlimited), got -1"),
    (("--store-max-prefetch-per-namespace", "0"), {}, "--store-max-prefetch-per-namespace must be at least 1, got 0"),
    ((), {"KVSTORE_STORE_MAX_PREFETCH_PER_NAMESPACE": "-2"},
     "--store-max-prefetch-per-namespace must be at least 1, got -2 (from $KVSTORE_STORE_MAX_PREFETCH_PER_NAMESPACE)"),
    ((), {"KVSTORE_REDIS_URL": "redis://x:1/0", "KVSTORE_REDIS_NAMESPACE": "a b"},
     "--redis-namespace must match [A-Za-z0-9_.-]+, got 'a b' (from $KVSTORE_REDIS_NAMESPACE)"),
])
def test_a_bad_value_names_the_setting_as_the_operator_gave_it(flags: tuple[str, ...], env: dict[str, str],
                                                              message: str) -> None:
    with pytest.raises(ConfigError) as e:
        serve(*flags, env=env)
    assert str(e.value) == message


def test_load_config_takes_setting_names_and_old_names() -> None:
    new = load_config(env={}, overrides={"ssd.zstd_level": 4, "store.chunk_tokens": 64})
    assert load_config(env={}, overrides={"zstd_level": 4, "chunk_tokens": 64}) == new
    with pytest.raises(ConfigError, match="unknown setting 'zstd'"):
        load_config(env={}, overrides={"zstd": 4})


def test_docs_list_every_setting_and_old_name() -> None:
    """docs/CONFIG.md holds ``python -m kvstore.server.config``'s tables as they are now."""
    doc = (REPO / "docs" / "CONFIG.md").read_text()
    settings, aliases = reference().split("\n\n")
    assert settings in doc and aliases in doc
