"""Prometheus metrics of the daemon (`/metrics`, text format, `kvcache_` prefix).

Request counts and latencies are observed by the server's middleware; block and byte counts
by its handlers; tier sizes, evictions, expirations and quarantines are read from the store
at scrape time, so they can never drift from what the store reports.
"""

from __future__ import annotations

import collections

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvcache.kvstore.types import Tier

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _StoreCollector:
    def __init__(self, store):
        self.store = store

    def collect(self):
        st = self.store.stats()
        used = GaugeMetricFamily("kvcache_tier_bytes", "Bytes held by each tier", labels=["tier"])
        cap = GaugeMetricFamily("kvcache_tier_capacity_bytes", "Configured capacity of each tier", labels=["tier"])
        blocks = GaugeMetricFamily("kvcache_tier_blocks", "Blocks held by each tier", labels=["tier"])
        for t in st.tiers:
            used.add_metric([t.tier], t.used_bytes)
            cap.add_metric([t.tier], t.capacity_bytes)
            blocks.add_metric([t.tier], t.blocks)
        yield from (used, cap, blocks)
        yield GaugeMetricFamily("kvcache_index_blocks", "Blocks in the index", value=st.index_blocks)
        ev = CounterMetricFamily("kvcache_evictions", "Blocks evicted, by tier", labels=["tier"])
        ev.add_metric(["dram"], st.counters.get("evictions_dram", 0))
        ev.add_metric(["nvme"], st.persistent_counters.get("evicted_nvme", 0))
        yield ev
        yield CounterMetricFamily("kvcache_expired", "Blocks deleted by retention (all time)",
                                  value=st.persistent_counters.get("expired", 0))
        yield CounterMetricFamily("kvcache_quarantined", "Blocks that failed verification (all time)",
                                  value=st.persistent_counters.get("quarantined", 0))
        dram = self.store.dram
        if dram is not None and dram.directory is not None:
            yield GaugeMetricFamily("kvcache_shm_directory_entries", "DRAM blocks that local clients can read "
                                    "without a lease (the shared-memory read directory)", value=len(dram.directory))


class Metrics:
    def __init__(self, store):
        disable_created_metrics()  # the *_created series only add noise to every scrape
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvcache_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.latency = Histogram("kvcache_request_seconds", "HTTP request latency", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.blocks = Counter("kvcache_blocks", "Blocks looked up, read or written, by tier and result",
                              ["op", "tier", "result"], registry=r)
        self.bytes = Counter("kvcache_bytes", "Payload bytes read or written, by tier", ["op", "tier"], registry=r)
        r.register(_StoreCollector(store))

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def count_gets(self, got) -> None:
        """got: (payload or None, tier) per block; one counter update per tier, not per block."""
        hits, nbytes, misses = collections.Counter(), collections.Counter(), 0
        for payload, tier in got:
            if payload is None:
                misses += 1
            else:
                hits[tier] += 1
                nbytes[tier] += len(payload)
        if misses:
            self.blocks.labels("get", "none", "miss").inc(misses)
        for tier, n in hits.items():
            self.blocks.labels("get", tier.label, "hit").inc(n)
            self.bytes.labels("get", tier.label).inc(nbytes[tier])

    def count_hits(self, op: str, tier, hits: int, nbytes: int, misses: int) -> None:
        """Counters for reads that carry no payload here (shared-memory leases)."""
        if misses:
            self.blocks.labels(op, "none", "miss").inc(misses)
        if hits:
            self.blocks.labels(op, tier.label, "hit").inc(hits)
            self.bytes.labels(op, tier.label).inc(nbytes)

    def count_puts(self, stored: int, present: int) -> None:
        self.blocks.labels("put", "any", "stored").inc(stored)
        self.blocks.labels("put", "any", "present").inc(present)

    def count_lookup(self, n_keys: int, tiers: tuple[Tier, ...]) -> None:
        for t, n in collections.Counter(tiers).items():
            self.blocks.labels("lookup", t.label, "hit").inc(n)
        self.blocks.labels("lookup", "none", "miss").inc(n_keys - len(tiers))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
