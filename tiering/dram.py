"""The DRAM tier: block payloads in one preallocated host arena.

    put ──> slab chunk in the arena ──> eviction order (kvcache/policy: LRU, S3-FIFO, duel...)
                                           │ fill > high watermark, or no free chunk
                                           v
                        evict its victims (skipping pinned and leased blocks)
                        └─> on_evict(dirty blocks): the store demotes them to NVMe
                            *before* their chunk is reused (write-back)
    (the eviction policy: dram_eviction.py)

Landings (dram_landings.py): the daemon's bulk upload receives payloads straight into free
chunks, and put() adopts them instead of copying.

The read directory (kvstore/shm_directory.py), when the arena is shared: publish() enters
blocks with their place; unlinking a block (evict, delete, unpin) removes its entry, under
the lock, before its chunk can be freed, so local clients that copy without a lease can
tell a reused chunk from the block.

Reads are zero-copy: `view(key)` leases the chunk (it cannot be evicted or reused while the
lease is held) and yields a memoryview into the arena; `get_into` copies straight from the
arena into the caller's buffer (one memcpy: blocks up to COPY_UNDER_LOCK under the lock, which
costs no concurrency because the copy holds the GIL anyway; larger ones leased, no lock held).
When an accelerator is present the arena is page-locked so host->device copies run at
full speed; on a CPU-only torch pinning raises, so it is off unless CUDA is available.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from kvcache.kvstore.shm_directory import Directory, table_bytes
from kvcache.kvstore.types import TensorSpec, Tier, copy_flat
from kvcache.policy import EvictionOrder, make_order
from kvcache.tiering.arena import Arena
from kvcache.tiering.base import BlockTier, BlockWrite, Placement, TierUsage
from kvcache.tiering.config import DramConfig
from kvcache.tiering.dram_eviction import DramEviction, EvictCallback, EvictedBlock
from kvcache.tiering.dram_landings import DramLandings, address
from kvcache.tiering.dram_shares import REST, SharedOrder
from kvcache.tiering.slab import SlabAllocator

log = logging.getLogger(__name__)
COPY_UNDER_LOCK = 1 << 20     # get_into copies blocks up to this with the lock held, no lease


@dataclass(slots=True)
class _Entry:
    offset: int
    nbytes: int
    namespace_id: bytes
    layout: tuple[TensorSpec, ...]
    created: float
    dirty: bool = False
    tenant: str = ""
    leases: int = 0
    pins: int = 0
    pin_until: float = 0.0
    doomed: bool = False


@functools.lru_cache(maxsize=256)
def _placed(nbytes: int) -> Placement:
    """What put returns per block (frozen, so one per size is shared)."""
    return Placement(payload_len=nbytes)


class DramTier(DramEviction, DramLandings, BlockTier):
    kind = Tier.DRAM

    def __init__(self, config: DramConfig, on_evict: EvictCallback | None = None,
                 clock: Callable[[], float] = time.time):
        self.config = config
        self._clock = clock
        self._slab = SlabAllocator(config.capacity_bytes, config.page_bytes)
        if self._slab.num_pages < 8:
            log.warning("dram.capacity_bytes %d holds %d slab pages of %d bytes: blocks of several sizes then "
                        "crowd each other out (each size class takes whole pages); lower dram.page_bytes "
                        "(to the largest block size) or raise dram.capacity_bytes", config.capacity_bytes,
                        self._slab.num_pages, config.page_bytes)
        self.arena = Arena(self._slab.capacity, shared=bool(config.shared_memory), prefault=config.prefault,
                           pin_memory=config.pin_memory)
        self.pinned = self.arena.pinned
        self.directory_arena = self.directory = None
        if self.arena.shared and config.read_directory:
            self.directory_arena = Arena(table_bytes(self._slab.capacity), shared=True)
            self.directory = Directory(self.directory_arena.view)
        self._mv = self.arena.view
        self._entries: dict[bytes, _Entry] = {}
        self._order = self._new_order()   # which entry goes first: told every put, read and removal
        self._hits: list[bytes] = []      # reads not yet told to the order (see _ordered)
        self._learns = any(type(o).begin is not EvictionOrder.begin            # else begin() costs no lock
                           for o in getattr(self._order, "orders", {"": self._order}).values())
        self._lock = threading.Lock()
        self._on_evict = on_evict
        self._doomed_offsets: list[int] = []
        self._warned_span = False             # blocks larger than a page: said once
        self.evictions = 0
        self._base = address(self.arena.buf)
        self._reserved: dict[int, int] = {}   # offset -> payload bytes of chunks set aside by reserve()
        self._reserved_bytes = 0
        self.adopted = 0                       # payloads put without a copy (they landed in a reserved chunk)
        self.max_reserved_bytes = self._slab.capacity // 8   # concurrent uploads cannot crowd out blocks

    def _new_order(self) -> EvictionOrder:
        """dram.eviction's order; with [dram.tenants], one per listed tenant and one for the rest,
        under the shares (tiering/dram_shares.py)."""
        c = self.config
        shares = c.tenant_shares()
        if not shares:
            return make_order(c.eviction, c.eviction_small_fraction, c.eviction_decay)
        orders = {t: make_order(ev, c.eviction_small_fraction, c.eviction_decay) for t, (_, ev) in shares.items()}
        orders[REST] = make_order(c.eviction, c.eviction_small_fraction, c.eviction_decay)
        fractions = {t: s for t, (s, _) in shares.items()}
        fractions[REST] = max(0.0, 1.0 - sum(fractions.values()))
        return SharedOrder(orders, fractions, self._slab.capacity, self._entries)

    # ---------------------------------------------------------------- writes
    def put(self, writes: Sequence[BlockWrite], dirty: bool = False) -> list[Placement]:
        # per block: one dict probe, one chunk, one copy, one entry, one order insert (a 64 KiB
        # copy is ~10 us here, so each Python step around it shows in the throughput)
        evicted: list[EvictedBlock] = []
        entries, mv, sizes = self._entries, self._mv, []
        shared = isinstance(self._order, SharedOrder)
        with self._lock:
            order = self._ordered()
            for w in writes:
                src = memoryview(w.payload).cast("B")
                n = src.nbytes
                sizes.append(n)
                e = entries.get(w.key)
                if e is not None and (e.nbytes == n or e.dirty and not dirty):
                    e.dirty |= dirty     # the same block, or a clean copy (a promotion of an older
                    order.hit(w.key)     # record) meeting a dirty one, a newer put not yet on NVMe
                    continue
                if e is not None:        # another size under one key: the store's metadata is the new put's
                    self._unlink(w.key, e)
                off = self._adopt(w.payload, n) if self._reserved else None
                if off is None:
                    if shared:
                        order.expect(w.tenant, n)
                    off = self._slab.alloc(n)
                    if off is None:
                        off = self._alloc(n, evicted)
                    mv[off: off + n] = src
                entries[w.key] = _Entry(off, n, w.namespace_id, w.layout, w.created, dirty, w.tenant)
                order.insert(w.key)
            self._evict_to_watermark(evicted)
            self._finish_evictions(evicted)
        if self._slab.spans and not self._warned_span:
            self._warn_span(max(sizes, default=0))
        return [_placed(n) for n in sizes]

    def _warn_span(self, nbytes: int) -> None:
        self._warned_span, page = True, self._slab.page_bytes
        pages = -(-nbytes // page)
        log.warning("a %d-byte block takes %d pages of %d bytes in DRAM (%.0f %% of it unused); set "
                    "dram.page_bytes (page_mib) to at least the largest block size", nbytes, pages, page,
                    100 * (1 - nbytes / (pages * page)))

    # ---------------------------------------------------------------- reads
    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes, placement: Placement | None = None) -> bytes | None:
        with self.view(key) as mv:
            return None if mv is None else bytes(mv)

    def get_into(self, key: bytes, placement: Placement | None, out) -> int | None:
        # the single-block twin of get_many_into, kept lean: every step costs beside a 6 us copy.
        # A block up to COPY_UNDER_LOCK is copied with the lock held and no lease: the copy holds
        # the GIL throughout anyway, so no other thread of ours could run meanwhile
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return None
            self._hit((key,))
            n, off = e.nbytes, e.offset
            if n <= COPY_UNDER_LOCK:
                copy_flat(out, self._mv[off: off + n])
                return n
            e.leases += 1
        try:
            copy_flat(out, self._mv[off: off + n])
            return n
        finally:
            with self._lock:
                e.leases -= 1
                if e.doomed and e.leases == 0:
                    self._slab.free(e.offset)

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence) -> list[int | None]:
        """Copy each block into its buffer: one lock round-trip to lease them all, the
        copies with no lock held, one round-trip to release (a 64 KiB copy is ~6 us; the
        per-call Python around it must stay small)."""
        held, mv = self.acquire(keys), self._mv
        try:
            result: list[int | None] = []
            for e, out in zip(held, outs):
                if e is None:
                    result.append(None)
                    continue
                n, off = e.nbytes, e.offset
                copy_flat(out, mv[off: off + n])
                result.append(n)
            return result
        finally:
            self.release(held)

    def acquire(self, keys: Sequence[bytes]) -> list["_Entry | None"]:
        """Lease the blocks present (None for the others): until `release`, their chunks
        (`.offset`, `.nbytes` in the arena) are neither evicted nor reused. The shared-memory
        path holds these across requests while a local client copies."""
        entries = self._entries
        with self._lock:
            held = list(map(entries.get, keys))
            for e in held:
                if e is not None:
                    e.leases += 1
            self._hit(keys)       # keys not held are ignored
        return held

    def release(self, held: Sequence["_Entry | None"]) -> None:
        with self._lock:
            for e in held:
                if e is not None:
                    e.leases -= 1
                    if e.doomed and e.leases == 0:
                        self._slab.free(e.offset)

    def publish(self, keys: Sequence[bytes], valid_until: Sequence[float]) -> int:
        """Enter blocks in the read directory, each valid until its time; how many. Looked up
        under the lock: a block deleted meanwhile (even one the caller holds) is never published."""
        if self.directory is None:
            return 0
        n = 0
        with self._lock:
            for key, until in zip(keys, valid_until):
                e = self._entries.get(key)
                if e is not None:
                    self.directory.publish(key, e.offset, e.nbytes, until)
                    n += 1
        return n

    def unpublish_all(self) -> None:
        """Empty the read directory (retention changed: every entry's time may be wrong now)."""
        if self.directory is not None:
            with self._lock:
                self.directory.clear()

    def unpublish_namespace(self, namespace_id: bytes) -> int:
        """Withdraw the directory entries of one namespace's blocks (its rule got shorter: their
        times may outlive it), leaving every other namespace's; how many blocks it looked at."""
        if self.directory is None:
            return 0
        with self._lock:
            keys = [k for k, e in self._entries.items() if e.namespace_id == namespace_id]
            for k in keys:
                self.directory.remove(k)
        return len(keys)

    def touch(self, keys: Sequence[bytes]) -> list[int | None]:
        """A read that needed no lease (the directory): refresh recency; each block's size or None."""
        with self._lock:
            held = list(map(self._entries.get, keys))
            self._hit(keys)
        return [None if e is None else e.nbytes for e in held]

    def _unpublish(self, key: bytes) -> None:
        """Under the lock, before the block's chunk can be freed (the directory's safety rests on it)."""
        if self.directory is not None:
            self.directory.remove(key)

    @contextlib.contextmanager
    def view(self, key: bytes) -> Iterator[memoryview | None]:
        """Zero-copy read: a memoryview into the arena, valid inside the `with` only."""
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                e.leases += 1
                self._hit((key,))
        if e is None:
            yield None
            return
        try:
            yield self._mv[e.offset: e.offset + e.nbytes]
        finally:
            with self._lock:
                e.leases -= 1
                if e.doomed and e.leases == 0:
                    self._slab.free(e.offset)

    # ---------------------------------------------------------------- pins, delete, dirty
    def set_pin(self, key: bytes, hard_pins: int, pin_until: float) -> None:
        """Mirror the store's pin state: pinned blocks are never evicted."""
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                if hard_pins < e.pins or pin_until < e.pin_until:
                    self._unpublish(key)   # it may expire sooner now: the next read leases again
                e.pins, e.pin_until = hard_pins, pin_until

    def delete(self, key: bytes, placement: Placement | None = None) -> None:
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                self._unlink(key, e)

    def drop_resized(self, writes: Sequence[BlockWrite]) -> None:
        """Unlink the copies of `writes`' keys whose size is not the write's: left from an older
        put of the key, they would answer a read sized by the new put's metadata."""
        with self._lock:
            for w in writes:
                e = self._entries.get(w.key)
                if e is not None and e.nbytes != memoryview(w.payload).nbytes:
                    self._unlink(w.key, e)

    def _unlink(self, key: bytes, e: _Entry) -> None:
        """Unlink `key`'s entry `e` (under the lock); its chunk is freed now or by its last lease."""
        del self._entries[key]
        self._ordered().remove(key)
        self._unpublish(key)
        if e.leases:
            e.doomed = True  # freed when the last lease ends
        else:
            self._slab.free(e.offset)

    @contextlib.contextmanager
    def leased_dirty(self) -> Iterator[list[BlockWrite]]:
        """Dirty blocks as writes viewing the arena, leased (not evictable) inside the `with`."""
        with self._lock:
            held = [(k, e) for k, e in self._entries.items() if e.dirty]
            for _, e in held:
                e.leases += 1
        try:
            yield [BlockWrite(k, e.namespace_id, self._mv[e.offset: e.offset + e.nbytes], e.layout, e.created, e.tenant)
                   for k, e in held]
        finally:
            with self._lock:
                for _, e in held:
                    e.leases -= 1
                    if e.doomed and e.leases == 0:
                        self._slab.free(e.offset)

    def mark_clean(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is not None:
                    e.dirty = False

    def begin(self, keys: Sequence[bytes], tenant: str = "") -> None:
        """A request's blocks, in prefix order, before it reads them: orders that learn from
        requests (the duel scores its policies' prefix hits) see it; with tenant shares,
        only the order of `tenant`'s partition."""
        if self._learns:
            with self._lock:
                order = self._ordered()
                if isinstance(order, SharedOrder):
                    order.begin_for(tenant, keys)
                else:
                    order.begin(keys)

    def policy_state(self) -> dict:
        """What the eviction order holds (sizes), for stats and its memory bound."""
        with self._lock:
            order = self._ordered()
            return {"policy": order.name, **order.state()}

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._entries)

    def usage(self) -> TierUsage:
        return TierUsage(Tier.DRAM, len(self._entries), self._slab.used_bytes, self._slab.capacity)

    def arena_view(self) -> memoryview:
        """The arena, read-only, for readers of leased chunks (BlockStore.lease_views); release
        it (and every slice of it) before close."""
        return self._mv.toreadonly()

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._order, self._hits = self._new_order(), []
            self._reserved.clear()
            if self.directory is not None:
                self.directory.clear()
                self.directory = None
        if self.directory_arena is not None:
            self.directory_arena.close()
        if not self.arena.close():  # a caller still holds a view (e.g. a traceback): the GC frees it later
            log.warning("DRAM arena still referenced at close; it is freed when the last view goes")
