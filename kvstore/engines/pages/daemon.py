"""An engine integration's link to the kvstore daemon: one client per thread, role and tenant, and the
"down" state that turns an unreachable daemon into misses and failures without a call (vLLM's tier,
SGLang's HiCache backend)."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from kvstore.client import Client
from kvstore.errors import KvstoreError, Unavailable

if TYPE_CHECKING:
    from kvstore.engines.pages.sessions import Tenant
    from kvstore.format.page_layout import PageLayout


class DaemonLink:
    """Clients of one daemon for an engine's threads, and whether the daemon is to be asked at all.

    A call that finds the daemon unreachable (UNAVAILABLE, a deadline, a socket error) makes it
    "down" for ``down_s`` seconds: meanwhile lookups are misses and jobs failures, without a call.
    Any other failure (a full disk, a refused blob) fails only its own call."""

    def __init__(self, address: str, layout: PageLayout, timeout_s: float, down_s: float, arena_bytes: int,
                 log: logging.Logger) -> None:
        self.address = address
        self.log = log  # the engine integration's logger: what it says is said in the engine's name
        self.layout = layout
        self.timeout_s = timeout_s
        self.down_s = down_s
        self.arena_bytes = arena_bytes  # per job thread and tenant, when the daemon is on this host
        self._down_until = 0.0
        self._clients: dict[tuple[Tenant, str, int], Client] = {}
        self._lock = threading.Lock()
        self._registered: set[Tenant] = set()  # page layouts are per namespace: registered by each tenant

    def client(self, tenant: Tenant, role: str) -> Client:
        """A client of ``tenant`` for this thread: a job thread's own (a zero-copy load reads its
        blobs in the client's arena, which the next call of that client reuses), or the lookup
        thread's, which needs no arena."""
        arena = 0 if role == "lookup" else self.arena_bytes
        key = (tenant, role, 0 if role == "lookup" else threading.get_ident())  # one lookup thread: warmed anywhere
        with self._lock:
            c = self._clients.get(key)
            if c is None:
                c = self._clients[key] = Client(address=self.address, token=tenant.token, timeout_s=self.timeout_s,
                                                retries=0, shared_memory=arena > 0, arena_bytes=arena)
        if tenant not in self._registered:
            c.register_layout(self.layout.definition(), tenant.namespace)
            self._registered.add(tenant)
        return c

    def warm(self, tenant: Tenant, role: str) -> None:
        """This thread's client of ``role`` for ``tenant`` made now (connected, its arena attached, the
        layout registered), so the engine's first lookup or job does not pay for it; a failure is
        left to the first real call."""
        try:
            self.client(tenant, role).connect()
        except Exception as e:  # the daemon may start after the engine: its first call says so
            self.log.debug("kvstore: warming a %s client failed: %s", role, e)

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def failed(self, what: str, e: Exception) -> None:
        """A call failed: an unreachable daemon is not asked again for ``down_s``."""
        if not unreachable(e):
            self.log.warning("kvstore: %s failed: %s: %s", what, type(e).__name__, e)
            return
        if self.available():
            self.log.warning("kvstore: %s failed (%s); treating kvstore as down for %.0f s", what, e, self.down_s)
        self._down_until = time.monotonic() + self.down_s
        self._registered.clear()  # a restarted daemon may be a fresh one

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()


def unreachable(e: Exception) -> bool:
    """Whether a failed call says the daemon cannot be reached (rather than answering no)."""
    return isinstance(e, (Unavailable, OSError)) or type(e) is KvstoreError  # KvstoreError: a deadline
