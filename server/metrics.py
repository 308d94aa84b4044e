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

# The client software a request names (X-KVCache-Client; the shared-memory HELLO): its traffic gets
# series of its own, labelled from this closed set (anything else is "other"), so a client cannot
# grow the label's cardinality.
CLIENT_HEADER = "X-KVCache-Client"
KNOWN_CLIENTS = ("vllm", "sglang", "kvcache")
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


def client_label(name: str | None) -> str:
    """The metrics label of a client name: "" (no series of its own) when none was given."""
    if not name:
        return ""
    name = name.strip().lower()
    return name if name in KNOWN_CLIENTS else "other"


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
        self.client_blocks = Counter("kvcache_client_blocks", "Blocks looked up, read or written by a named "
                                     "client (vllm, sglang, ...), by tier and result",
                                     ["client", "op", "tier", "result"], registry=r)
        self.client_bytes = Counter("kvcache_client_bytes", "Payload bytes a named client read or wrote, by tier",
                                    ["client", "op", "tier"], registry=r)
        self.client_read_seconds = Histogram("kvcache_client_read_seconds", "How long the daemon took to serve a "
                                             "named client's read, by the slowest tier it read from",
                                             ["client", "tier"], buckets=LATENCY_BUCKETS, registry=r)
        r.register(_StoreCollector(store))

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def _blocks(self, client: str, op: str, tier: str, result: str, n: int) -> None:
        self.blocks.labels(op, tier, result).inc(n)
        if client:
            self.client_blocks.labels(client, op, tier, result).inc(n)

    def _bytes(self, client: str, op: str, tier: str, n: int) -> None:
        self.bytes.labels(op, tier).inc(n)
        if client:
            self.client_bytes.labels(client, op, tier).inc(n)

    def observe_read(self, client: str, tiers, seconds: float) -> None:
        """A named client's read took `seconds`; labelled by the slowest of `tiers` (Tier flags)."""
        if client:
            slowest = max((t for t in tiers if t is not None), default=None, key=lambda t: t.fastest().value)
            self.client_read_seconds.labels(client, slowest.label if slowest is not None else "none").observe(seconds)

    def count_gets(self, got, client: str = "") -> None:
        """got: (payload or None, tier) per block; one counter update per tier, not per block."""
        hits, nbytes, misses = collections.Counter(), collections.Counter(), 0
        for payload, tier in got:
            if payload is None:
                misses += 1
            else:
                hits[tier] += 1
                nbytes[tier] += len(payload)
        if misses:
            self._blocks(client, "get", "none", "miss", misses)
        for tier, n in hits.items():
            self._blocks(client, "get", tier.label, "hit", n)
            self._bytes(client, "get", tier.label, nbytes[tier])

    def count_hits(self, op: str, tier, hits: int, nbytes: int, misses: int, client: str = "") -> None:
        """Counters for reads that carry no payload here (shared-memory leases)."""
        if misses:
            self._blocks(client, op, "none", "miss", misses)
        if hits:
            self._blocks(client, op, tier.label, "hit", hits)
            self._bytes(client, op, tier.label, nbytes)

    def count_puts(self, stored: int, present: int, client: str = "", nbytes: int = 0) -> None:
        self._blocks(client, "put", "any", "stored", stored)
        self._blocks(client, "put", "any", "present", present)
        if client and nbytes:
            self.client_bytes.labels(client, "put", "any").inc(nbytes)

    def count_lookup(self, n_keys: int, tiers: tuple[Tier, ...], client: str = "") -> None:
        for t, n in collections.Counter(tiers).items():
            self._blocks(client, "lookup", t.label, "hit", n)
        self._blocks(client, "lookup", "none", "miss", n_keys - len(tiers))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
