"""kvstore: a tiered store for the FP4 global KV of DeepSeek-V4.1-Flash-style models.

``kvstore.Client`` / ``kvstore.AsyncClient`` talk to the daemon; they are imported on first use,
so ``import kvstore`` stays light (no gRPC) for code that only needs the codecs or the format.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["AsyncClient", "Client", "ClientConfig", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("Client", "ClientConfig"):
        from kvstore import client

        return getattr(client, name)
    if name == "AsyncClient":
        from kvstore.aio_client import AsyncClient

        return AsyncClient
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
