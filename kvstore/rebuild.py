"""Rebuild the index from the NVMe tier's own data (segments are self-describing).

Segments are replayed in id order. For each key the last record wins; a tombstone hides
the key's records created before its deletion time, or at the same time but earlier in
the log (so a block put again after a delete survives). Recovered blocks count as accessed at
rebuild time: access times are not stored in segments, and expiring hot blocks early would
cost more than keeping cold ones one more TTL. Their age (max_age) still counts from creation. Pins and explicit
per-block TTLs live only in the index and are not recovered; tenants are (records name theirs,
for quotas and per-tenant retention). Object-tier packs are read
too (their indexes only): blocks found only there come back as object-only blocks.
"""

from __future__ import annotations

import logging
import os
import shutil

from tqdm import tqdm

from kvcache.kvstore.durable import fsync_dir
from kvcache.kvstore.hashing import Namespace
from kvcache.kvstore.index import Index
from kvcache.kvstore.types import BlockMeta, Tier
from kvcache.tiering.nvme import NvmeTier
from kvcache.tiering.segment import ScanEnd, ScannedRecord, scan

log = logging.getLogger(__name__)


def rebuild_index(index: Index, nvme: NvmeTier | None, now: float, progress: bool = False,
                  obj=None) -> dict[str, int]:
    records: dict[bytes, BlockMeta] = {}
    tombstones: dict[bytes, tuple[float, int, int]] = {}   # key -> (deleted at, segment, offset)
    report = {"segments": 0, "records": 0, "corrupt_records": 0, "torn_bytes": 0, "tombstones": 0}
    for sid in tqdm(nvme.segment_ids() if nvme else [], desc="rebuilding index", unit="segment",
                    disable=not progress):
        report["segments"] += 1
        for item in scan(nvme.path(sid)):
            if isinstance(item, ScanEnd):
                report["torn_bytes"] += item.skipped
                continue
            assert isinstance(item, ScannedRecord)
            h = item.header
            if item.error is not None:
                report["corrupt_records"] += 1
            elif h.is_tombstone:
                tombstones[h.key] = max(tombstones.get(h.key, (0.0, 0, 0)), (h.created, sid, item.offset))
                report["tombstones"] += 1
            else:
                records[h.key] = BlockMeta(h.namespace_id, h.raw_len, Tier.NVME, h.created, now, tenant=h.tenant,
                                           segment_id=sid, offset=item.offset, record_len=h.record_len)
                report["records"] += 1
    # a record outlives a tombstone that is older, or as old but earlier in the log
    live = {k: m for k, m in records.items()
            if tombstones.get(k, (-1.0, 0, 0)) < (m.created, m.segment_id, m.offset)}
    objects, descriptors = _object_records(obj, tombstones, live, now, report), {}
    report["objects_pending"] = int(objects is None)
    objects = objects or {}
    for tier in (obj, nvme):
        if tier is not None:
            descriptors.update(_namespaces_of(tier))
    for ns_id, ns in descriptors.items():
        try:
            index.add_namespace(Namespace.from_dict(ns))
        except (TypeError, ValueError) as e:
            log.error("namespace %s in namespaces.json is malformed (%s); register it again", ns_id, e)
    keys = list(live)
    for i in range(0, len(keys), 10_000):
        chunk = {k: live[k] for k in keys[i: i + 10_000]}
        index.commit(chunk, new_segments={m.segment_id for m in chunk.values() if Tier.NVME in m.residency},
                     object_puts={k: objects[k] for k in chunk if k in objects})
    report["blocks"] = len(live)
    log.warning("index rebuilt: %s", report)
    return report


def _object_records(obj, tombstones, live: dict[bytes, BlockMeta], now: float, report) -> dict:
    """Object-tier copies from the pack indexes: added to `live` (object-only blocks get a
    metadata entry without NVMe residency); returns key -> placement. Pack tombstones count
    like segment tombstones. None: the store is unreachable (open_index retries at the next open)."""
    from kvcache.kvstore.errors import StoreError
    if obj is None:
        return {}
    try:
        found = _pack_records(obj, tombstones)
    except StoreError as e:
        log.error("object tier unreachable during the index rebuild (%s): its copies are indexed at a later "
                  "open; until then pack GC removes no pack", e)
        return None
    out = {}
    for key, (placement, h) in found.items():
        if key not in live:
            # pack and segment positions do not compare: an object record must be strictly
            # newer than the key's last tombstone (a re-put in the same clock tick as its
            # delete comes back only from NVMe)
            if tombstones.get(key, (-1.0, 0, 0))[0] >= h.created:
                continue
            live[key] = _object_only(h, now)
        out[key] = placement
    report["object_records"] = len(out)
    return out


def _object_only(h, now: float) -> BlockMeta:
    """Metadata of a block whose only copy is a pack record with header `h`."""
    return BlockMeta(h.namespace_id, h.raw_len, Tier.NONE, h.created, now, tenant=h.tenant)


def _pack_records(obj, tombstones) -> dict[bytes, tuple]:
    """key -> (placement, header) of every pack record; pack tombstones go into `tombstones`."""
    found: dict[bytes, tuple] = {}
    for key, placement, h in obj.rebuild():
        if h.is_tombstone:
            tombstones[key] = max(tombstones.get(key, (0.0, 0, 0)), (h.created, 0, 0))
        else:
            found[key] = (placement, h)
    return found


def index_pending_objects(index: Index, obj, now: float) -> bool:
    """The object part of a rebuild that met an unreachable store: index the packs' copies now
    (blocks only there come back as object-only blocks; keys the index holds gain their object
    copy). False: still unreachable. Tombstones seen here are the packs'; a delete whose pack
    tombstone failed to upload is the one case this can bring back (its NVMe tombstone was read
    by the rebuild, not kept)."""
    from kvcache.kvstore.errors import StoreError
    tombstones: dict[bytes, tuple[float, int, int]] = {}
    try:
        found = _pack_records(obj, tombstones)
    except StoreError as e:
        log.warning("object tier still unreachable (%s): its copies stay unindexed", e)
        return False
    keys = list(found)
    puts, object_puts = {}, {}
    for key, meta in zip(keys, index.get_many(keys)):
        placement, h = found[key]
        if tombstones.get(key, (-1.0, 0, 0))[0] >= h.created:
            continue
        if meta is None:
            puts[key] = _object_only(h, now)
        object_puts[key] = placement
    index.commit(puts, object_puts=object_puts)
    log.warning("object tier indexed after an earlier rebuild: %d copies, %d object-only blocks",
                len(object_puts), len(puts))
    return True


def _namespaces_of(tier) -> dict:
    try:
        return tier.load_namespaces()
    except Exception as e:  # a damaged or unreachable copy: the other tier's may do
        log.error("namespace descriptors unreadable from %s: %s", type(tier).__name__, e)
        return {}


def open_index(index_dir: str, nvme: NvmeTier | None, map_size: int, sync: bool, now: float,
               obj=None) -> Index:
    """Open the index, rebuilding it from the segments when it is missing.

    A marker file brackets the rebuild: a crash part-way leaves the marker, and the next
    open discards the partial index and starts over, instead of trusting it (and letting
    GC delete every segment it does not reference).
    """
    marker, pending = index_dir + ".rebuilding", index_dir + ".objects-pending"
    if os.path.exists(marker):
        log.warning("an index rebuild in %s was interrupted; starting it over", index_dir)
        shutil.rmtree(index_dir, ignore_errors=True)
    must_rebuild = (not os.path.exists(os.path.join(index_dir, "data.mdb"))
                    and ((nvme is not None and bool(nvme.segment_ids())) or obj is not None))
    if must_rebuild:
        _durable(lambda: open(marker, "w").close(), marker)
    index = Index(index_dir, map_size=map_size, sync=sync)
    try:
        if must_rebuild:
            log.warning("index missing at %s: rebuilding it from the NVMe segments and object packs", index_dir)
            if rebuild_index(index, nvme, now, obj=obj)["objects_pending"]:
                _durable(lambda: open(pending, "w").close(), pending)
            elif os.path.exists(pending):     # an earlier rebuild's: this one indexed the packs
                _durable(lambda: os.unlink(pending), pending)
            index.sync()
        elif os.path.exists(pending) and obj is not None and index_pending_objects(index, obj, now):
            index.sync()
            _durable(lambda: os.unlink(pending), pending)
    except BaseException:
        index.close()
        raise
    if must_rebuild:
        _durable(lambda: os.unlink(marker), marker)
    # pack GC must not take a pack with no usage row for an empty one while its copies are unindexed
    index.objects_pending = obj is not None and os.path.exists(pending)
    return index


def _durable(action, path: str) -> None:
    """Create or remove `path`, then fsync its directory so the change survives a crash."""
    action()
    fsync_dir(os.path.dirname(path) or ".")
