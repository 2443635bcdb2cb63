"""Frozen configuration of the tiered store. Defaults live here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.tiers.config import HostTierConfig, SsdTierConfig, TierConfig

#: The default host tier's capacity (the daemon's config takes it from here too).
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
    write_mode: str = "through"
    #: Copy a chunk served from a slower tier into every faster tier.
    promote_on_read: bool = True
    #: Tokens per chunk; a multiple of every layout's m (the layouts here need a multiple of 2).
    chunk_tokens: int = 256

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("store: at least one tier is required")
        if self.write_mode not in ("through", "back"):
            raise ValueError(f"store: write_mode must be 'through' or 'back', got {self.write_mode!r}")
        if self.chunk_tokens <= 0 or self.chunk_tokens % 2:
            raise ValueError(f"store: chunk_tokens must be a positive even number, got {self.chunk_tokens}")
