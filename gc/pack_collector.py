"""Object-tier GC: reclaim packs made sparse by expiry, deletes and NVMe-only rewrites.

One call handles at most one pack, the sparsest below `compact_below` live, after forgetting
packs that vanished from the bucket (lifecycle expiration rules delete objects behind our back):

    tombstones      ──> carried into a new pack while an older pack may hold their keys
    no live record  ──> remove the pack, drop its usage row
    some live       ──> rewrite_pack: one GET of the old pack, live records verbatim into a
                        new pack (PUT) ──> index commit of the moves (only copies still at
                        their old place) ──> remove the old pack once nothing points at it

The newest packs are left alone: a pack whose upload just finished may not have had its
locations committed yet (the upload thread commits right after), so it would look empty.
An unreachable object store just ends the step; the next one retries.
"""

from __future__ import annotations

import logging

from kvcache.kvstore.errors import CorruptBlockError, StoreError

log = logging.getLogger(__name__)


def compact_one_pack(store, report, compact_below: float = 0.5, keep_newest: int = 4) -> None:
    obj = store.object
    if store.index.objects_pending:
        log.info("pack GC skipped: the object tier's copies are not indexed yet (a rebuild met an outage; "
                 "the next open indexes them)")
        return
    usage = store.index.pack_usage()    # before listing: every pack in it was uploaded before the listing
    try:
        packs = obj.list_packs()
    except StoreError as e:
        log.info("object tier unreachable, pack GC skipped: %s", e)
        return
    forget_vanished_packs(store, report, [pid for pid in usage if pid not in packs])
    old_enough = sorted(packs)[:-keep_newest] if keep_newest else sorted(packs)
    best, best_ratio = None, compact_below
    for pid in old_enough:
        u = usage.get(pid)
        ratio = (u.live_bytes / packs[pid]) if (u and packs[pid]) else 0.0
        if ratio < best_ratio or u is None or u.live_blocks == 0:
            best, best_ratio = pid, ratio
            if ratio == 0.0:
                break
    if best is None:
        return
    try:
        _reclaim(store, best, packs[best], usage.get(best), report, older_exists=min(packs) < best)
    except (StoreError, CorruptBlockError) as e:
        log.warning("compacting object pack %d failed (%s); it is retried later", best, e)


def forget_vanished_packs(store, report, gone: list[int]) -> None:
    """Packs the index counts on but the bucket no longer lists: a lifecycle rule (or someone)
    deleted them. Forget those copies in one commit, so that lookups stop reporting blocks that
    only lived there and nobody GETs a missing object. Listings are strongly consistent on S3,
    MinIO and file://, and `usage` was read before the listing, so a fresh upload never looks gone."""
    if not gone:
        return
    copies = store.index.object_copies_in(gone)
    store.index.commit(object_drops=copies, drop_packs=gone)
    store.stats_counters["object_vanished"] += len(copies)
    report.packs_vanished += len(gone)
    log.warning("%d object packs are gone from the bucket (lifecycle rule?); forgot %d block copies in them",
                len(gone), len(copies))


def _reclaim(store, pid: int, size: int, usage, report, older_exists: bool) -> None:
    obj = store.object
    records = list(_records(obj, pid, size))
    if older_exists:  # tombstones may still shadow records in older packs: carry them forward
        by_time: dict[float, list[bytes]] = {}
        for key, _, h in records:
            if h.is_tombstone and store.index.get(key) is None:
                by_time.setdefault(h.created, []).append(key)
        for deleted_at, keys in by_time.items():
            obj.put_tombstones(keys, deleted_at)
    if usage is not None and usage.live_blocks:
        live = [(key, p) for key, p, h in records
                if not h.is_tombstone and store.index.object_location(key) == p]
        moved = obj.rewrite_pack(pid, live)
        old = dict(live)
        store.index.commit(object_moves={k: (old[k], p) for k, p in moved.items()})
        report.packs_compacted += 1
        left = store.index.pack_usage().get(pid)
        if left is not None and left.live_blocks:
            log.warning("object pack %d still has %d live blocks after compaction; kept", pid, left.live_blocks)
            return
    obj.remove_pack(pid)
    store.index.commit(drop_packs=[pid])
    report.packs_removed += 1
    report.bytes_reclaimed += size


def _records(obj, pid: int, size: int):
    from kvcache.tiering.base import Placement
    for e in obj.pack_index(pid, size):
        h = e.header
        yield h.key, Placement(pid, e.offset, h.record_len, h.payload_len), h
