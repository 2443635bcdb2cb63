"""Resume-ahead prefetch: promote a session's chunks to the fastest tier in the background.

A scheduler that knows a session is about to resume asks for it (the PrefetchSession RPC); the
request is answered at once and the copying is a job on the store's one promotion worker (the thread
that also promotes what loads read from slower tiers: ``store/tiered/promotion.py``), so the work is bounded: one
session at a time, at most ``max_pending`` sessions waiting, a second request for a session still
waiting joins it (coalesced), and a request past the bound is answered as dropped (the session
still loads, from the slower tier: a prefetch is a hint, never a promise, and RESOURCE_EXHAUSTED
already means "the durable tier is full" in this API).

Why loads never wait and never see partial state: the worker reads the session's chunks as a load
does, a batch read of a window of them at a time verified as a load verifies them
(``SessionStore.verifier``), and puts the whole verified blobs into the fastest tier in one batch
(``TieredStore.prefetch``), under that tier's lock, which loads never take. A load
meanwhile reads the chunk from whichever tier holds it, verified as always. Nothing is deleted but
what making room demotes (never the durable copy). The session's chunks are pinned while the worker
promotes them, so promoting its own later chunks never evicts its earlier ones; what does not fit is
skipped. Ownership is the loads': the session is looked up in the caller's namespace (another
namespace's is NOT_FOUND, like an absent one), and only chunks that namespace owns are read.

Fairness between namespaces: each namespace has its own queue, and the worker serves them in
turn (round robin: one session of each namespace waiting, then the next), and one namespace may
have at most ``max_pending_per_namespace`` sessions waiting (more are dropped; the daemon's is
``[store] max_prefetch_per_namespace``, 16 by default), so a tenant
prefetching in a loop neither fills the queue nor makes another's prefetch wait behind all of its
own. What a prefetch copies into the host tier counts against its namespace's host share
(``store/tiered/demotion.py``): past it, its own chunks move down, never another's within its share.

Like a load's promote-on-read, a chunk whose session is deleted while it is copied may stay in the
fast tier unreferenced until it is evicted (it is never served: reads check ownership).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.store.sessions.store import SessionRef, SessionStore

log = logging.getLogger(__name__)
#: Chunks read and put into the fastest tier together: a batch per window, ``stop`` heard between windows.
WINDOW_CHUNKS = 64


@dataclass(frozen=True)
class PrefetchConfig:
    max_pending: int = 64  # sessions waiting (the one being promoted included); more are dropped
    #: Of those, one namespace's; more of its requests are dropped. The daemon's is the store's
    #: ``max_prefetch_per_namespace`` (``[store]``, ``--store-max-prefetch-per-namespace``).
    max_pending_per_namespace: int = 16
    stop_timeout_s: float = 10.0  # how long stop() waits for the window being copied

    def __post_init__(self) -> None:
        for name in ("max_pending", "max_pending_per_namespace"):
            if getattr(self, name) < 1:
                raise ValueError(f"prefetch {name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class PrefetchAnswer:
    """What a request got: chunks queued for promotion and chunks already in the fastest tier."""

    queued: int
    already_fast: int
    coalesced: bool = False
    dropped: bool = False


@dataclass
class PrefetchCounters:
    requested: int = 0
    completed: int = 0
    chunks_promoted: int = 0
    coalesced: int = 0
    dropped: int = 0
    chunks_skipped: int = 0
    pending: int = 0


class Prefetcher:
    """A bounded FIFO of sessions, each promoted by a job on the store's promotion worker; ``start``
    and ``stop`` with the daemon (before ``start``, and after ``stop``, a request is dropped)."""

    def __init__(self, sessions: SessionStore, config: PrefetchConfig | None = None) -> None:
        """``config`` None: the defaults, with the store's ``max_prefetch_per_namespace`` (the daemon's)."""
        self.sessions = sessions
        self.config = config if config is not None else PrefetchConfig(
            max_pending_per_namespace=sessions.config.max_prefetch_per_namespace)
        self._cond = threading.Condition()
        #: namespace -> its sessions waiting, oldest first; namespaces in the order they are served
        self._waiting: OrderedDict[str, OrderedDict[SessionRef, None]] = OrderedDict()
        self._busy = 0  # sessions being promoted now (0 or 1)
        self._counters = PrefetchCounters()
        self._started = False
        self._stopping = False

    @property
    def fast_tier(self) -> str:
        return self.sessions.store.tier_names()[0]

    def start(self) -> None:
        with self._cond:
            self._started, self._stopping = True, False

    def stop(self) -> None:
        """Drop what is waiting, let the window being copied finish (before the store closes)."""
        with self._cond:
            self._started, self._stopping = False, True
            self._waiting.clear()
            self._cond.wait_for(lambda: not self._busy, self.config.stop_timeout_s)

    def request(self, namespace: str, session_id: str) -> PrefetchAnswer:
        """Queue a session (NotFound / InvalidArgument exactly as a load); blocks only for a lookup
        of where its chunks are, never for a copy."""
        keys = self.sessions.session_chunks(namespace, session_id)
        fast = sum(self._in_fastest(k) for k in keys)
        answer = PrefetchAnswer(len(keys) - fast, fast)
        ref = (namespace, session_id)
        with self._cond:
            c = self._counters
            c.requested += 1
            mine = self._waiting.get(namespace)
            if mine is not None and ref in mine:
                c.coalesced += 1
                return PrefetchAnswer(answer.queued, fast, coalesced=True)
            if not answer.queued:
                return answer
            if (not self._started or self._pending() + self._busy >= self.config.max_pending
                    or len(mine or ()) >= self.config.max_pending_per_namespace):
                c.dropped += 1
                return PrefetchAnswer(0, fast, dropped=True)
            self._waiting.setdefault(namespace, OrderedDict())[ref] = None
        self.sessions.store.run_behind(self._next)
        return answer

    def _pending(self) -> int:
        """Sessions waiting, every namespace's (under the condition's lock)."""
        return sum(len(q) for q in self._waiting.values())

    def _take(self) -> SessionRef:
        """The next session to promote: the oldest of the namespace whose turn it is (under the lock)."""
        namespace, mine = self._waiting.popitem(last=False)
        ref, _ = mine.popitem(last=False)
        if mine:
            self._waiting[namespace] = mine  # its next session waits for every other namespace's turn
        return ref

    def _in_fastest(self, key: bytes) -> bool:
        """A probe of the fastest tier alone (``where`` would ask every tier, Redis over the network)."""
        return self.sessions.store.in_fastest(key)

    def counters(self) -> PrefetchCounters:
        with self._cond:
            return PrefetchCounters(**{**self._counters.__dict__, "pending": self._pending() + self._busy})

    # -- on the promotion worker ------------------------------------------------------------------
    def _next(self) -> None:
        """One job: the session waiting longest, promoted (one job is submitted per session queued)."""
        with self._cond:
            if self._stopping or not self._waiting:
                return
            ref = self._take()
            self._busy = 1
        try:
            promoted, skipped = self._promote(*ref)
        except Exception as e:  # deleted or expired meanwhile, a failing tier: the hint is dropped
            log.info("prefetch of %s/%s stopped: %s", *ref, e)
            promoted, skipped = 0, 0
        with self._cond:
            self._busy = 0
            c = self._counters
            c.completed += 1
            c.chunks_promoted += promoted
            c.chunks_skipped += skipped
            self._cond.notify_all()

    def _promote(self, namespace: str, session_id: str) -> tuple[int, int]:
        keys = self.sessions.session_chunks(namespace, session_id)
        store = self.sessions.store
        promoted = skipped = 0
        store.pin(keys)  # its own later chunks never push its earlier ones out
        try:
            for at in range(0, len(keys), WINDOW_CHUNKS):
                if self._stopping:
                    break
                window: Sequence[bytes] = keys[at:at + WINDOW_CHUNKS]
                went = store.prefetch(window, self.sessions.verifier(namespace, window))
                promoted += sum(w is True for w in went)
                skipped += sum(w is False for w in went)
        finally:
            store.unpin(keys)
        return promoted, skipped
