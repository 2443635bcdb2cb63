"""What the store reports: per-tier state, token-level hits, and persistent bytes per token."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore import chunk
from kvstore.store.counters import HitCounters
from kvstore.store.sessions import SessionStore
from kvstore.store.tiered import TierReport
from kvstore.store.validate import known_layout


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


def bytes_per_token(sessions: SessionStore) -> BytesPerToken:
    store = sessions.store
    ct = sessions.config.chunk_tokens
    live = sessions.live_chunks()
    manifests = sessions.list()
    tokens = len(live) * ct + sum(m.tail_tokens for m in manifests)
    payload = sum(lay.chunk_payload_bytes(ct) for lay in live.values())
    raw_chunks = sum(chunk.encoded_size(lay, ct) for lay in live.values())
    manifest_bytes = 0
    formula_num = 0.0
    for m in manifests:
        lay = known_layout(m.layout_id)
        payload += lay.chunk_payload_bytes(m.tail_tokens)
        manifest_bytes += len(m.encode()) - lay.chunk_payload_bytes(m.tail_tokens)
        formula_num += float(lay.bytes_per_token) * m.token_count
    total_session_tokens = sum(m.token_count for m in manifests)
    formula = formula_num / total_session_tokens if total_session_tokens else 0.0
    durable = store.tiers[store.durable]
    usage = durable.usage()
    stored_manifests = sum(len(m.encode()) for m in manifests)  # kept raw in the meta keyspace
    lmdb_overhead = 0
    stats_fn = getattr(durable, "lmdb_stats", None)
    if stats_fn is not None:
        s = stats_fn()
        pages = s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]
        lmdb_overhead = max(0, pages * s["psize"] - usage.used_bytes - stored_manifests)
    swa = max((known_layout(m.layout_id).swa_state_bytes for m in manifests), default=0)
    return BytesPerToken(tokens, len(manifests), len(live), formula, payload,
                         raw_chunks - sum(lay.chunk_payload_bytes(ct) for lay in live.values()),
                         manifest_bytes, usage.used_bytes + stored_manifests, usage.raw_bytes + stored_manifests,
                         lmdb_overhead, swa)


def store_stats(sessions: SessionStore) -> StoreStats:
    return StoreStats(sessions.store.reports(), sessions.hits, len(sessions.list()), bytes_per_token(sessions))
