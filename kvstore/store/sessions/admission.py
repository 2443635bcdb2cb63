"""Quotas at the session store's door (``store/quotas.py``): a save past its namespace's ssd share, or
one that would start a session past its sessions quota, is refused (RESOURCE_EXHAUSTED naming the
namespace, the quota and the usage) before anything is written, so nothing already stored is lost
and no pinned session is ever dropped to make room; and what each namespace holds, for stats.

A save's new chunks count at their size as sent (the ssd tier may compress them: the check errs
on the side of refusing); what it holds is the ssd tier's own bytes (``ledger.py``). A save's
chunks that the versions it replaces freed are not subtracted first: near its quota, a namespace
deletes sessions to make room.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from kvstore.store.quotas import NamespaceUsage, Quotas, refuse_sessions, refuse_ssd
from kvstore.store.sessions.index import SessionIndex
from kvstore.store.tiered.ledger import UNOWNED
from kvstore.store.tiered.store import TieredStore

Chunks = Sequence[tuple[bytes, bytes | memoryview]]


class Admission:
    def __init__(self, quotas: Quotas, store: TieredStore, index: SessionIndex, clock: Callable[[], float]) -> None:
        self.quotas = quotas
        self._store = store
        self._index = index
        self._clock = clock
        self._durable = store.durable_name()

    def check_bytes(self, namespace: str, new: Chunks, pending: int = 0) -> int:
        """The bytes of ``new`` (chunks the durable tier lacks); ResourceExhausted if they, with
        ``pending`` bytes of this namespace's saves committed in the same transaction, would take
        ``namespace`` past its share of the durable tier."""
        size = sum(len(b) for _, b in new)
        quota = self.quotas.of(namespace).bytes_on(self._durable)
        if quota is not None and size:
            used = self._store.ledger.used(self._durable, namespace) + pending
            if used + size > quota:
                raise refuse_ssd(namespace, quota, used, size)
        return size

    def check_session(self, namespace: str, session_id: str, pending: int = 0) -> bool:
        """Whether saving ``session_id`` starts a new session; ResourceExhausted if that (with
        ``pending`` new sessions of this namespace in the same transaction) is past its sessions quota."""
        old = self._index.get((namespace, session_id))
        if old is not None and not old.expired(self._clock()):
            return False
        quota = self.quotas.of(namespace).sessions
        if quota is not None:
            used = len(self._index.live(self._clock(), namespace)) + pending
            if used + 1 > quota:
                raise refuse_sessions(namespace, quota, used)
        return True

    def usage(self, namespaces: Sequence[str] | frozenset[str] | None = None) -> list[NamespaceUsage]:
        """What each namespace holds and its quota, by namespace (None: every namespace that holds
        something or has a quota of its own; the unowned bytes as namespace "" for an admin)."""
        held = self._store.ledger.usage()
        sessions = Counter(m.namespace for m in self._index.live(self._clock()))
        if namespaces is None:
            names = set(held) | set(sessions) | set(self.quotas.namespaces)
        else:
            names = set(namespaces) - {UNOWNED}
        host = next((t for t in self._store.tier_names() if t == "host"), "")
        out = []
        for ns in sorted(names):
            tiers = held.get(ns, {})
            if ns == UNOWNED and not tiers:
                continue
            out.append(NamespaceUsage(ns, tiers.get(host, 0), tiers.get(self._durable, 0), sessions.get(ns, 0),
                                      self.quotas.of(ns)))
        return out
