"""Read-ahead for the redis tier: the chunks one load will read, fetched a window at a time.

A load asks the tiered store for its chunks one by one, and each one the redis tier serves would
be a round trip of its own. A load that knows which of its chunks only Redis holds registers them
(``RedisTier.read_ahead``): the first get of a window fetches the whole window in one pipeline
(one round trip per master) and starts fetching the next one in the background, so the network
runs ahead of the verification and the sending of the chunks before it. What the load does not
take is dropped when it ends. A get of a key no read-ahead expects takes the ordinary path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvstore.tiers.base import Stored

WINDOW = 16  # chunks per pipeline: ~3.7 MB of deepseek-v4.1-flash chunks


class ReadAhead:
    """The keys of one load, in order, in windows of ``WINDOW``; each window fetched once."""

    def __init__(self, keys: Sequence[bytes], fetch: Callable[[list[bytes]], list[Stored | None]],
                 pool: ThreadPoolExecutor) -> None:
        self.keys = list(dict.fromkeys(keys))
        self._window_of = {k: i // WINDOW for i, k in enumerate(self.keys)}
        self._fetch = fetch
        self._pool = pool
        self._lock = threading.Lock()
        self._windows: dict[int, Future[dict[bytes, Stored | None]]] = {}

    def _start(self, w: int) -> Future[dict[bytes, Stored | None]] | None:
        """Window ``w``'s fetch (started now if it was not). Called with the lock held."""
        if w * WINDOW >= len(self.keys):
            return None
        fut = self._windows.get(w)
        if fut is None:
            keys = self.keys[w * WINDOW : (w + 1) * WINDOW]
            fut = self._windows[w] = self._pool.submit(lambda: dict(zip(keys, self._fetch(keys))))
        return fut

    def start(self) -> None:
        """Fetch the first windows now, before the load asks for its first chunk."""
        with self._lock:
            self._start(0)
            self._start(1)

    def take(self, key: bytes) -> tuple[bool, Stored | None]:
        """(True, the value or None for a miss) if this read-ahead fetched ``key`` for the load;
        (False, None) if it does not expect it (or gave it out already). Errors of the fetch raise."""
        w = self._window_of.get(key)
        if w is None:
            return False, None
        with self._lock:
            fut = self._start(w)
            self._start(w + 1)  # the next window travels while this one is used
        assert fut is not None
        got = fut.result()
        with self._lock:
            if key not in got:
                return False, None
            return True, got.pop(key)

    def close(self) -> None:
        with self._lock:
            for fut in self._windows.values():
                fut.cancel()
            self._windows.clear()
