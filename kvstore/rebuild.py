"""Rebuild the index from the NVMe tier's own data (segments are self-describing).

Segments are replayed in id order. For each key the last record wins; a tombstone hides
the key's records created before its deletion time, or at the same time but earlier in
the log (so a block put again after a delete survives). Recovered blocks count as accessed at rebuild time: access times are
not stored in segments, and expiring hot blocks early would cost more than keeping cold
ones one more TTL. Their age (max_age) still counts from creation.
"""

from __future__ import annotations

import logging

from tqdm import tqdm

from kvcache.kvstore.hashing import Namespace
from kvcache.kvstore.index import Index
from kvcache.kvstore.types import BlockMeta, Tier
from kvcache.tiering.nvme import NvmeTier
from kvcache.tiering.segment import ScanEnd, ScannedRecord, scan

log = logging.getLogger(__name__)


def rebuild_index(index: Index, nvme: NvmeTier, now: float, progress: bool = False) -> dict[str, int]:
    records: dict[bytes, BlockMeta] = {}
    tombstones: dict[bytes, tuple[float, int, int]] = {}   # key -> (deleted at, segment, offset)
    report = {"segments": 0, "records": 0, "corrupt_records": 0, "torn_bytes": 0, "tombstones": 0}
    for sid in tqdm(nvme.segment_ids(), desc="rebuilding index", unit="segment", disable=not progress):
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
                records[h.key] = BlockMeta(h.namespace_id, h.raw_len, Tier.NVME, h.created, now,
                                           segment_id=sid, offset=item.offset, record_len=h.record_len)
                report["records"] += 1
    # a record outlives a tombstone that is older, or as old but earlier in the log
    live = {k: m for k, m in records.items()
            if tombstones.get(k, (-1.0, 0, 0)) < (m.created, m.segment_id, m.offset)}
    for ns in nvme.load_namespaces().values():
        index.add_namespace(Namespace.from_dict(ns))
    keys = list(live)
    for i in range(0, len(keys), 10_000):
        chunk = {k: live[k] for k in keys[i: i + 10_000]}
        index.commit(chunk, new_segments={m.segment_id for m in chunk.values()})
    report["blocks"] = len(live)
    log.warning("index rebuilt: %s", report)
    return report
