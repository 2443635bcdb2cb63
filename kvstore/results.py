"""Typed results of store operations, shared by the store, the servicer and the clients.

Kept out of ``kvstore.store`` so a client can import them without the store's dependencies.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LookupResult:
    """How many leading tokens the store holds, and in which tiers (chunks per fastest holder)."""

    cached_tokens: int
    requested_tokens: int
    chunks: int
    tiers: dict[str, int]


@dataclass(frozen=True)
class SaveResult:
    keys: list[bytes]  # every chunk's key, in order
    written: int  # how many were new (the rest were already stored: shared prefix or a resend)
