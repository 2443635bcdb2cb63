"""Per-namespace usage of the tiers this daemon owns (the durable tier and faster ones): which
namespace owns each chunk key and how many bytes each namespace holds on each tier, kept as chunks
move (``TierSlot`` reports each put and drop), for quotas (``store/quotas.py``) and stats.

A chunk key hashes its namespace, so a key has one owner for good: the session store claims keys
for their namespace before it writes them, and for every manifest it indexes (at open, and versions
caught up from other daemons). Bytes put before their claim (a chunk the ssd tier held at open)
count for the unowned namespace "" until claimed, then move to their owner. A chunk shared by
sessions of one namespace is one key: counted once. Bytes are the tier's own (``Tier.size_of``:
on the ssd tier after compression, what the disk holds).

Write-back mode (``[store] write_mode = "back"``): a chunk put in the fast tier and not yet on the
durable one is *pending* (``pend``), counted at its size as sent, per namespace, until the durable
tier holds it (its ``put`` there settles it, under the same lock: never counted twice) or it is
deleted (``settle``). ``used_durably`` is what a namespace holds on the durable tier and its
pending bytes bound for it: what its ssd quota is checked against.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence

#: The owner of a key nobody claimed (yet).
UNOWNED = ""


class Ledger:
    def __init__(self, tiers: Sequence[str]) -> None:
        """``tiers``: the tiers this daemon owns, fast to slow; the last is the durable one."""
        self._lock = threading.Lock()
        self._owner: dict[bytes, str] = {}
        self._sizes: dict[str, dict[bytes, int]] = {t: {} for t in tiers}
        self._used: dict[str, defaultdict[str, int]] = {t: defaultdict(int) for t in tiers}
        self._durable = tiers[-1] if tiers else ""
        #: Write-back: chunks on their way to the durable tier, their sizes, and their bytes by namespace.
        self._pending: dict[bytes, int] = {}
        self._pending_used: defaultdict[str, int] = defaultdict(int)

    def tracks(self, tier: str) -> bool:
        return tier in self._sizes

    def claim(self, keys: Iterable[bytes], namespace: str) -> None:
        """``keys`` belong to ``namespace``; bytes already counted unowned move to it."""
        with self._lock:
            for k in keys:
                old = self._owner.get(k)
                if old == namespace:
                    continue
                self._owner[k] = namespace
                for tier, sizes in self._sizes.items():
                    n = sizes.get(k)
                    if n is not None:
                        used = self._used[tier]
                        used[old or UNOWNED] -= n
                        used[namespace] += n
                n = self._pending.get(k)
                if n is not None:
                    self._pending_used[old or UNOWNED] -= n
                    self._pending_used[namespace] += n

    def owner(self, key: bytes) -> str:
        return self._owner.get(key, UNOWNED)

    def owners(self, keys: Iterable[bytes]) -> list[str]:
        with self._lock:
            return [self._owner.get(k, UNOWNED) for k in keys]

    def put(self, tier: str, items: Iterable[tuple[bytes, int]]) -> None:
        """``tier`` now holds each key, in that many bytes."""
        items = list(items)
        with self._lock:
            sizes, used = self._sizes[tier], self._used[tier]
            for k, n in items:
                ns = self._owner.get(k, UNOWNED)
                used[ns] += n - sizes.get(k, 0)
                sizes[k] = n
            if tier == self._durable and self._pending:  # flushed: counted on the durable tier from now on
                self._settle(k for k, _ in items)

    def pend(self, items: Iterable[tuple[bytes, int]]) -> None:
        """Write-back: each key is bound for the durable tier, in that many bytes (as sent); counted
        toward its namespace's ``used_durably`` until the durable tier holds it (a key it holds
        already is not pending)."""
        with self._lock:
            durable = self._sizes.get(self._durable, {})
            for k, n in items:
                if k in durable:
                    continue
                self._pending_used[self._owner.get(k, UNOWNED)] += n - self._pending.get(k, 0)
                self._pending[k] = n

    def settle(self, keys: Iterable[bytes]) -> None:
        """``keys`` are no longer pending (made durable, or deleted)."""
        with self._lock:
            self._settle(keys)

    def _settle(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            n = self._pending.pop(k, None)
            if n is not None:
                self._pending_used[self._owner.get(k, UNOWNED)] -= n

    def drop(self, tier: str, keys: Iterable[bytes]) -> None:
        """``tier`` no longer holds ``keys``; a key no tracked tier holds any more loses its owner
        only once nothing claims it again (a claim is kept: a chunk saved again is the same key)."""
        with self._lock:
            sizes, used = self._sizes[tier], self._used[tier]
            for k in keys:
                n = sizes.pop(k, None)
                if n is not None:
                    used[self._owner.get(k, UNOWNED)] -= n

    def forget(self, keys: Iterable[bytes]) -> None:
        """Keys deleted from every tier (a session's freed chunks): their owner is forgotten too (and
        they are no longer pending)."""
        keys = list(keys)
        with self._lock:
            self._settle(keys)
            for k in keys:
                if not any(k in s for s in self._sizes.values()):
                    self._owner.pop(k, None)

    def used(self, tier: str, namespace: str) -> int:
        with self._lock:
            return self._used[tier].get(namespace, 0)

    def pending(self, namespace: str) -> int:
        """Write-back: bytes of ``namespace`` on their way to the durable tier (``pend``)."""
        with self._lock:
            return self._pending_used.get(namespace, 0)

    def used_durably(self, namespace: str) -> int:
        """Bytes ``namespace`` holds on the durable tier, and its pending ones bound for it: what its
        share of the durable tier (its ssd quota) is checked against."""
        with self._lock:
            return self._used[self._durable].get(namespace, 0) + self._pending_used.get(namespace, 0)

    def durable_bytes(self, keys: Iterable[bytes]) -> int:
        """What ``keys`` take of the durable tier (a pending key: its size as sent): what deleting them frees."""
        with self._lock:
            sizes = self._sizes.get(self._durable, {})
            return sum(sizes.get(k, self._pending.get(k, 0)) for k in set(keys))

    def usage(self) -> dict[str, dict[str, int]]:
        """namespace -> tier -> bytes, for every namespace holding bytes on some tier."""
        out: dict[str, dict[str, int]] = defaultdict(dict)
        with self._lock:
            for tier, used in self._used.items():
                for ns, n in used.items():
                    if n:
                        out[ns][tier] = n
        return dict(out)
