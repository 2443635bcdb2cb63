"""The tiered store: chunks across tiers (tiered.py), sessions over them (sessions.py)."""

from __future__ import annotations

from kvstore.format.manifest import Manifest, Retention
from kvstore.results import LookupResult, SaveResult
from kvstore.store.config import StoreConfig
from kvstore.store.pages import compressible_offset
from kvstore.store.sessions import SessionStore
from kvstore.store.stats import BytesPerToken, StoreStats, bytes_per_token, store_stats
from kvstore.store.tiered import TieredStore
from kvstore.tiers import SsdTierConfig, make_tier

__all__ = [
    "BytesPerToken",
    "LookupResult",
    "Manifest",
    "Retention",
    "SaveResult",
    "SessionStore",
    "StoreConfig",
    "StoreStats",
    "TieredStore",
    "bytes_per_token",
    "open_store",
    "store_stats",
]


def open_store(config: StoreConfig) -> SessionStore:
    """Build every tier from ``config``, compose them, load the manifests, collect crash leftovers."""
    tiers = []
    try:
        for tc in config.tiers:
            extra = {"compressible_from": compressible_offset} if isinstance(tc, SsdTierConfig) else {}
            tiers.append(make_tier(tc, **extra))
    except Exception:
        for t in tiers:
            t.close()
        raise
    sessions = SessionStore(TieredStore(tiers, config), config)
    sessions.collect_garbage()
    sessions.check_references()
    sessions.expire()
    return sessions
