"""The store's one mover: a thread that copies chunks up the tiers after the call that asked for it answered.

Two kinds of job run on it, in the order they were submitted. Promotion behind a load: a resume from
the ssd tier wants its bytes now; the copy into the host tier only speeds up the next resume. Made
inside the load, that copy is a second pass over every byte (and for a long session, fresh memory
faulted in): a fifth of a 128K-token resume. So a batch read hands the keys it served from below to
this worker, which reads them again (one batch per tier, verified as any read) and promotes them.
And a prefetch (``prefetch.py``): a session's chunks read as batches and put into the fastest tier
ahead of its load. One thread per store, started on first use; ``settle`` waits until it is idle
(``evict`` and ``close`` do, so that nothing moves up behind an admin's move down).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

log = logging.getLogger(__name__)
_V = TypeVar("_V")

#: a promotion to run: keys read (again) and promoted, best effort
Job = Callable[[], None]


class PromotionWorker:
    def __init__(self) -> None:
        self._jobs: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, job: Job) -> None:
        """Run ``job`` (a best-effort promotion) on the worker thread, after what is queued; nothing
        once the worker is closed."""
        with self._cond:
            if self._closed:
                return
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-promote", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def settle(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted promotion ran; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout_s)

    def close(self) -> None:
        """Run what is queued, then stop the worker."""
        self.settle()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                job()
            except Exception:  # best effort, as every promotion: never the load's failure
                log.exception("a promotion on the worker failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def subset(verify: Callable[[Sequence[int], Sequence[_V]], Sequence[bool]], positions: Sequence[int]
           ) -> Callable[[Sequence[int], Sequence[_V]], Sequence[bool]]:
    """``verify`` for the keys at ``positions`` of the keys it was made for (a re-read of some of them)."""
    return lambda at, values: verify([positions[a] for a in at], values)
