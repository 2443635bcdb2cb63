"""Prometheus metrics (opt-in port): a collector that reads the store's stats at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.store import SessionStore, store_stats


class StoreCollector(Collector):
    def __init__(self, sessions: SessionStore) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[Metric]:
        s = store_stats(self.sessions)
        gauges = {name: GaugeMetricFamily(f"kvstore_tier_{name}", help_, labels=["tier"]) for name, help_ in (
            ("used_bytes", "Bytes held by the tier"), ("capacity_bytes", "Tier capacity (0 = unlimited)"),
            ("items", "Chunks and manifests held by the tier"))}
        counters = {name: CounterMetricFamily(f"kvstore_tier_{name}", help_, labels=["tier"]) for name, help_ in (
            ("hits", "Chunk reads served by the tier"), ("evictions", "Chunks evicted from the tier"),
            ("demotions", "Chunks demoted to the next tier"), ("promotions", "Chunks promoted into the tier"),
            ("verify_failures", "Stored chunks that failed verification"), ("errors", "Tier operation failures"))}
        for r in s.tiers:
            gauges["used_bytes"].add_metric([r.name], r.usage.used_bytes)
            gauges["capacity_bytes"].add_metric([r.name], r.usage.capacity_bytes)
            gauges["items"].add_metric([r.name], r.usage.items)
            for name, fam in counters.items():
                fam.add_metric([r.name], getattr(r.counters, name))
        yield from gauges.values()
        yield from counters.values()
        yield CounterMetricFamily("kvstore_lookup_requested_tokens", "Tokens asked for in lookups",
                                  value=s.hits.requested_tokens)
        yield CounterMetricFamily("kvstore_lookup_hit_tokens", "Tokens found in lookups", value=s.hits.hit_tokens)
        yield GaugeMetricFamily("kvstore_sessions", "Live sessions", value=s.sessions)
        yield GaugeMetricFamily("kvstore_persistent_bytes_per_token", "Persistent bytes per token of live sessions",
                                value=s.bytes_per_token.measured)


def start_metrics(sessions: SessionStore, host: str, port: int) -> WSGIServer:
    registry = CollectorRegistry()
    registry.register(StoreCollector(sessions))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
