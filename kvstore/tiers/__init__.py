"""Storage tiers behind one interface (``Tier``), and ``make_tier`` to build one from its config.

Tier modules are imported only when a tier of that kind is made: lmdb, redis and torch are
loaded by the processes that use them, and ``hbm`` imports fine on machines without CUDA.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvstore.tiers.base import Tier, TierError, TierFullError, TierStats, Usage
from kvstore.tiers.config import HbmTierConfig, HostTierConfig, RedisTierConfig, SsdTierConfig, TierConfig

__all__ = [
    "HbmTierConfig",
    "HostTierConfig",
    "RedisTierConfig",
    "SsdTierConfig",
    "Tier",
    "TierConfig",
    "TierError",
    "TierFullError",
    "TierStats",
    "Usage",
    "make_tier",
]

# config type -> (module, class): the registry. Add a tier by adding a line.
_TIERS: dict[type, tuple[str, str]] = {
    HostTierConfig: ("kvstore.tiers.host.tier", "HostTier"),
    SsdTierConfig: ("kvstore.tiers.ssd.tier", "SsdTier"),
    RedisTierConfig: ("kvstore.tiers.redis.tier", "RedisTier"),
    HbmTierConfig: ("kvstore.tiers.hbm.tier", "HbmTier"),
}


def make_tier(config: TierConfig, **kwargs: Any) -> Tier:
    """Build the tier that ``config`` describes. Extra keyword arguments go to its constructor
    (e.g. ``compressible_from`` for the ssd tier)."""
    try:
        module, cls = _TIERS[type(config)]
    except KeyError:
        raise ValueError(f"no tier for config type {type(config).__name__}") from None
    tier: Tier = getattr(importlib.import_module(module), cls)(config, **kwargs)
    return tier
