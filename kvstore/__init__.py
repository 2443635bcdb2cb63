"""kvstore: a tiered store for the FP4 global KV of DeepSeek-V4.1-Flash-style models.

Three wings under the daemon (``server/``) and its store (``store/``, ``tiers/``): ``format/`` (what is
stored, as bytes), ``transport/`` (how bytes travel), ``client/`` (the Python clients). ``kvstore.Client``
/ ``kvstore.AsyncClient`` are imported on first use, so ``import kvstore`` stays light (no gRPC) for
code that only needs the codecs or the format. The module paths of the flat 0.1 layout
(``kvstore.chunk``, ``kvstore.layout``, ``kvstore.aio_client``, ...) still import: each names the
module it moved to (``_MOVED``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

__version__ = "0.1.0"
__all__ = ["AsyncClient", "Client", "ClientConfig", "__version__"]

#: old module path -> where it lives now
_MOVED = {
    **{f"kvstore.{m}": f"kvstore.format.{m}" for m in ("chunk", "keys", "layout", "manifest", "page", "page_layout",
                                                       "quant")},
    **{f"kvstore.{m}": f"kvstore.transport.{m}" for m in ("convert", "framing", "shm")},
    "kvstore.pbwire": "kvstore.transport.fastpb",
    "kvstore.localrpc": "kvstore.transport.local_channel",
    "kvstore.aio_client": "kvstore.client.aio",
    "kvstore.client_config": "kvstore.client.config",
    "kvstore.wire": "kvstore.client.requests",
    "kvstore.client.messages": "kvstore.client.requests",
    "kvstore.cuda.device_load": "kvstore.client.device_load",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the module it moved to (the same module object, so its classes
    are the same classes). Asked last, after every real module."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(name, self) if name in _MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(_MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Already executed: it is the moved module itself."""


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __getattr__(name: str) -> Any:
    if name in ("AsyncClient", "Client", "ClientConfig"):
        from kvstore import client

        return getattr(client, name)
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
