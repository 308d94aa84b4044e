"""NVMe capacity by segment: the oldest sealed segments give up their cold blocks, then go.

    disk over the high watermark (segment files, dead bytes included)
      └─> T = the recency below which the share of blocks to drop lies (a sample of the
          index: the blocks a plain LRU would evict)
          oldest sealed segment first, until the disk is under the low watermark:
              unpinned blocks with recency < T ──> evicted (one index commit)
              (at least MIN_EVICTED of the segment's live bytes, coldest first)
              the others (read lately, pinned) ──> copied to the active segment
              the segment ──> unlinked: its whole size back

Recency is max(last access, created), as sampled LRU has it. Sampled LRU ("sampled-lru")
evicts blocks scattered over every segment; their room comes back only when a segment is
compacted, and on a full tier the sparsest segment is still mostly live: each put then copies
most of a segment to free a few blocks (on the Mooncake replay, 0.49 s of copying per 16 MiB
segment freed, three quarters of the replay's time). Here a dropped segment frees all of its
cold share, and what is copied is what LRU would keep. Nothing is kept beside the index: the
order is rebuilt from it after a restart.
"""

from __future__ import annotations

import math
import random
from typing import Callable

from kvcache.kvstore.types import BlockMeta, Tier
from kvcache.tiering.segment import ScannedRecord, scan

MIN_EVICTED = 0.25     # of a processed segment's live bytes: a segment of hot blocks still frees room
SAMPLE = 512           # index entries behind the threshold
MAX_SEGMENTS = 8       # per call: a put's wait is bounded


def recency(m: BlockMeta) -> float:
    return max(m.last_access, m.created)


def cold_threshold(index, rng, share: float, n: int = SAMPLE) -> float:
    """The recency below which `share` of the NVMe blocks lie, from `n` samples of the index."""
    rs = sorted(recency(m) for _, m in index.sample(n, rng) if Tier.NVME in m.residency)
    if not rs:
        return -math.inf
    return rs[min(len(rs) - 1, int(share * len(rs)))]


def evict_cold(store, sid: int, threshold: float, now: float) -> tuple[int, int]:
    """Evict segment `sid`'s unpinned live blocks colder than `threshold` (and the coldest of
    the others until MIN_EVICTED of its live bytes are gone): (bytes, blocks) evicted. A block
    with an object-tier copy loses only its NVMe copy."""
    records = [item for item in scan(store.nvme.path(sid), verify_payloads=False)
               if isinstance(item, ScannedRecord) and not item.header.is_tombstone]
    with store._lock:
        metas = store.index.get_many([item.header.key for item in records])
        live = [(item.header.key, m) for item, m in zip(records, metas)
                if m is not None and Tier.NVME in m.residency and (m.segment_id, m.offset) == (sid, item.offset)]
        floor = MIN_EVICTED * sum(m.record_len for _, m in live)
        freed, updates, deletes = 0, {}, []
        for key, m in sorted((km for km in live if not km[1].is_pinned(now)), key=lambda km: recency(km[1])):
            if recency(m) >= threshold and freed >= floor:
                break
            freed += m.record_len
            if store.index.object_location(key) is not None:
                m.residency &= ~Tier.NVME
                updates[key] = m
            else:
                deletes.append(key)
        n = len(updates) + len(deletes)
        if n:
            store.index.commit(updates, deletes=deletes, counters={"evicted_nvme": n})
        store._drop_dram_copies(deletes)
    return freed, n


def evict_segments(store, rng: random.Random, drop: Callable[[int, int], None]) -> None:
    """Over the high watermark, the oldest sealed segments lose their cold blocks and `drop`
    (segment id, blocks evicted) copies the rest forward and unlinks each, until the segment
    files are under the low watermark (at most MAX_SEGMENTS a call)."""
    nvme, cfg = store.nvme, store.nvme.config
    capacity = nvme.capacity_bytes()
    if nvme.disk_bytes() <= cfg.high_watermark * capacity:
        return
    target, now = cfg.low_watermark * capacity, store.clock()
    live = sum(u.live_bytes for u in store.index.segments().values())
    threshold = cold_threshold(store.index, rng, (nvme.disk_bytes() - target) / max(1, live))
    for sid in sorted(s for s in nvme.segment_ids() if s < nvme.active_segment)[:MAX_SEGMENTS]:
        if nvme.disk_bytes() <= target:
            return
        drop(sid, evict_cold(store, sid, threshold, now)[1])
