"""Prometheus metrics (opt-in port): a collector that reads the store's stats and the transport
counts at scrape time, beside the per-RPC metrics the interceptor of rpc_metrics.py records.

A tier with capacity 0 ("unlimited") exports no capacity and no fill ratio, so a dashboard's
used / capacity never divides by zero into +Inf: the series is absent, which is what it means.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.store import SessionStore, store_stats
from kvstore.v1 import kvstore_pb2 as pb


class StoreCollector(Collector):
    def __init__(self, sessions: SessionStore, transport: Callable[[], pb.TransportStats],
                 prefetch: Callable[[], pb.PrefetchStats] | None = None) -> None:
        self.sessions = sessions
        self.transport = transport
        self.prefetch = prefetch

    def collect(self) -> Iterator[Metric]:
        s = store_stats(self.sessions)
        gauges = {name: GaugeMetricFamily(f"kvstore_tier_{name}", help_, labels=["tier"]) for name, help_ in (
            ("used_bytes", "Bytes held by the tier"),
            ("capacity_bytes", "Tier capacity (absent for an unlimited tier)"),
            ("fill_ratio", "used_bytes / capacity_bytes (absent for an unlimited tier)"),
            ("items", "Chunks held by the tier"))}
        counters = {name: CounterMetricFamily(f"kvstore_tier_{name}", help_, labels=["tier"]) for name, help_ in (
            ("hits", "Chunk reads served by the tier"), ("evictions", "Chunks evicted from the tier"),
            ("demotions", "Chunks demoted to the next tier"), ("promotions", "Chunks promoted into the tier"),
            ("verify_failures", "Stored chunks that failed verification"), ("errors", "Tier operation failures"))}
        for r in s.tiers:
            gauges["used_bytes"].add_metric([r.name], r.usage.used_bytes)
            if r.usage.capacity_bytes:
                gauges["capacity_bytes"].add_metric([r.name], r.usage.capacity_bytes)
                gauges["fill_ratio"].add_metric([r.name], r.usage.used_bytes / r.usage.capacity_bytes)
            gauges["items"].add_metric([r.name], r.usage.items)
            for name, fam in counters.items():
                fam.add_metric([r.name], getattr(r.counters, name))
        yield from gauges.values()
        yield from counters.values()
        h = s.hits
        yield from _counters("kvstore_", (
            ("lookups", "Lookup calls", h.lookups),
            ("lookup_requested_tokens", "Tokens asked for in lookups", h.requested_tokens),
            ("lookup_hit_tokens", "Tokens found in lookups", h.hit_tokens),
            ("loads", "Chunk and session loads", h.loads),
            ("loaded_chunks", "Chunks served by loads", h.loaded_chunks),
            ("missed_chunks", "Chunks loads asked for and did not get", h.missed_chunks)))
        t = self.transport()
        yield GaugeMetricFamily("kvstore_transport_arenas", "Same-host arenas attached now", value=t.arenas)
        calls = CounterMetricFamily("kvstore_transport_calls", "Chunk saves and loads, by how their chunks travelled",
                                    labels=["carrier"])
        calls.add_metric(["arena"], t.arena_calls - t.overflow_calls)
        calls.add_metric(["arena_overflow"], t.overflow_calls)
        calls.add_metric(["stream"], t.stream_calls)
        yield calls
        yield CounterMetricFamily("kvstore_local_socket_calls", "Calls made over the same-host local socket",
                                  value=t.local_calls)
        if self.prefetch is not None:
            p = self.prefetch()
            yield from _counters("kvstore_prefetch_", (
                ("requested", "PrefetchSession calls answered", p.requested),
                ("completed", "Sessions the prefetch worker finished", p.completed),
                ("chunks_promoted", "Chunks prefetch copied into the fastest tier", p.chunks_promoted),
                ("coalesced", "Prefetches that joined one already waiting", p.coalesced),
                ("dropped", "Prefetches refused because the queue was full", p.dropped)))
            yield GaugeMetricFamily("kvstore_prefetch_pending", "Sessions waiting for prefetch", value=p.pending)
        yield from _namespaces(self.sessions)
        yield GaugeMetricFamily("kvstore_sessions", "Live sessions", value=s.sessions)
        yield GaugeMetricFamily("kvstore_persistent_bytes_per_token", "Persistent bytes per token of live sessions",
                                value=s.bytes_per_token.measured)


def _namespaces(sessions: SessionStore) -> Iterator[Metric]:
    """Per-namespace usage and quotas (the metrics port is the operator's: every namespace); a quota
    series is absent for an unlimited quota, as a tier's capacity is."""
    used = GaugeMetricFamily("kvstore_namespace_bytes", "Bytes a namespace holds on a tier",
                             labels=["namespace", "tier"])
    quota = GaugeMetricFamily("kvstore_namespace_quota_bytes", "A namespace's quota of a tier's bytes",
                              labels=["namespace", "tier"])
    count = GaugeMetricFamily("kvstore_namespace_sessions", "Live sessions of a namespace", labels=["namespace"])
    limit = GaugeMetricFamily("kvstore_namespace_quota_sessions", "A namespace's sessions quota", labels=["namespace"])
    for u in sessions.admission.usage():
        for tier, n, q in (("host", u.host_bytes, u.quota.host_bytes), ("ssd", u.ssd_bytes, u.quota.ssd_bytes)):
            used.add_metric([u.namespace, tier], n)
            if q is not None:
                quota.add_metric([u.namespace, tier], q)
        count.add_metric([u.namespace], u.sessions)
        if u.quota.sessions is not None:
            limit.add_metric([u.namespace], u.quota.sessions)
    yield from (used, quota, count, limit)


def start_metrics(registry: CollectorRegistry, sessions: SessionStore, transport: Callable[[], pb.TransportStats],
                  host: str, port: int, prefetch: Callable[[], pb.PrefetchStats] | None = None) -> WSGIServer:
    """Serve ``registry`` (the per-RPC metrics are already on it) plus the store, transport and
    prefetch state."""
    registry.register(StoreCollector(sessions, transport, prefetch))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server


def _counters(prefix: str, rows: Iterable[tuple[str, str, float]]) -> Iterator[CounterMetricFamily]:
    """One counter family per (name, help, value) row."""
    for name, help_, value in rows:
        yield CounterMetricFamily(f"{prefix}{name}", help_, value=value)
