"""The write half of BlockStore: put, write-back demotion, making room, flush.

Put, write-through (the default; durable when nvme.fsync = "always"):
    validate ──> NVMe append + fsync ──> index commit ──> copy into DRAM (clean) ──> acknowledged
Put, write-back:
    validate ──> copy into DRAM (dirty) ──> acknowledged (not durable)
                 DRAM eviction or flush() ──> NVMe append + fsync ──> index commit

Validation runs under the store lock, so two puts of one block never both insert it.
A mixin only to keep each file readable: it uses BlockStore's state (config, tiers, index,
`_dram_meta`, `_lock`, counters, the collector it was handed) and is not meant to be used on its own.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Sequence

from kvcache.kvstore.block_format import check_layout
from kvcache.kvstore.errors import BlockFormatError, TierFullError
from kvcache.kvstore.types import BlockMeta, PutItem, PutResult, Tier
from kvcache.tiering.base import BlockWrite, Placement
from kvcache.tiering.dram_eviction import EvictedBlock
from kvcache.kvstore.events import Event

log = logging.getLogger(__name__)


class StoreWrites:
    def put(self, key: bytes, payload, namespace_id: bytes, layout=None, tenant: str = "",
            ttl_s: float | None = None) -> PutResult:
        return self.put_many([PutItem(key, payload, namespace_id, layout, tenant, ttl_s)])

    def put_many(self, items: Sequence[PutItem]) -> PutResult:
        now, t0 = self.clock(), time.perf_counter()
        with self._lock:  # validation included: two puts of one block must not both insert it
            writes, metas = self._validate(items, now)
            present = len(items) - len(writes)
            if not writes:
                return PutResult(0, present, durable=self._durable())
            if self.config.write_policy == "write-back" or self.nvme is None:
                durable = self._put_dram_only(writes, metas)
            else:
                self._put_through(writes, metas)
                durable = self._durable()
        self.stats_counters["puts"] += len(writes)
        self._event("put", metas[0], metas[0].tenant, len(writes), [], time.perf_counter() - t0,
                    sum(w.payload.nbytes for w in writes))
        return PutResult(len(writes), present, durable)

    def reserve_payload(self, nbytes: int) -> memoryview | None:
        """Free DRAM for a payload about to be received (the daemon's bulk upload): receive into
        the view, put it as a PutItem's payload, and the DRAM tier adopts the bytes instead of
        copying them. None when there is no DRAM tier or no free chunk (receive elsewhere).
        Whatever is not adopted (a duplicate, a failed put) must go back with release_payloads."""
        return None if self.dram is None else self.dram.reserve(nbytes)

    def release_payloads(self, views) -> None:
        if self.dram is not None and views:
            self.dram.unreserve(views)

    def _validate(self, items: Sequence[PutItem], now: float) -> tuple[list[BlockWrite], list[BlockMeta]]:
        """Reject bad input before any I/O; drop blocks the store already holds (content-addressed)."""
        checked, key_bytes = [], {}          # namespace id -> its key length (a batch has one or few)
        for item in items:
            want = key_bytes.get(item.namespace_id)
            if want is None:
                want = key_bytes[item.namespace_id] = self._namespace(item.namespace_id).algo.digest_size
            if len(item.key) != want:
                ns = self._namespace(item.namespace_id)
                raise BlockFormatError(f"block key is {len(item.key)} bytes; namespace {ns.name or ns.id.hex()} "
                                       f"uses {ns.algo.value} ({want}-byte keys)")
            if item.ttl_s is not None and not 0 < item.ttl_s < math.inf:      # inf: kept past every retention
                raise BlockFormatError(f"a block's ttl_s must be positive and finite, got {item.ttl_s}")
            payload = memoryview(item.payload).cast("B")
            checked.append((item, payload, check_layout(item.layout, payload.nbytes)))
        writes, metas, seen = [], [], set()
        for (item, payload, layout), existing in zip(checked, self._metas([i.key for i in items])):
            if existing is not None or item.key in seen:
                continue
            seen.add(item.key)
            writes.append(BlockWrite(item.key, item.namespace_id, payload, layout, now, item.tenant))
            metas.append(BlockMeta(item.namespace_id, payload.nbytes, Tier.NONE, now, now, 0, 0, 0.0,
                                   now + item.ttl_s if item.ttl_s else 0.0, 0, 0, 0, item.tenant))
        return writes, metas

    def _durable(self) -> bool:
        return (self.nvme is not None and self.config.write_policy == "write-through"
                and self.config.nvme.fsync == "always")

    def _put_through(self, writes: list[BlockWrite], metas: list[BlockMeta]) -> None:
        if self.nvme.is_over_watermark():
            self._make_room()
        placements = self.nvme.put(writes)
        self._commit_nvme(writes, metas, placements)
        cached = self._admitted(writes)
        if self.dram is not None and cached:
            try:
                self.dram.put(cached)
            except (TierFullError, ValueError) as e:
                log.debug("write-through blocks not cached in DRAM: %s", e)
                cached = []
            self._publish([w.key for w in writes], metas, self.clock())   # those not in DRAM are skipped
        if self.dram is not None and len(cached) < len(writes):
            self.dram.drop_resized(writes)      # what the DRAM put did not reach may hold an older size

    def _admitted(self, writes: list[BlockWrite]) -> list[BlockWrite]:
        """DRAM admission of write-through puts: all, or ("second-hit") only keys refused before;
        the refused are remembered in a bounded set (a block read later is promoted regardless)."""
        if self.dram is None or self.config.dram.admission == "always":
            return writes
        ghost, cap, out = self._dram_ghost, self.config.dram.admission_memory, []
        for w in writes:
            if ghost.pop(w.key, None) is not None:
                out.append(w)
            else:
                ghost[w.key] = None
                if len(ghost) > cap:
                    ghost.popitem(last=False)
        self.stats_counters["dram_admission_refused"] += len(writes) - len(out)
        return out

    def _commit_nvme(self, writes, metas, placements: list[Placement]) -> None:
        puts, new_segments = {}, set()
        for w, meta, p in zip(writes, metas, placements):
            meta.residency = Tier.NVME
            meta.segment_id, meta.offset, meta.record_len = p.segment_id, p.offset, p.record_len
            puts[w.key] = meta
            new_segments.add(p.segment_id)
        self.index.commit(puts, new_segments=new_segments)
        if self.object is not None:  # copied into the upload queue; landed packs are committed later
            self.object.enqueue(writes)

    def _put_dram_only(self, writes: list[BlockWrite], metas: list[BlockMeta]) -> bool:
        dirty = self.nvme is not None
        for w, meta in zip(writes, metas):
            meta.residency = Tier.DRAM
            self._dram_meta[w.key] = meta           # before the put: a demotion inside it needs them
        evictions = self.dram.evictions
        try:
            self.dram.put(writes, dirty=dirty)
        except (TierFullError, ValueError):
            self._keep_dram_metas(writes, metas)
            if not dirty:
                raise
            self._put_through(writes, metas)  # no room in DRAM: go straight to NVMe
            keys = [w.key for w in writes]
            self.dram.mark_clean(keys)        # those that reached DRAM are on NVMe too now
            for k in keys:
                self._dram_meta.pop(k, None)
            return self._durable()
        if self.dram.evictions != evictions:
            self._keep_dram_metas(writes, metas)
        self._publish([w.key for w in writes], metas, self.clock())
        return False

    def _keep_dram_metas(self, writes: list[BlockWrite], metas: list[BlockMeta]) -> None:
        """After a put that evicted or failed: the metadata of the batch's blocks DRAM holds is
        this put's, the others' is gone. A block whose older, clean copy the put evicted before
        inserting it again lost its metadata with that copy (`_on_dram_evict`); one the put
        inserted and then evicted was demoted (its metadata is the index's) or dropped."""
        held, dram_meta = self.dram.contains, self._dram_meta
        for w, meta in zip(writes, metas):
            if held(w.key):
                dram_meta[w.key] = meta
            else:
                dram_meta.pop(w.key, None)

    def _drop_dram_copies(self, keys: list[bytes]) -> None:
        """Drop the DRAM copies of blocks whose index entries were just deleted (expired, evicted,
        damaged), under the store lock. A key with DRAM-only metadata is kept: its copy is a newer
        write-back put of the block (put again once the old entry had expired), not yet on NVMe."""
        if self.dram is not None:
            for k in keys:
                if k not in self._dram_meta:
                    self.dram.delete(k)

    def _make_room(self) -> None:
        """The NVMe tier is over its high watermark: the collector handed to the store evicts.
        A store without one has nothing to evict with, and the put goes on (see kvstore/store.py)."""
        if self._collector is None:
            if not self._warned_no_collector:
                self._warned_no_collector = True
                log.warning("NVMe tier at %s is over its high watermark and this store has no collector: "
                            "nothing is evicted (open it with maintenance=kvcache.gc.collector.Collector)",
                            self.nvme.root)
            return
        rep = self._collector.make_room()
        self.stats_counters["evictions_nvme"] += rep.evicted

    def _on_dram_evict(self, evicted: list[EvictedBlock]) -> None:
        """Called by the DRAM tier (under the store lock) before evicted chunks are reused."""
        dirty = [e for e in evicted if e.dirty]
        if self.nvme is None:
            # without NVMe each block's only metadata goes with it. With NVMe only dirty copies have
            # DRAM-only metadata; if a clean copy's key has some, it is a newer put's, which is
            # about to insert the block again: keep it
            for e in evicted:
                if self._dram_meta.pop(e.key, None) is not None:
                    self.stats_counters["evictions_dram_dropped"] += 1
        self.stats_counters["evictions_dram"] += len(evicted)
        now = self.clock()
        if self._events_on:
                self.events.record(Event(now, "evict", tier="dram", blocks=len(evicted),
                                     nbytes=sum(e.write.payload.nbytes for e in evicted),
                                     mean_age_s=sum(now - e.write.created for e in evicted) / len(evicted)))
        if dirty:
            self._demote([e.write for e in dirty])

    def _demote(self, writes: list[BlockWrite], flushing: bool = False) -> None:
        """Write dirty DRAM blocks back to NVMe. Evicting (their chunks are about to be reused), a
        failure loses them from the cache: counted, never served wrong. Flushing, it raises and
        keeps them in DRAM, dirty and readable, for the next flush to retry: a flush that returns
        means durable."""
        metas = [self._dram_meta[w.key] for w in writes]
        try:
            placements = self.nvme.put(writes)
            self._commit_nvme(writes, metas, placements)
            self.stats_counters["demotions"] += len(writes)
        except Exception:
            self.stats_counters["demotions_failed"] += len(writes)
            if flushing:
                raise
            log.exception("write-back of %d blocks to NVMe failed; they are lost from the cache", len(writes))
        for w in writes:
            self._dram_meta.pop(w.key, None)

    def flush(self) -> None:
        """Make everything acknowledged so far durable: dirty DRAM blocks, access times, fsyncs."""
        with self._lock:
            if self.dram is not None and self.nvme is not None:
                with self.dram.leased_dirty() as writes:
                    if writes:
                        self._demote(writes, flushing=True)
                        self.dram.mark_clean([w.key for w in writes])
            if self.nvme is not None:
                self.nvme.sync()
            if self.object is not None:
                self.object.flush()
            self.index.flush_touches()
            self.index.sync()

