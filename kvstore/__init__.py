"""kvstore: a tiered store for the FP4 global KV of DeepSeek-V4.1-Flash-style models.

Three wings under the daemon (``server/``) and its store (``store/``, ``tiers/``): ``format/`` (what is
stored, as bytes), ``transport/`` (how bytes travel), ``client/`` (the Python clients). ``kvstore.Client``
/ ``kvstore.AsyncClient`` are imported on first use, so ``import kvstore`` stays light (no gRPC) for
code that only needs the codecs or the format.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["AsyncClient", "Client", "ClientConfig", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("AsyncClient", "Client", "ClientConfig"):
        from kvstore import client

        return getattr(client, name)
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
