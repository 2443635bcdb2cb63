"""The daemon's statistics as a StatsResponse: the store's, how chunk data travelled, prefetches.

The store computes its figures in Python ints; here each is clamped to its field (0 to 2^64 - 1, or
2^32 - 1): a figure one tenant's input pushed past a field reads as the field's largest value, and
Stats and /metrics still answer for everyone."""

from __future__ import annotations

from kvstore.store import BytesPerToken, StoreStats
from kvstore.store.quotas import NamespaceUsage
from kvstore.store.sessions.prefetch import PrefetchCounters
from kvstore.v1 import kvstore_pb2 as pb

U32, U64 = (1 << 32) - 1, (1 << 64) - 1


def _u64(n: int) -> int:
    return min(max(int(n), 0), U64)


def _u32(n: int) -> int:
    return min(max(int(n), 0), U32)


def bpt_to_pb(b: BytesPerToken) -> pb.BytesPerToken:
    return pb.BytesPerToken(
        tokens=_u64(b.tokens), sessions=_u32(b.sessions), unique_chunks=_u32(b.unique_chunks), formula=b.formula,
        payload=_u64(b.payload), chunk_overhead=_u64(b.chunk_overhead), manifests=_u64(b.manifests),
        stored=_u64(b.stored), raw=_u64(b.raw), lmdb_overhead=_u64(b.lmdb_overhead), measured=b.measured,
        baseline_swa_snapshot=_u64(b.baseline_swa_per_turn),
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
    return pb.StatsResponse(tiers=tiers, lookups=_u64(h.lookups), requested_tokens=_u64(h.requested_tokens),
                            hit_tokens=_u64(h.hit_tokens), loaded_chunks=_u64(h.loaded_chunks),
                            missed_chunks=_u64(h.missed_chunks), sessions=_u32(s.sessions),
                            bytes_per_token=bpt_to_pb(s.bytes_per_token))


def usage_to_pb(u: NamespaceUsage) -> pb.NamespaceUsage:
    q = u.quota
    return pb.NamespaceUsage(
        namespace=u.namespace, host_bytes=_u64(u.host_bytes), ssd_bytes=_u64(u.ssd_bytes), sessions=_u32(u.sessions),
        host_quota=_u64(q.host_bytes or 0), has_host_quota=q.host_bytes is not None,
        ssd_quota=_u64(q.ssd_bytes or 0), has_ssd_quota=q.ssd_bytes is not None,
        sessions_quota=_u32(q.sessions or 0), has_sessions_quota=q.sessions is not None)
