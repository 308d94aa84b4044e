"""Two simulated days of a real BlockStore writing to a ParquetEventLog, for the event log and
report tests. What the store answered is tallied by hand alongside, so tests compare the log
and the report against the store's own results, not against the code under test."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from kvcache.gc.collector import Collector
from kvcache.kvstore.retention import RetentionPolicy, RetentionRule
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.event_log import ParquetEventLog
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.types import Tier
from kvcache.tiering.config import DramConfig, NvmeConfig
from tests.conftest import NS, make_keys, put_blocks

# tenant -> (blocks per prompt, first token of its documents); beta's 4,800-token prompts overflow 1 MiB of DRAM
TENANTS = {"acme": (8, 0), "beta": (300, 20_000)}


@dataclass
class Tally:
    kinds: collections.Counter = field(default_factory=collections.Counter)
    requested: collections.Counter = field(default_factory=collections.Counter)   # tenant -> blocks
    hits: collections.Counter = field(default_factory=collections.Counter)        # tenant -> blocks
    hit_tiers: collections.Counter = field(default_factory=collections.Counter)   # tier name -> blocks
    evicted: int = 0
    expired: int = 0
    start: float = 0.0


def simulate(data_dir: str, clock, hours: int = 48, **log_kw) -> Tally:
    """Each hour each tenant looks up its current document (a new one every 6 hours), reads
    the hits, puts the rest; GC runs every 12 hours with a 10-hour TTL; the log is flushed
    on the hour, so with rotate_s=3600 every hour makes one file."""
    log = ParquetEventLog(f"{data_dir}/events", clock=clock, tick_s=3600, **log_kw)
    cfg = StoreConfig(data_dir, dram=DramConfig(capacity_bytes=1 << 20, page_bytes=1 << 20, prefault=False),
                      nvme=NvmeConfig(segment_bytes=1 << 20),
                      retention=RetentionPolicy(RetentionRule(ttl_s=10 * 3600)))
    store = BlockStore(cfg, clock=clock, events=log)
    store.register_namespace(NS)
    t, gc = Tally(start=clock()), Collector(store, batch=100_000)
    for hour in range(hours):
        for tenant, (n, first) in TENANTS.items():
            _serve_prompt(store, t, tenant, make_keys(n, start=first + (hour // 6) * 2_000))
        if hour % 12 == 11:
            store.flush()  # access times reach the index before GC judges expiry
            expired = gc.step().expired
            t.expired += expired
            t.kinds["expire"] += expired > 0  # one event per GC step that expired anything
        clock.advance(hours=1)
        log.flush()
    t.evicted = store.stats_counters["evictions_dram"]
    store.close()
    log.close()
    return t


def _serve_prompt(store: BlockStore, t: Tally, tenant: str, keys: list[bytes]) -> None:
    r = store.lookup(keys, tenant=tenant)
    t.kinds["lookup"] += 1
    t.requested[tenant] += len(keys)
    t.hits[tenant] += r.num_hits
    for tier in r.tiers:
        t.hit_tiers[Tier(tier).name.lower()] += 1
    if r.num_hits:
        store.get_many(keys[: r.num_hits])
        t.kinds["get"] += 1
    if put_blocks(store, keys[r.num_hits:], tenant=tenant).stored:
        t.kinds["put"] += 1
