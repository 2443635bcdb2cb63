"""Per-namespace usage of the tiers this daemon owns (the durable tier and faster ones): which
namespace owns each chunk key and how many bytes each namespace holds on each tier, kept as chunks
move (``TierSlot`` reports each put and drop), for quotas (``store/quotas.py``) and stats.

A chunk key hashes its namespace, so a key has one owner for good: the session store claims keys
for their namespace before it writes them, and for every manifest it indexes (at open, and versions
caught up from other daemons). Bytes put before their claim (a chunk the ssd tier held at open)
count for the unowned namespace "" until claimed, then move to their owner. A chunk shared by
sessions of one namespace is one key: counted once. Bytes are the tier's own (``Tier.size_of``:
on the ssd tier after compression, what the disk holds).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence

#: The owner of a key nobody claimed (yet).
UNOWNED = ""


class Ledger:
    def __init__(self, tiers: Sequence[str]) -> None:
        self._lock = threading.Lock()
        self._owner: dict[bytes, str] = {}
        self._sizes: dict[str, dict[bytes, int]] = {t: {} for t in tiers}
        self._used: dict[str, defaultdict[str, int]] = {t: defaultdict(int) for t in tiers}

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

    def owner(self, key: bytes) -> str:
        return self._owner.get(key, UNOWNED)

    def owners(self, keys: Iterable[bytes]) -> list[str]:
        with self._lock:
            return [self._owner.get(k, UNOWNED) for k in keys]

    def put(self, tier: str, items: Iterable[tuple[bytes, int]]) -> None:
        """``tier`` now holds each key, in that many bytes."""
        with self._lock:
            sizes, used = self._sizes[tier], self._used[tier]
            for k, n in items:
                ns = self._owner.get(k, UNOWNED)
                used[ns] += n - sizes.get(k, 0)
                sizes[k] = n

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
        """Keys deleted from every tier (a session's freed chunks): their owner is forgotten too."""
        with self._lock:
            for k in keys:
                if not any(k in s for s in self._sizes.values()):
                    self._owner.pop(k, None)

    def used(self, tier: str, namespace: str) -> int:
        with self._lock:
            return self._used[tier].get(namespace, 0)

    def usage(self) -> dict[str, dict[str, int]]:
        """namespace -> tier -> bytes, for every namespace holding bytes on some tier."""
        out: dict[str, dict[str, int]] = defaultdict(dict)
        with self._lock:
            for tier, used in self._used.items():
                for ns, n in used.items():
                    if n:
                        out[ns][tier] = n
        return dict(out)
