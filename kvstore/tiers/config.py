"""Frozen configuration of each tier. Defaults live here and nowhere else.

Every config has ``capacity_bytes`` (0 = unlimited): the tier only reports it in ``stats()``;
the tiered store enforces it by demoting.

A field with ``option(help)`` metadata is an operator's setting: the daemon's config has a section
per tier made of these fields (``[ssd] zstd_level``, ``--ssd-zstd-level``, ``KVSTORE_SSD_ZSTD_LEVEL``:
``kvstore/server/settings.py``), with the default given here. A bad value raises ``InvalidSetting``,
naming the field, so that the daemon can say which flag, variable or TOML key it came from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_NAMESPACE = re.compile(r"[A-Za-z0-9_.\-]+")


def option(help: str, choices: tuple[str, ...] = ()) -> dict[str, Any]:
    """Field metadata that makes a config field an operator's setting, with its help text (and, for
    a string, the values it takes)."""
    return {"help": help, "choices": choices}


class InvalidSetting(ValueError):
    """A config field was given a value it cannot take: ``field``, and what it must be."""

    def __init__(self, owner: str, field: str, requirement: str) -> None:
        super().__init__(f"{owner}: {field} {requirement}")
        self.field = field
        self.requirement = requirement  # "must be 0 (off) to 22, got 30"


def _check_capacity(tier: str, capacity_bytes: int) -> None:
    if capacity_bytes < 0:
        raise InvalidSetting(f"{tier} tier", "capacity_bytes", f"must be >= 0 (0 = unlimited), got {capacity_bytes}")


@dataclass(frozen=True)
class HostTierConfig:
    """Values in process memory."""

    capacity_bytes: int = field(default=0, metadata=option("host-memory tier size, 0 = unlimited"))
    pin_memory: bool = True  # keep values in pinned (page-locked) memory when CUDA is available
    #: Memory faulted in ahead of the saves and promotions that copy values in (tiers/host/tier.py), per
    #: value size (at most 4 sizes), and the most of it kept free after values are dropped.
    reserve_bytes: int = field(default=16 << 20, metadata=option(
        "host memory kept faulted in ahead of saves, per value size (tiers/host/tier.py); 0 = none"))

    def __post_init__(self) -> None:
        _check_capacity("host", self.capacity_bytes)
        if self.reserve_bytes < 0:
            raise InvalidSetting("host tier", "reserve_bytes", f"must be >= 0, got {self.reserve_bytes}")


@dataclass(frozen=True)
class SsdTierConfig:
    """Values in an LMDB environment on local disk, stored raw or zstd-compressed (``zstd_level``)."""

    path: str = "kvstore-data/ssd"  # the daemon's is <data_dir>/ssd
    capacity_bytes: int = field(default=0, metadata=option("ssd tier size (its reported capacity), 0 = unlimited"))
    #: The map never grows past this: saves then fail (ResourceExhausted) and reads go on. 0 = no limit.
    max_map_bytes: int = field(default=0, metadata=option(
        "hard limit of the LMDB file: past it saves fail with RESOURCE_EXHAUSTED and reads go on; "
        "0 = none (the disk is the limit)"))
    #: 0 = store raw (the default); 1..22 = zstd level of a chunk's scales tail (1 compresses E4M3
    #: scales best per second). Off by default: at deepseek-v4.1-flash level 1 keeps 866 instead of
    #: 898 B/token at rest (3.6% less) but a whole-session load from this tier took 2.2x as long
    #: (46 vs 21 ms for 128K tokens: the FP4 codes are copied out of the map and the tails decoded
    #: before the one copy to the caller; benchmarks/results/resume_geometry.md), and saves 1.3x.
    zstd_level: int = field(default=0, metadata=option(
        "ssd compression level of chunks' scales, 0 = off (the default: 3.6% more bytes at rest, "
        "ssd loads 2.2x as fast)"))
    #: Chunks as record flag 2 (codes and scales transformed, then compressed: 834 instead of 898
    #: B/token at rest at the real geometry, but encoded ~10x and decoded ~14x slower: 235 / 283 MB/s,
    #: benchmarks/results/at_rest.md), at ``zstd_level`` or, when that is 0, level 1. For stores bound
    #: by capacity, not latency.
    compact_records: bool = field(default=False, metadata=option(
        "store chunks in the compact record format (zstd level 1 unless --ssd-zstd-level says another): "
        "7% fewer bytes at rest (834 vs 898 B/token at deepseek-v4.1-flash), ~10x slower to encode and decode"))
    #: True: a put that returned is on disk; False: flushed on flush()/close()
    sync: bool = field(default=True, metadata=option("fsync every acknowledged write"))
    map_size: int = 1 << 30  # initial LMDB map size (at most max_map_bytes); doubled whenever it fills

    def __post_init__(self) -> None:
        _check_capacity("ssd", self.capacity_bytes)
        if not self.path:
            raise InvalidSetting("ssd tier", "path", "must not be empty")
        if not 0 <= self.zstd_level <= 22:
            raise InvalidSetting("ssd tier", "zstd_level", f"must be 0 (off) to 22, got {self.zstd_level}")
        if self.map_size <= 0:
            raise InvalidSetting("ssd tier", "map_size", f"must be > 0, got {self.map_size}")
        if self.max_map_bytes < 0:
            raise InvalidSetting("ssd tier", "max_map_bytes", f"must be >= 0 (0 = no limit), got {self.max_map_bytes}")

    @property
    def record_level(self) -> int:
        """The zstd level records are written at: ``zstd_level``, or 1 for compact records asked
        for without a level."""
        return self.zstd_level or (1 if self.compact_records else 0)

    @property
    def initial_map_size(self) -> int:
        """The map size an open starts from: ``map_size``, or the limit when that is smaller."""
        return min(self.map_size, self.max_map_bytes) if self.max_map_bytes else self.map_size


@dataclass(frozen=True)
class RedisTierConfig:
    """Values in a Redis server or a Redis Cluster, under ``f"{namespace}:"`` keys
    (``tiers/redis/keys.py`` has the layout).

    ``share_sessions``: this tier is where daemons share sessions: every save publishes its chunks
    and its manifest here (a compare-and-set on the session's generation), and sessions published
    by other daemons are listed and resumed from here. ``wait_replicas`` > 0: a write returns only
    once that many replicas of each master it touched acknowledged it (Redis WAIT, at most
    ``wait_timeout_ms``), else it fails: a master failing over then loses nothing acknowledged.
    """

    #: The daemon adds a Redis tier when this is given.
    url: str = field(default="redis://127.0.0.1:6379/0", metadata=option(
        "add a shared Redis tier after the ssd tier, at this URL (redis://HOST:PORT/DB)"))
    namespace: str = field(default="kvstore", metadata=option(
        "key prefix in Redis: every daemon sharing sessions uses the same one"))
    capacity_bytes: int = 0
    #: Expire values this long after their last put (or get, see below). 0 = never.
    ttl_s: int = field(default=0, metadata=option("expiry of values in the Redis tier, in seconds; 0 = none"))
    touch_on_get: bool = True  # a get restarts the TTL
    socket_timeout_s: float = 2.0  # connect and per-command timeout: a dead server fails fast
    cluster: bool = field(default=False, metadata=option(
        "the URL names one node of a Redis Cluster (the others are found from it)"))
    share_sessions: bool = field(default=False, metadata=option(
        "publish every save to Redis, and list and resume sessions other daemons published"))
    wait_replicas: int = field(default=0, metadata=option(
        "a write to Redis returns only once this many replicas of each master acknowledged it (WAIT), "
        "else the save fails; 0 = do not wait"))
    wait_timeout_ms: int = field(default=1000, metadata=option("how long a write waits for its replicas"))

    def __post_init__(self) -> None:
        _check_capacity("redis", self.capacity_bytes)
        if not _NAMESPACE.fullmatch(self.namespace):
            raise InvalidSetting("redis tier", "namespace", f"must match [A-Za-z0-9_.-]+, got {self.namespace!r}")
        if self.ttl_s < 0:
            raise InvalidSetting("redis tier", "ttl_s", f"must be >= 0 (0 = no expiry), got {self.ttl_s}")
        if self.socket_timeout_s <= 0:
            raise InvalidSetting("redis tier", "socket_timeout_s", f"must be > 0, got {self.socket_timeout_s}")
        if self.wait_replicas < 0:
            raise InvalidSetting("redis tier", "wait_replicas", f"must be >= 0 (0 = do not wait), got "
                                 f"{self.wait_replicas}")
        if self.wait_timeout_ms <= 0:
            raise InvalidSetting("redis tier", "wait_timeout_ms", f"must be > 0, got {self.wait_timeout_ms}")


@dataclass(frozen=True)
class HbmTierConfig:
    """Values in one preallocated arena of GPU memory."""

    #: The arena size; > 0 (HBM is never unlimited). The daemon adds an HBM tier when this is given.
    capacity_bytes: int = field(default=1 << 30, metadata=option(
        "add an HBM tier of this size in front (needs CUDA); 0 = none"))
    device: int = 0  # CUDA device index
    # puts from host bytes: this many copy lanes (threads, each with its own CUDA stream), each with
    # staging_buffers pinned buffers of staging_bytes, so the CPU copies into one while another uploads
    # (H200 VM sweep, 64 MiB: 1 lane 5.0 GB/s, 4 lanes 7.5, 8-16 lanes 4.2-7.4: the CPU copy is the limit)
    copy_lanes: int = 4
    staging_buffers: int = 2
    staging_bytes: int = 2 << 20

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise InvalidSetting("hbm tier", "capacity_bytes", f"must be > 0 (the arena's size), got "
                                 f"{self.capacity_bytes}")
        if self.device < 0:
            raise InvalidSetting("hbm tier", "device", f"must be >= 0, got {self.device}")
        if self.copy_lanes < 1 or self.staging_buffers < 1:
            raise InvalidSetting("hbm tier", "copy_lanes", "and staging_buffers must be >= 1")
        if self.staging_bytes <= 0 or self.staging_bytes % 256:
            raise InvalidSetting("hbm tier", "staging_bytes", f"must be a positive multiple of 256, got "
                                 f"{self.staging_bytes}")


TierConfig = HostTierConfig | SsdTierConfig | RedisTierConfig | HbmTierConfig
