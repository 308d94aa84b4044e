"""Incremental garbage collection: bounded steps, never a stop-the-world sweep.

One `Collector.step()` does at most:
  1. expiry:      scan `batch` index entries from a cursor that walks the key space round
                  robin; delete expired ones, clear lapsed soft pins; also DRAM-only blocks
  2. capacity:    over the high watermark, by nvme.eviction: "segment-lru" drops the oldest
                  segments' cold blocks and then the segments (gc/segment_eviction.py);
                  "sampled-lru" evicts approximately-LRU victims (oldest of random samples,
                  Redis-style) while live bytes exceed it. Pinned blocks are skipped.
  3. compaction:  one sealed segment whose live fraction is below `compact_below`: copy its
                  live records forward, commit the new places, then unlink it
  4. object packs: the same for one object-tier pack (gc/pack_collector.py)
Reads never wait for GC to learn that a block expired: the store checks expiry itself.

The store is handed its collector, never imports it: `BlockStore(config, maintenance=Collector)`
(Collector is the factory: called with the store, it keeps the store's kvstore.protocol.Maintenance
contract), as the daemon, client.open_store, the CLI, benchmarks and trace replay open theirs.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass

from kvcache.gc import segment_eviction
from kvcache.gc.pack_collector import compact_one_pack
from kvcache.kvstore.errors import CorruptBlockError, TierFullError
from kvcache.kvstore.events import Event
from kvcache.kvstore.types import BlockMeta, Tier
from kvcache.tiering.base import BlockWrite, Placement
from kvcache.tiering.segment import ScannedRecord, align_up, read_head, scan

log = logging.getLogger(__name__)


@dataclass
class GcReport:
    scanned: int = 0
    expired: int = 0
    evicted: int = 0
    soft_pins_cleared: int = 0
    segments_compacted: int = 0
    segments_removed: int = 0
    packs_compacted: int = 0
    packs_removed: int = 0
    packs_vanished: int = 0    # deleted from the bucket by someone else (a lifecycle rule): copies forgotten
    bytes_reclaimed: int = 0
    wrapped: bool = False      # the expiry cursor finished a full pass of the key space

    def add(self, other: "GcReport") -> None:
        for k, v in vars(other).items():
            setattr(self, k, (getattr(self, k) or v) if isinstance(v, bool) else getattr(self, k) + v)


class Collector:
    def __init__(self, store, batch: int = 1000, sample: int = 16, seed: int = 0):
        self.store = store
        self.batch = batch
        self.sample = sample
        self._cursor: bytes | None = None
        self._dram_pos = 0             # where the next DRAM-only expiry window starts
        self._rng = random.Random(seed)

    def step(self) -> GcReport:
        r = GcReport()
        self._expire(r)
        if self.store.nvme is not None:
            self._evict(r)
            self._compact_one(r)
        if self.store.object is not None:
            compact_one_pack(self.store, r)
        return r

    def make_room(self) -> GcReport:
        """Bounded work for a put that found the NVMe tier over its watermark: evict
        approximately-LRU blocks, then compact the sparsest sealed segment even if it is
        above `compact_below` (dead bytes must go before the disk fills).

        On a disk too full to hold that segment's live records a second time, a segment's
        unpinned blocks are evicted instead, so it is dropped with (almost) nothing to copy:

            segments 60% live, free 0 ──copy──> ENOSPC: 507 on every put, deletes only add
                                                dead bytes (the store stays wedged)
            segments 60% live, free 0 ──evict its blocks──> unlink ──> a segment's room back

        The segment is the sparsest one whose pinned blocks (which stay) fit in the free space,
        checked before anything is evicted (see _full_disk_victim).
        """
        r = GcReport()
        if not self._evict(r):
            self._compact_one(r, force=True)
        return r

    def run(self, max_steps: int = 1_000_000) -> GcReport:
        """Steps until a full expiry pass is done and nothing is left to compact."""
        total = GcReport()
        for _ in range(max_steps):
            r = self.step()
            total.add(r)
            if r.wrapped and not (r.segments_compacted or r.segments_removed or r.evicted
                                  or r.packs_compacted or r.packs_removed):
                break
        return total

    # ---------------------------------------------------------------- 1. expiry
    def _expire(self, r: GcReport) -> None:
        store, now = self.store, self.store.clock()
        chunk = store.index.scan(self._cursor, self.batch)
        r.scanned = len(chunk)
        self._cursor = chunk[-1][0] if len(chunk) == self.batch else None
        r.wrapped = self._cursor is None
        expired, lapsed = [], []
        for key, meta in chunk:
            if store._expired(meta, now):
                expired.append(key)
            elif 0 < meta.soft_pin_until <= now:
                lapsed.append(key)
        with store._lock:
            # the scan ran unlocked: write back only what is still so now (a delete, a pin or a
            # compaction since then must not be undone by the scan's stale copy)
            updates = {k: m for k, m in zip(lapsed, store.index.get_many(lapsed))
                       if m is not None and 0 < m.soft_pin_until <= now}
            for m in updates.values():
                m.soft_pin_until = 0.0
            # DRAM-only blocks (write-back, not yet on NVMe): the next `batch` of them each step, so
            # expired ones behind long-lived ones are reached too (always the first batch: never)
            held = list(store._dram_meta.items())
            start = self._dram_pos if self._dram_pos < len(held) else 0
            window = held[start: start + self.batch]
            self._dram_pos = start + len(window)
            dram_expired = [k for k, m in window if store._expired(m, now)]
            for k in dram_expired:
                store._dram_meta.pop(k, None)
            still = [k for k, m in zip(expired, store.index.get_many(expired)) if m and store._expired(m, now)]
            store.index.commit(updates, deletes=still, counters={"expired": len(still) + len(dram_expired)})
            store._drop_dram_copies(still + dram_expired)
        r.expired, r.soft_pins_cleared = len(still) + len(dram_expired), len(updates)
        if still:
            gone = set(still)
            ages = [now - m.created for k, m in chunk if k in gone]
            store.events.record(Event(now, "expire", blocks=len(still), tier="nvme",
                                      mean_age_s=sum(ages) / max(1, len(ages))))

    # ---------------------------------------------------------------- 2. capacity
    def _evict(self, r: GcReport) -> bool:
        """Capacity eviction by the configured rule; whether it dropped segments itself. When
        segment-lru drops none (no sealed segment yet, a disk too full to copy), the sampled
        rule evicts: lookups miss the blocks over capacity even before their room comes back."""
        if self.store.nvme.config.eviction == "segment-lru" and self._evict_segments(r):
            return True
        self._evict_for_capacity(r)
        return False

    def _evict_segments(self, r: GcReport) -> bool:
        def drop(sid: int, evicted: int) -> None:
            r.evicted += evicted
            self._compact_one(r, force=True, sid=sid)
        removed = r.segments_removed
        segment_eviction.evict_segments(self.store, self._rng, drop)
        return r.segments_removed > removed

    def _evict_for_capacity(self, r: GcReport, max_victims: int = 10_000) -> None:
        """Free NVMe space: a victim with an object-tier copy only loses its NVMe copy."""
        store, cfg = self.store, self.store.nvme.config
        capacity = store.nvme.capacity_bytes()      # the disk's real room when that is less than configured
        live = sum(s.live_bytes for s in store.index.segments().values())
        if live <= cfg.high_watermark * capacity:
            return
        target, now, stale = cfg.low_watermark * capacity, store.clock(), 0
        while live > target and r.evicted < max_victims:
            victim = self._pick_victim(now)
            if victim is None:
                log.warning("NVMe tier over its watermark but every sampled block is pinned")
                return
            key, sampled = victim
            with store._lock:    # sampled unlocked: act on what the index holds now, if still a victim
                [meta] = store.index.get_many([key])
                if meta is None or Tier.NVME not in meta.residency or meta.is_pinned(now):
                    stale += 1
                    if stale > max_victims:
                        return
                    continue
                self._evict_locked(key, meta)
            live -= meta.record_len
            r.evicted += 1

    def _evict_locked(self, key: bytes, meta: BlockMeta) -> None:
        """Drop `key`'s NVMe copy (the caller holds the store lock and checked it is a victim)."""
        store = self.store
        if store.index.object_location(key) is not None:
            meta.residency &= ~Tier.NVME
            store.index.commit({key: meta}, counters={"evicted_nvme": 1})
        else:
            store.index.commit(deletes=[key], counters={"evicted_nvme": 1})
            store._drop_dram_copies([key])

    def _evict_segment(self, sid: int, records: list[ScannedRecord], r: GcReport) -> None:
        """Evict the unpinned live blocks of sealed segment `sid` (its scanned `records`), whatever
        their age: the disk has no room to copy them forward, and the segment is worth its whole
        size once dropped."""
        store, now, n = self.store, self.store.clock(), 0
        here = [(item.header.key, item.offset) for item in records if not item.header.is_tombstone]
        with store._lock:
            for (key, off), meta in zip(here, store.index.get_many([k for k, _ in here])):
                if _lives_at(meta, sid, off) and not meta.is_pinned(now):
                    self._evict_locked(key, meta)
                    n += 1
        r.evicted += n
        log.warning("the disk under %s has no room to compact segment %d: evicted its %d unpinned blocks "
                    "instead; free space or lower nvme.capacity_bytes", store.nvme.root, sid, n)

    def _pick_victim(self, now: float) -> tuple[bytes, BlockMeta] | None:
        cands = [(k, m) for k, m in self.store.index.sample(self.sample, self._rng)
                 if Tier.NVME in m.residency and not m.is_pinned(now)]
        return min(cands, key=lambda km: max(km[1].last_access, km[1].created), default=None)

    # ---------------------------------------------------------------- 3. compaction
    def _compact_one(self, r: GcReport, force: bool = False, sid: int | None = None) -> None:
        """Compact the sparsest sealed segment (or segment `sid`, whatever its live share)."""
        store, nvme = self.store, self.store.nvme
        usage = store.index.segments()
        ranked = self._ranked(usage) if sid is None else [(0.0, sid)]
        if not ranked:
            return
        ratio, best = ranked[0]
        u = usage.get(best)
        live = u.live_bytes if u is not None else _size(nvme.path(best))   # no usage row: assume all live
        free = nvme.free_bytes()        # -1: statvfs failed, room unknown: compact as usual
        if force and 0 <= free < live + _COPY_SLACK:
            victim = self._full_disk_victim([sid for _, sid in ranked], usage, free)
            if victim is None:
                log.info("the disk under %s is full and no sealed segment's pinned blocks fit in its free "
                         "space: nothing evicted", nvme.root)
                return
            best, records = victim
            u = usage.get(best)
            self._evict_segment(best, records, r)
            self._copy_live_or_spend_reserve(best)
        elif ratio < (0.999 if force else nvme.config.compact_below) or u is None or u.live_blocks == 0:
            self._copy_live(best)  # also carries tombstones forward, even from a segment with no live blocks
        else:
            return
        size = _size(nvme.path(best))
        if u is not None and u.live_blocks:
            r.segments_compacted += 1
        # the copies and the index entries naming them durable before the old file goes, whatever
        # the fsync policy: a power loss must not take blocks that were durable before compaction
        nvme.sync()
        store.index.sync()
        with store._lock:
            left = store.index.segments().get(best)
            if left is not None and left.live_blocks:
                log.warning("segment %d still has %d live blocks after compaction; kept", best, left.live_blocks)
                return
            store.index.commit(drop_segments=[best])
            nvme.remove_segment(best)
        r.segments_removed += 1
        r.bytes_reclaimed += size

    def _ranked(self, usage: dict) -> list[tuple[float, int]]:
        """Sealed segments as (live ratio, id), sparsest first; one without a usage row or live
        blocks ranks as empty (ties keep segment order)."""
        nvme, out = self.store.nvme, []
        for sid in nvme.segment_ids():
            if sid >= nvme.active_segment:
                continue
            size, u = _size(nvme.path(sid)), usage.get(sid)
            out.append(((u.live_bytes / size) if (u and u.live_blocks and size) else 0.0, sid))
        return sorted(out, key=lambda rs: rs[0])

    def _full_disk_victim(self, ranked: list[int], usage: dict,
                          free: int) -> tuple[int, list[ScannedRecord]] | None:
        """The segment to drop on a disk with no room to compact, and its records: the sparsest of
        the first few whose pinned blocks and tombstones (what stays once its unpinned blocks are
        evicted) fit in the free space, or in it and the delete reserve where spending that is
        allowed. Checked before anything is evicted: a mostly pinned segment would lose its other
        blocks and still not be dropped, while a segment of unpinned blocks gives its whole size.
        A segment without a readable usage row is skipped: what it holds is unknown. `free` is
        the filesystem's free bytes, as the caller read them."""
        nvme, now = self.store.nvme, self.store.clock()
        free = max(0, free)
        for sid in ranked[:_FULL_DISK_TRIES]:
            if usage.get(sid) is None:
                continue
            records = [item for item in scan(nvme.path(sid), verify_payloads=False)
                       if isinstance(item, ScannedRecord)]
            carried = self._carried_bytes(sid, records, now)
            spendable = nvme.reserve.held and _worth_the_reserve(carried, nvme.path(sid))
            if carried <= free + (nvme.reserve.nbytes if spendable else 0):
                return sid, records
        return None

    def _carried_bytes(self, sid: int, records: list[ScannedRecord], now: float) -> int:
        """What segment `sid` copies forward once its unpinned blocks are evicted: its pinned live
        blocks and (at most) its tombstones, as written in the active segment."""
        align = self.store.nvme.align
        blocks = [item for item in records if not item.header.is_tombstone]
        metas = self.store.index.get_many([item.header.key for item in blocks])
        pinned = sum(align_up(m.record_len, align) for item, m in zip(blocks, metas)
                     if _lives_at(m, sid, item.offset) and m.is_pinned(now))
        return pinned + sum(align_up(item.header.record_len, align) for item in records if item.header.is_tombstone)

    def _copy_live_or_spend_reserve(self, sid: int) -> None:
        """Copy what an emptied segment still carries (pinned blocks, tombstones) on a full disk:
        the delete reserve may pay for it when dropping the segment gives at least twice that back
        (a segment of pinned blocks gains nothing from a copy: the put gets its 507)."""
        try:
            self._copy_live(sid)
        except TierFullError:
            store = self.store
            with store._lock:
                left = store.index.segments().get(sid)
                worth = left is None or _worth_the_reserve(left.live_bytes, store.nvme.path(sid))
                if not (worth and store.nvme.reserve.release()):
                    raise
            self._copy_live(sid)

    def _copy_live(self, sid: int) -> None:
        """Copy live records and still-needed tombstones of segment `sid` to the active one."""
        store, nvme = self.store, self.store.nvme
        older = [s for s in nvme.segment_ids() if s != sid]
        oldest_other = min((_created(nvme.path(s)) for s in older), default=float("inf"))
        moved: dict[bytes, tuple[int, BlockWrite]] = {}
        tombstones: list[tuple[bytes, float]] = []
        for item in scan(nvme.path(sid), verify_payloads=False):  # nvme.get verifies what is copied
            if not isinstance(item, ScannedRecord):
                continue
            h = item.header
            if h.is_tombstone:
                # keep it while a segment it may shadow exists, unless the key was put again
                if h.created >= oldest_other and store.index.get(h.key) is None:
                    tombstones.append((h.key, h.created))
                continue
            meta = store.index.get(h.key)
            if not _lives_at(meta, sid, item.offset):
                continue
            payload = nvme.get(h.key, _placement(meta))
            if payload is not None:
                moved[h.key] = (item.offset, BlockWrite(h.key, h.namespace_id, payload, h.layout, h.created, h.tenant))
        with store._lock:
            for key, created in tombstones:
                store.index.commit(new_segments=nvme.put_tombstones([key], created))
            # re-check under the lock: a delete or a re-put may have raced the copy
            current = store.index.get_many(list(moved))
            todo = [(k, w, m) for (k, (off, w)), m in zip(moved.items(), current)
                    if _lives_at(m, sid, off)]
            if not todo:
                return
            placements = nvme.put([w for _, w, _ in todo])
            nvme.sync({p.segment_id for p in placements})   # the copies on disk before the index names them
            puts = {}
            for (key, _, m), p in zip(todo, placements):
                m.segment_id, m.offset, m.record_len = p.segment_id, p.offset, p.record_len
                puts[key] = m
            store.index.commit(puts, new_segments={p.segment_id for p in placements})


# room for the tombstones and the pinned blocks a segment emptied by eviction still carries forward
_COPY_SLACK = 1 << 20
# segments a full disk's make_room scans for one to drop (each scan reads a segment's headers)
_FULL_DISK_TRIES = 8


def _placement(meta: BlockMeta) -> Placement:
    return Placement(meta.segment_id, meta.offset, meta.record_len, meta.payload_len)


def _lives_at(m: BlockMeta | None, sid: int, off: int) -> bool:
    """The index record is still the live NVMe copy at (segment `sid`, offset `off`): not deleted,
    evicted from NVMe, re-put or already copied elsewhere."""
    return m is not None and Tier.NVME in m.residency and (m.segment_id, m.offset) == (sid, off)


def _worth_the_reserve(carried: int, path: str) -> bool:
    """Spending the delete reserve on copying `carried` bytes out of the segment at `path` is
    worth it: dropping the segment gives at least twice that back."""
    return 2 * carried <= _size(path)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def _created(path: str) -> float:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return float("inf")
    try:
        return read_head(fd).created
    except CorruptBlockError:
        return 0.0
    finally:
        os.close(fd)
