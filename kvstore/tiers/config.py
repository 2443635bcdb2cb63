"""Frozen configuration of each tier. Defaults live here and nowhere else.

Every config has ``capacity_bytes`` (0 = unlimited): the tier only reports it in ``usage()``;
the tiered store enforces it by demoting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAMESPACE = re.compile(r"[A-Za-z0-9_.\-]+")


def _check_capacity(tier: str, capacity_bytes: int) -> None:
    if capacity_bytes < 0:
        raise ValueError(f"{tier} tier: capacity_bytes must be >= 0 (0 = unlimited), got {capacity_bytes}")


@dataclass(frozen=True)
class HostTierConfig:
    """Values in process memory."""

    capacity_bytes: int = 0
    pin_memory: bool = True  # keep values in pinned (page-locked) memory when CUDA is available

    def __post_init__(self) -> None:
        _check_capacity("host", self.capacity_bytes)


@dataclass(frozen=True)
class SsdTierConfig:
    """Values zstd-compressed in an LMDB environment on local disk."""

    path: str = "kvstore-data/ssd"
    capacity_bytes: int = 0
    zstd_level: int = 1  # 0 = store raw; 1..22 = zstd level (1 compresses E4M3 scales best per second)
    #: Chunks as record flag 2 (codes and scales transformed, then compressed: 834 instead of 866
    #: B/token at rest at the real geometry, but encoded ~10x and decoded ~14x slower: 235 / 283 MB/s,
    #: benchmarks/results/at_rest.md) or, by default, flag 1 (only the scales tail compressed), which
    #: keeps saves and ssd reads near the disk's speed. For stores bound by capacity, not latency.
    transform_chunks: bool = False
    sync: bool = True  # True: a put that returned is on disk; False: flushed on flush()/close()
    map_size: int = 1 << 30  # initial LMDB map size; doubled whenever it fills
    max_map_size: int = 0  # the map never grows past this (saves then fail: ResourceExhausted); 0 = no limit

    def __post_init__(self) -> None:
        _check_capacity("ssd", self.capacity_bytes)
        if not self.path:
            raise ValueError("ssd tier: path must not be empty")
        if not 0 <= self.zstd_level <= 22:
            raise ValueError(f"ssd tier: zstd_level must be 0 (off) to 22, got {self.zstd_level}")
        if self.map_size <= 0:
            raise ValueError(f"ssd tier: map_size must be > 0, got {self.map_size}")
        if self.max_map_size and self.max_map_size < self.map_size:
            raise ValueError(f"ssd tier: max_map_size must be 0 (no limit) or >= map_size, got {self.max_map_size}")


@dataclass(frozen=True)
class RedisTierConfig:
    """Values in a Redis server or a Redis Cluster, under ``f"{namespace}:"`` keys
    (``redis_keys.py`` has the layout).

    ``share_sessions``: this tier is where daemons share sessions: every save publishes its chunks
    and its manifest here (a compare-and-set on the session's generation), and sessions published
    by other daemons are listed and resumed from here. ``wait_replicas`` > 0: a write returns only
    once that many replicas of each master it touched acknowledged it (Redis WAIT, at most
    ``wait_timeout_ms``), else it fails: a master failing over then loses nothing acknowledged.
    """

    url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "kvstore"
    capacity_bytes: int = 0
    ttl_s: int | None = None  # expire values this long after their last put (or get, see below)
    touch_on_get: bool = True  # a get restarts the TTL
    socket_timeout_s: float = 2.0  # connect and per-command timeout: a dead server fails fast
    cluster: bool = False  # url names one node of a Redis Cluster (the client finds the others)
    share_sessions: bool = False
    wait_replicas: int = 0  # 0 = do not wait (asynchronous replication)
    wait_timeout_ms: int = 1000

    def __post_init__(self) -> None:
        _check_capacity("redis", self.capacity_bytes)
        if not _NAMESPACE.fullmatch(self.namespace):
            raise ValueError(f"redis tier: namespace must match [A-Za-z0-9_.-]+, got {self.namespace!r}")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError(f"redis tier: ttl_s must be > 0 or None, got {self.ttl_s}")
        if self.socket_timeout_s <= 0:
            raise ValueError(f"redis tier: socket_timeout_s must be > 0, got {self.socket_timeout_s}")
        if self.wait_replicas < 0:
            raise ValueError(f"redis tier: wait_replicas must be >= 0 (0 = do not wait), got {self.wait_replicas}")
        if self.wait_timeout_ms <= 0:
            raise ValueError(f"redis tier: wait_timeout_ms must be > 0, got {self.wait_timeout_ms}")


@dataclass(frozen=True)
class HbmTierConfig:
    """Values in one preallocated arena of GPU memory."""

    capacity_bytes: int = 1 << 30  # the arena size; must be > 0 (HBM is never unlimited)
    device: int = 0  # CUDA device index
    # puts from host bytes: this many copy lanes (threads, each with its own CUDA stream), each with
    # staging_buffers pinned buffers of staging_bytes, so the CPU copies into one while another uploads
    # (H200 VM sweep, 64 MiB: 1 lane 5.0 GB/s, 4 lanes 7.5, 8-16 lanes 4.2-7.4: the CPU copy is the limit)
    copy_lanes: int = 4
    staging_buffers: int = 2
    staging_bytes: int = 2 << 20

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"hbm tier: capacity_bytes must be > 0, got {self.capacity_bytes}")
        if self.device < 0:
            raise ValueError(f"hbm tier: device must be >= 0, got {self.device}")
        if self.copy_lanes < 1 or self.staging_buffers < 1:
            raise ValueError("hbm tier: copy_lanes and staging_buffers must be >= 1")
        if self.staging_bytes <= 0 or self.staging_bytes % 256:
            raise ValueError(f"hbm tier: staging_bytes must be a positive multiple of 256, got {self.staging_bytes}")


TierConfig = HostTierConfig | SsdTierConfig | RedisTierConfig | HbmTierConfig
