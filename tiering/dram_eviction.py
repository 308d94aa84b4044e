"""DRAM eviction: which blocks leave the arena to make room, and when their chunks are freed.

    put needs a chunk ──> a free chunk of its size class (or a larger one: tiering/slab.py)
                      └─> none: evict one of the first victims whose chunk fits (same class first)
                          └─> none: evict victims in batches until a page empties
    after each put: above the high watermark, evict victims down to the low one

The victims come from the tier's eviction order (kvcache/policy: `victims()`, first to go
first); which order is `dram.eviction`. Pinned blocks (hard or soft) and leased ones (a reader
holds them) are skipped, which the order counts as a use of them. An evicted
block is unlinked at once (and leaves the read directory), but its chunk is freed only after
`on_evict` has seen it: dirty blocks are demoted to NVMe from the arena before it is reused.

`DramEviction` is a mixin of `DramTier` (tiering/dram.py), whose lock the caller holds and
which provides `_entries`, `_order`, `_hits`, `_slab`, `_mv`, `_clock`, `_on_evict`,
`_doomed_offsets` and `_unpublish`; it is not meant to be used on its own.

Reads reach the order in batches (`_hit`: `hit_many` costs a fraction of a `hit` per key);
`_ordered()` tells it every read recorded so far before anything else asks or tells it anything,
so it evicts what it would have evicted had each read been told at once.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

from kvcache.kvstore.errors import TierFullError
from kvcache.policy import EvictionOrder
from kvcache.tiering.base import BlockWrite

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EvictedBlock:
    key: bytes
    dirty: bool
    write: BlockWrite  # payload is a view into the arena, valid only during on_evict


EvictCallback = Callable[[list[EvictedBlock]], None]


def _evictable(e, now: float) -> bool:
    """A DRAM entry may be evicted at `now`: no reader holds a lease on it and it is not pinned."""
    return not (e.leases or e.pins or e.pin_until > now)


class DramEviction:
    MAX_EVICT_PER_ALLOC = 256
    HIT_BATCH = 64                # reads recorded before the order is told of them

    def _hit(self, keys: Sequence[bytes]) -> None:
        """Record reads (under the lock); the order hears of them in batches (`hit_many` costs a
        fraction of a `hit` per key), at the latest before it is asked or told anything else."""
        hits = self._hits
        hits.extend(keys)
        if len(hits) >= self.HIT_BATCH:
            self._order.hit_many(hits)
            hits.clear()

    def _ordered(self) -> EvictionOrder:
        """The eviction order with every read recorded so far told to it, in order (under the
        lock): what it then says is what it would say had each read been told at once."""
        if self._hits:
            self._order.hit_many(self._hits)
            self._hits.clear()
        return self._order

    def _alloc(self, nbytes: int, evicted: list[EvictedBlock]) -> int:
        """A chunk for `nbytes`, evicting if needed: first one of the order's first victims whose
        chunk this one fits in (of its own size class if there is one: one eviction then
        suffices), else the victims in small batches until a page empties.

        Evicted chunks are freed only after `on_evict` has demoted them, so a batch is
        finished before each retry. At most MAX_EVICT_PER_ALLOC blocks go for one put.
        """
        off = self._slab.alloc(nbytes)
        now = self._clock() if off is None else 0.0     # one clock read for all the candidates
        if off is None:
            off = self._evict_fitting(nbytes, evicted, now)
        candidates = self._ordered().victims() if off is None else iter(())
        budget, freed = self.MAX_EVICT_PER_ALLOC, 0
        while off is None and budget > 0:
            key = next(candidates, None)
            if key is None:
                break
            freed += self._evict_one(key, evicted, now)
            budget -= 1
            if freed >= nbytes:
                self._finish_evictions(evicted)
                off, freed = self._slab.alloc(nbytes), 0
        if off is None:
            self._finish_evictions(evicted)
            off = self._slab.alloc(nbytes)
        if off is None:
            raise TierFullError(f"DRAM tier cannot fit a {nbytes}-byte block: the blocks left are pinned or "
                                "being read; unpin blocks or raise dram.capacity_bytes")
        return off

    def _evict_fitting(self, nbytes: int, evicted: list[EvictedBlock], now: float) -> int | None:
        """Evict one of the first victims whose chunk would hold `nbytes` and allocate there.
        Evicting victims of any class until a whole page empties would cost a small arena of
        mixed sizes most of its blocks for each block of a new size. The victims of other
        classes this passes over count as used (the order's skip rule); with one block size,
        as one model gives, the first evictable victim fits."""
        need, window = self._slab.chunk_size(nbytes), min(self.MAX_EVICT_PER_ALLOC, len(self._entries))
        larger = None
        for key in itertools.islice(self._ordered().victims(), window):
            e = self._entries[key]
            if not _evictable(e, now):
                continue
            chunk = self._slab.chunk_at(e.offset)
            if chunk == need:
                self._evict_one(key, evicted, now)
                break
            if chunk > need and larger is None:
                larger = key
        else:
            if larger is None or not self._evict_one(larger, evicted, now):
                return None
        self._finish_evictions(evicted)
        return self._slab.alloc(nbytes)

    def _evict_to_watermark(self, evicted: list[EvictedBlock]) -> None:
        cap = self._slab.capacity
        if self._slab.used_bytes <= self.config.high_watermark * cap:
            return
        used, now = self._slab.used_bytes, self._clock()
        for key in itertools.islice(self._ordered().victims(), len(self._entries)):   # one pass at most
            used -= self._evict_one(key, evicted, now)
            if used <= self.config.low_watermark * cap:
                break

    def _evict_one(self, key: bytes, evicted: list[EvictedBlock], now: float) -> int:
        """Unlink one block unless it is pinned or being read at `now`; its chunk is freed by
        _finish_evictions, after demotion read it."""
        e = self._entries.get(key)
        if e is None or not _evictable(e, now):
            return 0
        del self._entries[key]
        self._ordered().remove(key)
        self._unpublish(key)
        write = BlockWrite(key, e.namespace_id, self._mv[e.offset: e.offset + e.nbytes], e.layout, e.created,
                               e.tenant)
        evicted.append(EvictedBlock(key, e.dirty, write))
        self._doomed_offsets.append(e.offset)
        self.evictions += 1
        return self._slab.chunk_at(e.offset)

    def _finish_evictions(self, evicted: list[EvictedBlock]) -> None:
        if evicted and self._on_evict is not None:
            try:
                self._on_evict(list(evicted))
            except Exception:  # demotion failure must not fail the put that caused it
                log.exception("demoting %d evicted DRAM blocks failed; they are dropped", len(evicted))
        for off in self._doomed_offsets:
            self._slab.free(off)
        self._doomed_offsets.clear()
        evicted.clear()
