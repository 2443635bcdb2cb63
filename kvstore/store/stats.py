"""What the store reports: per-tier state, token-level hits, and persistent bytes per token.

Every figure is computed in Python ints (and Fractions), so no tenant's layout or session can make
it raise: a sum past a proto field's width is clamped where it becomes a message (``stats_pb.py``).
A session whose layout this store cannot read (a page layout that did not reopen, or one a shared
session names that this daemon was never told of) counts its chunks, and neither tokens nor bytes
per token: its layout says what those are."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

from kvstore.store.sessions.counters import HitCounters
from kvstore.store.sessions.kind import UNREADABLE, StoredSizes
from kvstore.store.sessions.store import SessionStore
from kvstore.store.tiered.store import TierReport


@dataclass(frozen=True)
class BytesPerToken:
    """Bytes on the persistent tier per token of live sessions (each shared chunk counted once).

    ``payload`` is exactly what the layout formula predicts; everything else is what the store
    adds: chunk headers + token ids + checksums, manifests (incl. their trailing spans' overhead),
    and LMDB's own page overhead. ``stored`` is after compression."""

    tokens: int
    sessions: int
    unique_chunks: int
    formula: float  # layout bytes/token (token-weighted when layouts are mixed)
    payload: int
    chunk_overhead: int
    manifests: int
    stored: int  # bytes the durable tier holds, chunks and manifests (compressed where it helped)
    raw: int  # the same uncompressed
    lmdb_overhead: int  # LMDB pages in use minus stored bytes (0 for non-LMDB tiers)
    baseline_swa_per_turn: int  # what a V4-Flash-style store adds per persisted turn boundary (SWA snapshot)

    @property
    def measured(self) -> float:
        """On-disk bytes per token: stored values plus LMDB overhead."""
        return (self.stored + self.lmdb_overhead) / self.tokens if self.tokens else 0.0

    @property
    def uncompressed(self) -> float:
        return (self.payload + self.chunk_overhead + self.manifests) / self.tokens if self.tokens else 0.0


@dataclass(frozen=True)
class StoreStats:
    tiers: list[TierReport]
    hits: HitCounters
    sessions: int
    bytes_per_token: BytesPerToken


def _sizes(sessions: SessionStore, layout_id: bytes) -> StoredSizes:
    """What one stored blob of ``layout_id`` counts for, as its kind says; nothing for an unreadable one."""
    kind = sessions.kinds.stored(layout_id)
    return kind.sizes(layout_id) if kind is not None else UNREADABLE


def _bpt(sessions: SessionStore, layout_id: bytes) -> Fraction:
    lay = sessions.layouts.get(layout_id)
    return lay.bytes_per_token if lay is not None else Fraction(0)


def bytes_per_token(sessions: SessionStore) -> BytesPerToken:
    store = sessions.store
    live = sessions.live_chunks()
    manifests = sessions.list_sessions()
    # per layout, then multiplied: a page layout's Fractions may have large denominators (one per group)
    chunks_of = Counter(live.values())
    sizes = {lid: _sizes(sessions, lid) for lid in chunks_of}
    tokens = round(sum((sizes[lid].tokens * n for lid, n in chunks_of.items()), Fraction(0)))
    tokens += sum(m.tail_tokens for m in manifests)
    chunk_payload = round(sum((sizes[lid].payload * n for lid, n in chunks_of.items()), Fraction(0)))
    payload = chunk_payload
    raw_chunks = sum(sizes[lid].encoded * n for lid, n in chunks_of.items())
    manifest_bytes = 0
    session_tokens: Counter[bytes] = Counter()  # of sessions whose layout this store can read
    for m in manifests:
        tail = sessions.kinds.of(m.kind).tail_payload(m)
        payload += tail
        manifest_bytes += len(m.encode()) - tail
        if sessions.layouts.get(m.layout_id) is not None:
            session_tokens[m.layout_id] += m.token_count
    total_session_tokens = sum(session_tokens.values())
    formula_num = sum((_bpt(sessions, lid) * t for lid, t in session_tokens.items()), Fraction(0))
    formula = float(formula_num / total_session_tokens) if total_session_tokens else 0.0
    durable = store.durable_stats()
    usage = durable.usage
    stored_manifests = sum(len(m.encode()) for m in manifests)  # kept raw in the meta keyspace
    lmdb_overhead = 0
    if (s := durable.pages) is not None:
        lmdb_overhead = max(0, s.in_use * s.psize - usage.used_bytes - stored_manifests)
    swa = max((getattr(sessions.layouts.get(m.layout_id), "swa_state_bytes", 0) for m in manifests), default=0)
    return BytesPerToken(tokens, len(manifests), len(live), formula, payload, raw_chunks - chunk_payload,
                         manifest_bytes, usage.used_bytes + stored_manifests, usage.raw_bytes + stored_manifests,
                         lmdb_overhead, swa)


def store_stats(sessions: SessionStore) -> StoreStats:
    return StoreStats(sessions.store.reports(), sessions.hits, len(sessions.list_sessions()), bytes_per_token(sessions))
