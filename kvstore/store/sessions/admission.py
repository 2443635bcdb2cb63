"""Quotas at the session store's door (``store/quotas.py``): a save past its namespace's ssd share, or
one that would start a session past its sessions quota, is refused (RESOURCE_EXHAUSTED naming the
namespace, the quota and the usage) before anything is written, so nothing already stored is lost
and no pinned session is ever dropped to make room; and what each namespace holds, for stats.

A save's new chunks count at their size as sent (the ssd tier may compress them: the check errs
on the side of refusing); what it holds is the ssd tier's own bytes (``ledger.py``), and in
write-back mode the chunks it put in the fast tier that are not on the ssd tier yet, at their size
as sent (``Ledger.used_durably``: counted once, pending until flushed, then as the ssd tier holds
them). A whole save that replaces a version is checked by its net change: its new bytes less what
the chunks only the replaced version used take on the ssd tier (``SessionIndex.replaced_only``: the
same commit deletes them), those another turn of its group names excepted. The commit holds the
index's write lock across the check and its write (``turn_commit.py``): both see one state. A save
that does not grow its namespace's bytes is never refused by the ssd quota.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from kvstore.store.quotas import NamespaceUsage, Quotas, refuse_sessions, refuse_ssd
from kvstore.store.sessions.index import SessionIndex
from kvstore.store.sessions.sharing import SessionRef
from kvstore.store.sessions.turn import Turn
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

    def check_bytes(self, namespace: str, new: Chunks, pending: int = 0, replaces: SessionRef | None = None,
                    kept: set[bytes] | None = None) -> int:
        """The net bytes a save adds to ``namespace``'s share of the durable tier: those of ``new``
        (chunks the durable tier lacks), less (``replaces``: the session whose version the same
        commit replaces whole) what the chunks only that version used, but for ``kept`` (named by the
        commit's turns), take there. ResourceExhausted if a save that grows it would take
        ``namespace`` past its share, with ``pending`` net bytes of its saves committed in the same
        transaction and what it holds (``Ledger.used_durably``)."""
        size = sum(memoryview(b).nbytes for _, b in new)
        quota = self.quotas.of(namespace).bytes_on(self._durable)
        if quota is None:
            return size
        freed = self.freed(replaces, kept or set()) if replaces is not None else 0
        net = size - freed
        if size and net > 0:
            used = self._store.ledger.used_durably(namespace) + pending
            if used + net > quota:
                raise refuse_ssd(namespace, quota, used, net, freed)
        return net

    def freed(self, ref: SessionRef, kept: set[bytes]) -> int:
        """Bytes on the durable tier of the chunks only ``ref``'s current version uses, ``kept`` aside:
        what replacing that version frees (called under the index's write lock)."""
        keys = self._index.replaced_only({ref}, kept)
        return self._store.ledger.durable_bytes(keys) if keys else 0

    def named(self, turns: Iterable[Turn]) -> set[bytes]:
        """Every chunk key ``turns`` name (their manifests' or the keys their appends add): a chunk
        one of them names is not freed by another's replacing its version (``check_bytes``'s
        ``kept``). Empty where no namespace has a share of the durable tier (nothing is checked)."""
        if not self.quotas.shares(self._durable):
            return set()
        out: set[bytes] = set()
        for t in turns:
            if t.manifest is not None:
                out.update(t.manifest.chunk_keys)
            elif t.append is not None:
                out.update(t.append.chunk_keys)
        return out

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
        something or has a quota of its own; the unowned bytes as namespace "" for an admin). Its ssd
        bytes are those its quota is checked against: on the ssd tier, and (write-back) on their way there."""
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
            ssd = tiers.get(self._durable, 0) + self._store.ledger.pending(ns)
            out.append(NamespaceUsage(ns, tiers.get(host, 0), ssd, sessions.get(ns, 0), self.quotas.of(ns)))
        return out
