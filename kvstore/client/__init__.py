"""The Python clients of the daemon: ``Client`` (blocking) and ``AsyncClient`` (asyncio), one config.

``AsyncClient`` is imported on first use, so a blocking client pulls in no asyncio gRPC."""

from __future__ import annotations

from typing import Any

from kvstore.client.config import ClientConfig, ClientTls, default_address
from kvstore.client.messages import SavedSession
from kvstore.client.sync import Client
from kvstore.defaults import DEFAULT_ADDRESS
from kvstore.errors import Unauthenticated

__all__ = ["DEFAULT_ADDRESS", "AsyncClient", "Client", "ClientConfig", "ClientTls", "SavedSession", "Unauthenticated",
           "default_address"]


def __getattr__(name: str) -> Any:
    if name == "AsyncClient":
        from kvstore.client.aio import AsyncClient

        return AsyncClient
    raise AttributeError(f"module 'kvstore.client' has no attribute {name!r}")
