"""The Python client of the daemon, with two faces: ``Client`` (blocking, thread-safe) and
``AsyncClient`` (asyncio: a facade over one ``Client``, kvstore/client/aio.py); one config."""

from __future__ import annotations

from kvstore.client.aio import AsyncClient
from kvstore.client.calls import PageLoad, PageSlots, SavedSession
from kvstore.client.config import ClientConfig, ClientTls, default_address
from kvstore.client.sync import Client
from kvstore.defaults import DEFAULT_ADDRESS
from kvstore.errors import Unauthenticated

__all__ = ["DEFAULT_ADDRESS", "AsyncClient", "Client", "ClientConfig", "ClientTls", "PageLoad", "PageSlots",
           "SavedSession", "Unauthenticated", "default_address"]
