"""Store statistics: live (from an open store) or offline (from a data directory).

Offline stats read the index read-only and report the tiers as configured: the capacities
the daemon would use with that config, and the DRAM tier with its contents unknown (-1),
since they live in the daemon's memory, not in the directory."""

from __future__ import annotations

import os

from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.index import Index
from kvcache.kvstore.types import UNKNOWN, StoreStats, Tier, TierStats
from kvcache.tiering.segment import parse_segment_name

AGE_BUCKETS_H = (1, 6, 24, 72, 168)


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


def offline_stats(data_dir: str, now: float, deep: bool = True, config: StoreConfig | None = None) -> StoreStats:
    """Stats without opening the store for writing (works while a daemon holds it). `config`
    gives the tiers' capacities (default: the built-in defaults, as `kvcache serve` uses)."""
    index_dir = os.path.join(data_dir, "index")
    if not os.path.exists(os.path.join(index_dir, "data.mdb")):
        raise FileNotFoundError(f"{data_dir} holds no kvcache index (expected {index_dir}/data.mdb)")
    config = config or StoreConfig(data_dir)
    index = Index(index_dir, readonly=True)
    try:
        seg = index.segments()
        files, disk = _segment_files(os.path.join(data_dir, "nvme"))
        pinned, hist = _scan_index(index, now) if deep else (0, {})
        return StoreStats(
            data_dir=data_dir, index_blocks=index.count(), namespaces=len(index.namespaces()),
            tiers=_configured_tiers(config, data_dir, sum(s.live_blocks for s in seg.values()), disk),
            counters={}, persistent_counters=index.counters(), pinned_blocks=pinned, age_histogram=hist,
            segments=len(files), live_bytes=sum(s.live_bytes for s in seg.values()), offline=True,
        )
    finally:
        index.close()


def _segment_files(nvme_dir: str) -> tuple[list[str], int]:
    files = [n for n in (os.listdir(nvme_dir) if os.path.isdir(nvme_dir) else []) if parse_segment_name(n)]
    return files, sum(os.path.getsize(os.path.join(nvme_dir, n)) for n in files)


def _scan_index(index: Index, now: float) -> tuple[int, dict[str, int]]:
    """Pinned blocks and the idle-time histogram: one pass over every entry."""
    hist = {f"<{h}h": 0 for h in AGE_BUCKETS_H} | {f">={AGE_BUCKETS_H[-1]}h": 0}
    pinned = 0
    for _, meta in index.iter_all():
        pinned += meta.is_pinned(now)
        idle_h = (now - max(meta.last_access, meta.created)) / 3600
        hist[next((f"<{h}h" for h in AGE_BUCKETS_H if idle_h < h), f">={AGE_BUCKETS_H[-1]}h")] += 1
    return pinned, hist


def _configured_tiers(config: StoreConfig, data_dir: str, nvme_blocks: int, nvme_disk: int) -> list[TierStats]:
    """The tiers as a store opened with `config` reports them (collect_stats)."""
    tiers = []
    if config.dram is not None:
        tiers.append(TierStats(Tier.DRAM.label, UNKNOWN, UNKNOWN, config.dram.capacity_bytes))
    if config.nvme is not None:
        tiers.append(TierStats(Tier.NVME.label, nvme_blocks, nvme_disk,
                               _nvme_bound(config.nvme.capacity_bytes, data_dir, nvme_disk)))
    return tiers


def _nvme_bound(configured: int, data_dir: str, disk: int) -> int:
    """NvmeTier.capacity_bytes from outside: the configured bound, or less when the filesystem
    cannot hold that much."""
    nvme_dir = os.path.join(data_dir, "nvme")
    try:
        st = os.statvfs(nvme_dir if os.path.isdir(nvme_dir) else data_dir)
    except OSError:
        return configured
    return max(0, min(configured, disk + st.f_bavail * st.f_frsize))
