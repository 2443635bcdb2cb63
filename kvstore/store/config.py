"""Frozen configuration of the tiered store. Defaults live here and nowhere else.

The fields with ``option`` metadata are the daemon's ``[store]`` settings (``--store-chunk-tokens``,
``KVSTORE_STORE_WRITE_MODE``: ``kvstore/server/settings.py``); its tier sections are ``tiers``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.store.quotas import Quotas
from kvstore.tiers.config import HostTierConfig, InvalidSetting, SsdTierConfig, TierConfig, option

#: The default host tier's capacity (a store's, and so the daemon's, default host tier).
DEFAULT_HOST_CAPACITY_BYTES = 1 << 30


@dataclass(frozen=True)
class StoreConfig:
    """Tiers ordered fast to slow, and how data moves between them."""

    tiers: tuple[TierConfig, ...] = field(
        default_factory=lambda: (HostTierConfig(capacity_bytes=DEFAULT_HOST_CAPACITY_BYTES), SsdTierConfig())
    )
    #: "through": every acknowledged chunk is on the persistent tier before the call returns.
    #: "back": chunks land in the fastest tier and reach the persistent tier on demotion, on
    #: flush(), and always before a session commit that references them.
    write_mode: str = field(default="through", metadata=option(
        "through: every acknowledged chunk is on the durable tier; back: chunks land in the fastest tier and "
        "reach the durable one on demotion, and before a commit that names them", choices=("through", "back")))
    #: Copy a chunk served from a slower tier into every faster tier.
    promote_on_read: bool = field(default=True, metadata=option(
        "copy a chunk served from a slower tier into every faster tier"))
    #: Tokens per chunk; a multiple of every layout's m (the layouts here need a multiple of 2).
    chunk_tokens: int = field(default=256, metadata=option("tokens per chunk (a positive even number)"))
    #: Engine page layouts one namespace may hold (RegisterLayout; docs/SECURITY.md); layouts registered
    #: for every namespace (an admin's) are held to the same number.
    max_layouts_per_namespace: int = field(default=64, metadata=option(
        "engine page layouts (RegisterLayout) one namespace may hold; global ones (an admin's) as many"))
    #: A session appended to turn by turn keeps its manifest on disk as a base and a record per turn; it is
    #: written whole again (compacted) once its turns name as many chunk keys as the base, and at least this
    #: many (docs/FORMAT.md section 3, "Turns").
    compact_turn_keys: int = field(default=256, metadata=option(
        "a session's turn records are compacted into its manifest once they name as many keys as it, and at "
        "least this many"))
    #: Sessions of one namespace waiting in the prefetch queue (``sessions/prefetch.py``; of its 64 in all):
    #: more of its requests are answered dropped, so one tenant cannot fill the queue (docs/SECURITY.md).
    max_prefetch_per_namespace: int = field(default=16, metadata=option(
        "sessions of one namespace waiting to be prefetched (of 64 in all); more of its requests are dropped"))

    #: Per-namespace quotas (``store/quotas.py``): the daemon's come from its tokens file.
    quotas: Quotas = field(default_factory=Quotas)

    def __post_init__(self) -> None:
        if not self.tiers:
            raise InvalidSetting("store", "tiers", "must hold at least one tier")
        if self.write_mode not in ("through", "back"):
            raise InvalidSetting("store", "write_mode", f"must be through or back, got {self.write_mode!r}")
        if self.chunk_tokens <= 0 or self.chunk_tokens % 2:
            raise InvalidSetting("store", "chunk_tokens", f"must be a positive even number, got {self.chunk_tokens}")
        if self.compact_turn_keys < 1:
            raise InvalidSetting("store", "compact_turn_keys", f"must be at least 1, got {self.compact_turn_keys}")
        if self.max_prefetch_per_namespace < 1:
            raise InvalidSetting("store", "max_prefetch_per_namespace",
                                 f"must be at least 1, got {self.max_prefetch_per_namespace}")
        if self.max_layouts_per_namespace < 1:
            raise InvalidSetting("store", "max_layouts_per_namespace",
                                 f"must be at least 1, got {self.max_layouts_per_namespace}")
