"""The store in two seams: chunk blobs across tiers (``tiered/``), sessions over them (``sessions/``);
``open_store`` builds both from the config."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.format.manifest import KEY_PREFIX, Manifest, Retention, is_legacy_manifest
from kvstore.format.page import ScaleRuns
from kvstore.format.stored import compressible_offset
from kvstore.results import LookupResult, SaveResult
from kvstore.store.config import StoreConfig
from kvstore.store.sessions.shared_manifests import SharedSessions
from kvstore.store.sessions.sharing import NoSharing, Sharing
from kvstore.store.sessions.store import SessionStore
from kvstore.store.stats import BytesPerToken, StoreStats, bytes_per_token, store_stats
from kvstore.store.tiered.store import TieredStore
from kvstore.tiers import RedisTierConfig, SsdTierConfig, TierConfig, make_tier
from kvstore.tiers.base import Tier
from kvstore.tiers.redis.tier import RedisTier
from kvstore.tiers.ssd.migrate import LegacyMeta

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


#: Manifests as the first format kept them, among an ssd tier's values: moved out at its open.
LEGACY_MANIFESTS = LegacyMeta(KEY_PREFIX, is_legacy_manifest)


def _extra(tc: TierConfig, runs: ScaleRuns) -> dict[str, Any]:
    """What a tier is told of the records it stores, beside its config (it knows bytes only): where
    a value's compressible tail starts, and a page blob's scale rows (by the registered page layouts,
    bound to ``runs`` once they are open; compact records only)."""
    if isinstance(tc, SsdTierConfig):
        return {"compressible_from": compressible_offset, "legacy_meta": LEGACY_MANIFESTS,
                "compressible_runs": runs}
    return {}


def sharing_for(config: StoreConfig, tiers: Sequence[Tier]) -> Sharing:
    """The sharing ``config`` asks for: through the Redis tier configured with ``share_sessions``
    (``tiers`` are the tiers built from ``config.tiers``, in its order), else none."""
    for tc, tier in zip(config.tiers, tiers):
        if isinstance(tc, RedisTierConfig) and tc.share_sessions:
            assert isinstance(tier, RedisTier), "tiers are built from config.tiers, in its order"
            return SharedSessions(tier, config.chunk_tokens)
    return NoSharing()


def open_store(config: StoreConfig) -> SessionStore:
    """Build every tier from ``config``, compose them, choose how sessions are shared, load the
    manifests, collect crash leftovers."""
    tiers = []
    runs = ScaleRuns()
    try:
        for tc in config.tiers:
            tiers.append(make_tier(tc, **_extra(tc, runs)))
    except Exception:
        for t in tiers:
            t.close()
        raise
    sessions = SessionStore(TieredStore(tiers, config), config, sharing_for(config, tiers))
    runs.bind(sessions.layouts.page)
    sessions.collect_garbage()
    sessions.check_references()
    sessions.expire()
    return sessions
