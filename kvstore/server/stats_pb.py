"""The daemon's statistics as a StatsResponse: the store's, how chunk data travelled, prefetches."""

from __future__ import annotations

from kvstore.store import BytesPerToken, StoreStats
from kvstore.store.prefetch import PrefetchCounters
from kvstore.v1 import kvstore_pb2 as pb


def bpt_to_pb(b: BytesPerToken) -> pb.BytesPerToken:
    return pb.BytesPerToken(
        tokens=b.tokens, sessions=b.sessions, unique_chunks=b.unique_chunks, formula=b.formula, payload=b.payload,
        chunk_overhead=b.chunk_overhead, manifests=b.manifests, stored=b.stored, raw=b.raw,
        lmdb_overhead=b.lmdb_overhead, measured=b.measured, baseline_swa_snapshot=b.baseline_swa_per_turn,
    )


def prefetch_to_pb(c: PrefetchCounters) -> pb.PrefetchStats:
    return pb.PrefetchStats(requested=c.requested, completed=c.completed, chunks_promoted=c.chunks_promoted,
                            coalesced=c.coalesced, dropped=c.dropped, chunks_skipped=c.chunks_skipped,
                            pending=c.pending)


def stats_to_pb(s: StoreStats) -> pb.StatsResponse:
    tiers = []
    for r in s.tiers:
        c, u = r.counters, r.usage
        tiers.append(pb.TierStats(
            name=r.name, persistent=r.persistent, used_bytes=u.used_bytes, capacity_bytes=u.capacity_bytes,
            items=u.items, raw_bytes=u.raw_bytes, hits=c.hits, evictions=c.evictions, demotions=c.demotions,
            promotions=c.promotions, verify_failures=c.verify_failures, errors=c.errors, degraded=c.degraded,
            last_error=c.last_error,
        ))
    h = s.hits
    return pb.StatsResponse(tiers=tiers, lookups=h.lookups, requested_tokens=h.requested_tokens,
                            hit_tokens=h.hit_tokens, loaded_chunks=h.loaded_chunks, missed_chunks=h.missed_chunks,
                            sessions=s.sessions, bytes_per_token=bpt_to_pb(s.bytes_per_token))
