"""What the session store counts: token-level hits, and damage found in the durable tier at open."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DamageCounters:
    """Damage found in the durable tier at open: manifests that do not decode (ignored), and
    chunks a manifest references that the durable tier does not hold (the session then loads
    with misses; a client re-prefills them)."""

    manifests: int = 0
    missing_chunks: int = 0


@dataclass
class HitCounters:
    lookups: int = 0
    requested_tokens: int = 0
    hit_tokens: int = 0
    loads: int = 0
    loaded_chunks: int = 0
    missed_chunks: int = 0
