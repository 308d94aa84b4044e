"""Store statistics: live (from an open store) or offline (from a data directory)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from kvcache.kvstore.index import Index
from kvcache.kvstore.types import Tier
from kvcache.tiering.segment import parse_segment_name

AGE_BUCKETS_H = (1, 6, 24, 72, 168)


@dataclass
class TierStats:
    tier: str
    blocks: int
    used_bytes: int
    capacity_bytes: int


@dataclass
class StoreStats:
    data_dir: str
    index_blocks: int
    namespaces: int
    tiers: list[TierStats]
    counters: dict[str, int]
    persistent_counters: dict[str, int]
    pinned_blocks: int = 0
    age_histogram: dict[str, int] = field(default_factory=dict)
    segments: int = 0
    live_bytes: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def collect_stats(store) -> StoreStats:
    tiers = []
    if store.dram is not None:
        u = store.dram.usage()
        tiers.append(TierStats("dram", u.blocks, u.used_bytes, u.capacity_bytes))
    seg = store.index.segments()
    if store.nvme is not None:
        live = sum(s.live_blocks for s in seg.values())
        # the effective bound: less than configured when the filesystem holds less
        tiers.append(TierStats("nvme", live, store.nvme.disk_bytes(), store.nvme.capacity_bytes()))
    return StoreStats(
        data_dir=store.config.data_dir, index_blocks=store.index.count(), namespaces=len(store.namespaces),
        tiers=tiers, counters=dict(store.stats_counters), persistent_counters=store.index.counters(),
        segments=len(seg), live_bytes=sum(s.live_bytes for s in seg.values()),
    )


def offline_stats(data_dir: str, now: float, deep: bool = True) -> StoreStats:
    """Stats without opening the store for writing (works while a daemon holds it)."""
    index_dir = os.path.join(data_dir, "index")
    if not os.path.exists(os.path.join(index_dir, "data.mdb")):
        raise FileNotFoundError(f"{data_dir} holds no kvcache index (expected {index_dir}/data.mdb)")
    index = Index(index_dir, readonly=True)
    try:
        seg = index.segments()
        nvme_dir = os.path.join(data_dir, "nvme")
        files = [n for n in (os.listdir(nvme_dir) if os.path.isdir(nvme_dir) else []) if parse_segment_name(n)]
        disk = sum(os.path.getsize(os.path.join(nvme_dir, n)) for n in files)
        hist: dict[str, int] = {}
        pinned = 0
        if deep:
            hist = {f"<{h}h": 0 for h in AGE_BUCKETS_H} | {f">={AGE_BUCKETS_H[-1]}h": 0}
            for _, meta in index.iter_all():
                pinned += meta.is_pinned(now)
                idle_h = (now - max(meta.last_access, meta.created)) / 3600
                label = next((f"<{h}h" for h in AGE_BUCKETS_H if idle_h < h), f">={AGE_BUCKETS_H[-1]}h")
                hist[label] += 1
        live_blocks = sum(s.live_blocks for s in seg.values())
        return StoreStats(
            data_dir=data_dir, index_blocks=index.count(), namespaces=len(index.namespaces()),
            tiers=[TierStats(Tier.NVME.label, live_blocks, disk, 0)], counters={},
            persistent_counters=index.counters(), pinned_blocks=pinned, age_histogram=hist,
            segments=len(files), live_bytes=sum(s.live_bytes for s in seg.values()),
        )
    finally:
        index.close()
