"""BlockStore: the store itself (kvstore/protocol.py's `Store`), over the tiers and the LMDB index.

    lookup(keys)    -> LookupResult: longest contiguous run of live hits, tier of each
    get / get_into / get_many, put / put_many, pin / unpin, delete, stats, flush, close

Where metadata lives:
    blocks on a persistent tier  -> the LMDB index (survives restarts)
    blocks only in DRAM          -> `_dram_meta` in memory (they die with the process anyway)

Gets, promotion and prefetch live in kvstore/reads.py (the read half); puts, write-back
demotion and flush in kvstore/writes.py (the write half); registering and renaming
namespaces in kvstore/namespaces.py; what becomes of a copy that fails verification in
kvstore/quarantine.py.

The collector is handed in, never imported (gc/ is built on kvstore): `maintenance=Collector`
(kvcache.gc.collector). With it, a put over the NVMe high watermark makes room first and
`gc_interval_s > 0` runs GC steps in a thread. A bare `BlockStore(config)` evicts nothing: such
a put goes on as if every block were pinned (warned once; a really full disk is TierFullError),
and `gc_interval_s > 0` is refused (ValueError): nothing would carry it out.

Lock order: the store lock, then the DRAM tier's lock. Every DRAM mutation (put, pin,
delete, promotion) happens under the store lock, because DRAM eviction calls back into
the store to demote. DRAM reads take only the DRAM lock, briefly.
"""

from __future__ import annotations

import collections
import itertools
import logging
import operator
import threading
import time
from typing import Callable, Iterable, Sequence

from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.events import Event, EventSink, NullSink
from kvcache.kvstore.errors import StoreError, TierFullError
from kvcache.kvstore.hashing import Namespace
from kvcache.kvstore.lockfile import lock_data_dir
from kvcache.kvstore.periodic import Periodic
from kvcache.kvstore.leases import StoreLeases
from kvcache.kvstore.namespaces import StoreNamespaces
from kvcache.kvstore.protocol import Maintenance
from kvcache.kvstore.quarantine import StoreQuarantine
from kvcache.kvstore.reads import StoreReads, has_none
from kvcache.kvstore.rebuild import open_index
from kvcache.kvstore.writes import StoreWrites
from kvcache.kvstore.types import BlockMeta, LookupResult, Tier
from kvcache.tiering.base import Placement
from kvcache.tiering.dram import DramTier
from kvcache.tiering.nvme import NvmeTier

__all__ = ["BlockStore"]
log = logging.getLogger(__name__)
MAX_PENDING_TOUCHES = 100_000
MaintenanceFactory = Callable[["BlockStore"], Maintenance]


_ACCESS_COUNT, _RESIDENCY = operator.attrgetter("access_count"), operator.attrgetter("residency")
_WITH_DRAM = {t: t | Tier.DRAM for t in map(Tier, range(8))}   # IntFlag `|` costs ~0.5 us a call


class BlockStore(StoreNamespaces, StoreReads, StoreWrites, StoreLeases, StoreQuarantine):
    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.time,
                 events: EventSink | None = None, maintenance: MaintenanceFactory | None = None):
        """`maintenance`: the collector's factory (see the module docstring); None: no GC."""
        if config.gc_interval_s > 0 and maintenance is None:
            raise ValueError(f"gc_interval_s = {config.gc_interval_s} needs a collector: open the store with "
                             "BlockStore(config, maintenance=kvcache.gc.collector.Collector)")
        self.config = config
        self.clock = clock
        self.events: EventSink = events or NullSink()
        self._events_on = not isinstance(self.events, NullSink)
        self._lock = threading.RLock()
        self._lockfile = lock_data_dir(config.data_dir)
        self.stats_counters: collections.Counter[str] = collections.Counter()
        self._dram_meta: dict[bytes, BlockMeta] = {}
        self._dram_ghost: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.index = self.nvme = self.dram = self.object = None
        try:
            self.nvme = (NvmeTier(config.nvme_dir, config.nvme, self._quarantine, clock)
                         if config.nvme else None)
            self.object = self._open_object_tier()  # no I/O yet: an index rebuild may read it
            sync = config.nvme is not None and config.nvme.fsync == "always"
            self.index = open_index(config.index_dir, self.nvme, config.index_map_bytes, sync, clock(),
                                    obj=self.object)
            self.dram = DramTier(config.dram, self._on_dram_evict, clock) if config.dram else None
            self.namespaces: dict[bytes, Namespace] = self.index.namespaces()
        except BaseException:
            for part in (self.dram, self.object, self.nvme, self.index):
                if part is not None:
                    part.close()
            self._lockfile.close()
            raise
        _warn_if_lifecycle_shorter(config)
        self._prefetcher = None
        self._prefetching: dict = {}       # key -> Future of its object -> DRAM prefetch
        self._promoter = None               # NVMe -> DRAM copies of blocks clients read from files
        self._closed = False
        # one collector for puts' make_room, another for the background steps (each its own cursor),
        # both made before a thread starts
        self._collector = maintenance(self) if maintenance is not None else None
        background = maintenance(self) if config.gc_interval_s > 0 else None
        self._warned_no_collector = False
        # access times reach the index from a thread of their own, never a reader's get
        self._threads = [Periodic("kvcache-touch", config.touch_flush_s, self.index.flush_touches)]
        if background is not None:
            self._threads.append(Periodic("kvcache-gc", config.gc_interval_s, background.step))

    # ---------------------------------------------------------------- metadata
    def _metas(self, keys: Sequence[bytes], now: float | None = None) -> list[BlockMeta | None]:
        """Live metadata per key with DRAM residency folded in; expired or unknown -> None."""
        # per key only C-level steps (map, any) on the common path, DRAM-only and young blocks:
        # beside a 64 KiB copy of a few microseconds, each Python step per key shows
        _check_keys(keys)
        now = self.clock() if now is None else now
        metas = list(map(self._dram_meta.get, keys))     # DRAM-only blocks are never in the index
        if has_none(metas):
            self._dram_held(keys, metas)
            self._index_metas(keys, metas)
            if has_none(metas):
                return [None if m is None or self._expired(m, now) else m for m in metas]
        elif not all(map(operator.is_, map(_RESIDENCY, metas), itertools.repeat(Tier.DRAM))):
            self._dram_held(keys, metas)                 # a write-back flush is committing some
        if self.config.retention.surely_live_all(metas, now):
            return metas
        return [None if self._expired(m, now) else m for m in metas]

    def _dram_held(self, keys: Sequence[bytes], metas: list[BlockMeta | None]) -> None:
        """DRAM residency folded into DRAM-only metas that lack it: a write-back flush sets a
        block's residency to NVMe before its index commit, while the block is still in DRAM
        and readers, who take no store lock, still find it here."""
        for key, meta in zip(keys, metas):
            if meta is not None and meta.residency is not Tier.DRAM:
                self._fold_dram(key, meta)

    def _fold_dram(self, key: bytes, meta: BlockMeta) -> None:
        if self.dram is not None and self.dram.contains(key):
            meta.residency = _WITH_DRAM[meta.residency]

    def _index_metas(self, keys: Sequence[bytes], metas: list[BlockMeta | None]) -> None:
        """Fill the gaps of `metas` from the index, DRAM residency folded in; a block that no tier
        holds stays None. No block has a key outside 1-64 bytes."""
        todo = [i for i, m in enumerate(metas) if m is None and 1 <= len(keys[i]) <= 64]
        for i, meta in zip(todo, self.index.get_many([keys[i] for i in todo]) if todo else ()):
            if meta is not None:
                self._fold_dram(keys[i], meta)
                if meta.residency:
                    metas[i] = meta

    def _meta(self, key: bytes, now: float) -> BlockMeta | None:
        """`_metas` of one key, without its lists (a single get's ~1 us matters beside a 64 KiB copy)."""
        if type(key) is not bytes:
            _check_keys([key])
        meta = self._dram_meta.get(key)
        if meta is None:            # not DRAM-only: the index's, DRAM residency folded in
            metas = [None]
            self._index_metas((key,), metas)
            meta = metas[0]
        elif meta.residency is not Tier.DRAM:
            self._dram_held((key,), [meta])
        return None if meta is None or self._expired(meta, now) else meta

    def _expired(self, meta: BlockMeta, now: float) -> bool:
        if self.config.retention.surely_live(meta, now):
            return False
        ns = self.namespaces.get(meta.namespace_id)
        return self.config.retention.is_expired(meta, now, ns.name if ns else "")

    def _touch(self, key: bytes, now: float) -> None:
        meta = self._dram_meta.get(key)
        if meta is not None:
            meta.last_access, meta.access_count = now, meta.access_count + 1
        else:
            self.index.touch(key, now)
            self._bound_touches()

    def _touch_many(self, keys: Sequence[bytes], now: float, metas: Sequence[BlockMeta] | None = None) -> None:
        """Count a read of each key at `now`. With `metas` (theirs, as the read found them) a batch
        of DRAM-only blocks is counted by C-level passes over them, no Python per block."""
        dram_meta = self._dram_meta
        if metas is not None and all(map(operator.is_, metas, map(dram_meta.get, keys))):
            collections.deque(map(setattr, metas, itertools.repeat("last_access"), itertools.repeat(now)), 0)
            counts = map(operator.add, map(_ACCESS_COUNT, metas), itertools.repeat(1))
            collections.deque(map(setattr, metas, itertools.repeat("access_count"), counts), 0)
            return
        in_index = []
        for key in keys:
            meta = dram_meta.get(key)
            if meta is not None:
                meta.last_access, meta.access_count = now, meta.access_count + 1
            else:
                in_index.append(key)
        self.index.touch_many(in_index, now)
        self._bound_touches()

    def _bound_touches(self) -> None:
        """Bound memory if the flusher lags: flush from the reader's thread. Best effort: a full
        index map costs access times (blocks look older), never the read that got here."""
        if self.index.pending_touches() > MAX_PENDING_TOUCHES:
            try:
                self.index.flush_touches()
            except StoreError as e:
                log.error("access times not written (%s); blocks read meanwhile may look idle", e)

    # ---------------------------------------------------------------- lookup / get
    def lookup(self, keys: Sequence[bytes], tenant: str = "", namespace_id: bytes | None = None,
               client: str = "") -> LookupResult:
        """`tenant`, `namespace_id` and `client` label the event for hit-rate reports (the namespace
        gives a lookup that misses entirely its token count; `client` is the engine that asked, the
        daemon's label of it); `tenant` also picks the DRAM eviction order that learns from the
        lookup, where [dram.tenants] gives it its own."""
        t0, tiers, first, remote = time.perf_counter(), [], None, []
        if self.dram is not None:
            self.dram.begin(keys, tenant)
        for key, meta in zip(keys, self._metas(list(keys))):
            if meta is None:
                break
            first = first or meta
            tiers.append(meta.residency.fastest())
            if tiers[-1] == Tier.OBJECT:
                remote.append((key, meta))
        if remote and self.dram is not None:
            self._prefetch(remote)
        self.stats_counters["lookup_blocks"] += len(keys)
        self.stats_counters["lookup_hits"] += len(tiers)
        self._event("lookup", first, tenant, len(keys), tiers, time.perf_counter() - t0, namespace_id=namespace_id,
                    client=client)
        return LookupResult(len(tiers), tuple(tiers))

    def _event(self, kind: str, meta: BlockMeta | None, tenant: str, blocks: int, tiers, latency_s: float,
               nbytes: int = 0, namespace_id: bytes | None = None, client: str = "") -> None:
        if not self._events_on:  # keep the hot read path free of event objects
            return
        ns_id = meta.namespace_id if meta is not None else namespace_id
        ns = self.namespaces.get(ns_id) if ns_id is not None else None
        self.events.record(Event(
            self.clock(), kind, ns.id.hex() if ns else "", tenant or (meta.tenant if meta else ""), blocks,
            blocks * ns.block_size if ns else 0, len(tiers), tiers.count(Tier.DRAM), tiers.count(Tier.NVME),
            tiers.count(Tier.OBJECT), nbytes=nbytes, latency_s=latency_s, client=client))

    # ---------------------------------------------------------------- pins / delete
    def pin(self, keys: Iterable[bytes], ttl_s: float | None = None) -> int:
        """Hard-pin (ttl_s None) or soft-pin for ttl_s seconds; returns blocks pinned."""
        return self._update_pins(keys, +1, ttl_s)

    def unpin(self, keys: Iterable[bytes]) -> int:
        """Drop one hard pin (or, if none, the soft pin); returns blocks whose pin changed.
        Unpinning an unpinned block changes nothing: pin counts never go negative."""
        return self._update_pins(keys, -1, None)

    def _update_pins(self, keys: Iterable[bytes], sign: int, ttl_s: float | None) -> int:
        now, changed, puts = self.clock(), 0, {}
        with self._lock:
            keys = list(keys)
            for key, meta in zip(keys, self._metas(keys)):
                if meta is None:
                    continue
                if sign > 0 and ttl_s is None:
                    meta.hard_pins += 1
                elif sign > 0:
                    meta.soft_pin_until = max(meta.soft_pin_until, now + ttl_s)
                elif meta.hard_pins > 0:
                    meta.hard_pins -= 1
                elif meta.soft_pin_until > now:
                    meta.soft_pin_until = 0.0
                else:
                    self.stats_counters["unpin_unpinned"] += 1
                    continue
                changed += 1
                if self.dram is not None:
                    self.dram.set_pin(key, meta.hard_pins, meta.soft_pin_until)
                if key not in self._dram_meta:
                    meta.residency &= ~Tier.DRAM
                    puts[key] = meta
            if puts:
                self.index.commit(puts)
        return changed

    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove blocks from every tier (pins do not protect against an explicit delete).
        On a full disk the delete reserve is released and the delete tried once more
        (tiering/space_reserve.py): a store that cannot delete can never free space."""
        keys = _storable(keys)
        with self._lock:
            try:
                return self._delete(keys)
            except TierFullError:
                if self.nvme is None or not self.nvme.reserve.release():
                    raise
                return self._delete(keys)    # tombstones written twice are harmless

    def _delete(self, keys: list[bytes]) -> int:
        """Tombstones first, then the index: a rebuild after a crash never resurrects a block.
        The caller (delete) holds self._lock."""
        stored = [k for k, m in zip(keys, self.index.get_many(keys)) if m is not None]
        if stored and self.nvme is not None:
            segments = self.nvme.put_tombstones(stored, self.clock())
            if self.object is not None:  # so a rebuild from packs does not resurrect them
                self._best_effort(self.object.put_tombstones, stored, self.clock())
        else:
            segments = set()
        self.index.commit(deletes=stored, new_segments=segments)
        gone = set(stored)
        for k in keys:
            if self._dram_meta.pop(k, None) is not None:
                gone.add(k)
            if self.dram is not None:
                self.dram.delete(k)
        return len(gone)

    # ---------------------------------------------------------------- object tier
    def _open_object_tier(self):
        if self.config.object_store is None:
            return None
        from kvcache.tiering.object_store import ObjectTier  # fsspec/s3fs only when configured
        return ObjectTier(self.config.object_store, on_corrupt=self._quarantine_object,
                          on_stored=self._object_stored, on_dropped=self._object_dropped,
                          on_missing=self._object_vanished)

    def _best_effort(self, fn, *args) -> None:
        """An object-tier write that must not fail the caller (the store may be down)."""
        from kvcache.kvstore.errors import StoreError
        try:
            fn(*args)
        except StoreError as e:
            self.stats_counters["object_errors"] += 1
            log.warning("object tier: %s failed: %s", fn.__name__, e)

    def _object_stored(self, landed: list[tuple[bytes, Placement]]) -> None:
        """Upload thread: packs landed; record where (blocks deleted meanwhile are skipped)."""
        self.index.commit(object_puts=dict(landed))
        self.stats_counters["object_stored"] += len(landed)

    def _object_dropped(self, keys: list[bytes], reason: str) -> None:
        self.stats_counters["object_dropped"] += len(keys)
        log.warning("%d blocks not written to the object tier: %s", len(keys), reason)

    # ---------------------------------------------------------------- stats / lifecycle
    def tenant_usage(self, tenant: str) -> tuple[int, int]:
        """(payload bytes, blocks) of `tenant`'s persisted blocks (quotas are checked against it)."""
        return self.index.tenant_usage(tenant)

    def stats(self):
        from kvcache.kvstore.stats import collect_stats
        return collect_stats(self)

    def close(self) -> None:
        if self._closed:
            return
        for t in self._threads:
            t.stop()
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
        if self._promoter is not None:
            self._promoter.close()
        self._closed = True
        try:
            self.flush()
        finally:  # release everything even if one part fails, the lock last
            for part in (self.dram, self.object, self.nvme, self.index):  # object flushes into the index
                try:
                    if part is not None:
                        part.close()
                except Exception:
                    log.exception("closing %s failed", type(part).__name__)
            self._lockfile.close()

    def __enter__(self) -> "BlockStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _warn_if_lifecycle_shorter(config: StoreConfig) -> None:
    """A bucket lifecycle rule shorter than retention is legal (packs vanish, copies are forgotten,
    blocks live on in the other tiers), but the operator should know the object tier holds less."""
    obj = config.object_store
    if obj is None or not obj.lifecycle_days:
        return
    rules = [config.retention.default, *config.retention.namespaces.values(), *config.retention.tenants.values()]
    longest = max(max(r.ttl_s, r.max_age_s or 0) for r in rules)
    if longest > obj.lifecycle_days * 86400:
        log.warning("retention keeps blocks up to %.0f h but the bucket's lifecycle rule deletes objects after "
                    "%.1f days: older blocks are served from DRAM/NVMe only (raise the rule or lower retention)",
                    longest / 3600, obj.lifecycle_days)


def _check_keys(keys: Sequence[bytes]) -> None:
    if set(map(type, keys)) <= {bytes}:
        return
    for k in keys:
        if not isinstance(k, bytes):
            raise TypeError(f"block keys are bytes, got {type(k).__name__}")


def _storable(keys: Iterable[bytes]) -> list[bytes]:
    """The keys a block can have (1-64 bytes; others are in no tier), after _check_keys."""
    keys = list(keys)
    _check_keys(keys)
    return [k for k in keys if 1 <= len(k) <= 64]
