"""`kvcache check`: reconcile the index with the NVMe segments, and recount.

    index entry ──> its segment exists? its record verifies (header, key, checksum)?
    segment table ─ recounted from the index entries (live bytes and blocks per segment)
    tenant usage  ─ recounted likewise (payload bytes and blocks per tenant: quotas use it)
    segment files ─ scanned: torn or corrupt bytes, records nobody references
    object copies ─ with objects=True: each pack record re-read and verified (one ranged GET
                    per block: costs requests, so it is opt-in)

Reports everything; repairs only with fix=True: bad entries are dropped from the index
(and counted as quarantined), the segment table is replaced by the recount, and segment
files missing from it are registered so GC can reclaim them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tqdm import tqdm

from kvcache.kvstore.index import TENANT_BLOCKS, TENANT_BYTES
from kvcache.kvstore.types import BlockMeta, Tier
from kvcache.tiering.base import Placement
from kvcache.tiering.segment import ScanEnd, scan


@dataclass
class CheckReport:
    blocks_checked: int = 0
    bad_blocks: dict[str, str] = field(default_factory=dict)   # key hex -> reason
    unknown_namespace_blocks: int = 0
    segment_table_mismatches: int = 0
    tenant_count_mismatches: int = 0
    orphan_segments: list[int] = field(default_factory=list)
    missing_segments: list[int] = field(default_factory=list)
    corrupt_records: int = 0
    torn_bytes: int = 0
    unreferenced_bytes: int = 0
    objects_checked: int = 0
    objects_unverified: int = 0      # the object store was unreachable for these
    bad_object_copies: dict[str, str] = field(default_factory=dict)   # key hex -> reason
    fixed: bool = False

    @property
    def ok(self) -> bool:
        return not (self.bad_blocks or self.segment_table_mismatches or self.tenant_count_mismatches
                    or self.orphan_segments or self.missing_segments or self.bad_object_copies)

    def to_dict(self) -> dict:
        d = dict(vars(self))
        d["ok"] = self.ok
        return d


def check(store, fix: bool = False, deep: bool = True, progress: bool = False, objects: bool = False) -> CheckReport:
    rep = CheckReport()
    recount: dict[int, list[int]] = {}
    tenants: dict[str, int] = {}
    referenced: dict[int, set[int]] = {}
    with store._lock:
        store.flush()
        entries = tqdm(store.index.iter_all(), total=store.index.count(), desc="checking blocks",
                       unit="block", disable=not progress)
        for key, meta in entries:
            rep.blocks_checked += 1
            if meta.namespace_id not in store.namespaces:
                rep.unknown_namespace_blocks += 1
            why = _verify(store, key, meta, deep)
            if why is not None:
                rep.bad_blocks[key.hex()] = why
                continue
            for name, n in ((TENANT_BYTES + meta.tenant, meta.payload_len), (TENANT_BLOCKS + meta.tenant, 1)):
                tenants[name] = tenants.get(name, 0) + n
            if objects and Tier.OBJECT in meta.residency and store.object is not None:
                _verify_object_copy(store, key, rep)
            if Tier.NVME in meta.residency:
                u = recount.setdefault(meta.segment_id, [0, 0])
                u[0] += meta.record_len
                u[1] += 1
                referenced.setdefault(meta.segment_id, set()).add(meta.offset)
        _check_segments(store, rep, recount, referenced)
        stored = {k: v for k, v in store.index.counters().items() if k.startswith((TENANT_BYTES, TENANT_BLOCKS))}
        rep.tenant_count_mismatches = sum(stored.get(k, 0) != v for k, v in tenants.items()) + sum(
            v != 0 and k not in tenants for k, v in stored.items())
        if fix:
            _fix(store, rep, recount)
            store.index.set_counters(tenants, (TENANT_BYTES, TENANT_BLOCKS))
    return rep


def _verify(store, key: bytes, meta: BlockMeta, deep: bool) -> str | None:
    if Tier.NVME not in meta.residency or store.nvme is None:
        if Tier.OBJECT in meta.residency:
            return None  # only an object-tier copy: reads verify it (not re-read here)
        return "indexed without a persistent copy"
    placement = Placement(meta.segment_id, meta.offset, meta.record_len, meta.payload_len)
    if not os.path.exists(store.nvme.path(meta.segment_id)):
        return f"segment {meta.segment_id} is missing"
    errors: list[str] = []
    nvme_cb, store.nvme._on_corrupt = store.nvme._on_corrupt, lambda k, p, why: errors.append(why)
    try:
        if deep:
            store.nvme.read_record(key, placement)
        else:
            from kvcache.kvstore.block_format import decode_header
            with store.nvme.readers.open(meta.segment_id) as fd:
                if fd is None:
                    raise FileNotFoundError(f"segment {meta.segment_id} is missing")
                header = decode_header(os.pread(fd, meta.record_len - meta.payload_len, meta.offset))
            if header.key != key:
                errors.append("record holds another block")
    except Exception as e:  # a malformed header in quick mode
        errors.append(str(e))
    finally:
        store.nvme._on_corrupt = nvme_cb
    return errors[0] if errors else None


def _verify_object_copy(store, key: bytes, rep: CheckReport) -> None:
    """Read the block's pack record back and verify it; a bad copy is reported (fix drops it)."""
    placement = store.index.object_location(key)
    errors: list[str] = []
    obj = store.object
    saved = obj._on_corrupt, obj._on_missing
    obj._on_corrupt = obj._on_missing = lambda k, p, why: errors.append(why)
    try:
        got = obj.read_record(key, placement)
        if got is not None:
            obj.codec.decode(*got)
        elif not errors:            # unreachable: proves nothing either way
            rep.objects_unverified += 1
            return
    except Exception as e:   # a codec error on a verified record
        errors.append(str(e))
    finally:
        obj._on_corrupt, obj._on_missing = saved
    rep.objects_checked += 1
    if errors:
        rep.bad_object_copies[key.hex()] = errors[0]


def _check_segments(store, rep: CheckReport, recount: dict[int, list[int]], referenced) -> None:
    table = store.index.segments()
    on_disk = set(store.nvme.segment_ids()) if store.nvme is not None else set()
    for sid in sorted(set(table) | set(recount)):
        u = table.get(sid)
        want = recount.get(sid, [0, 0])
        if u is None or [u.live_bytes, u.live_blocks] != want:
            rep.segment_table_mismatches += 1
        if sid not in on_disk and want[1]:
            rep.missing_segments.append(sid)
    for sid in sorted(on_disk):
        if sid not in table and sid != store.nvme.active_segment:
            rep.orphan_segments.append(sid)
        refs = referenced.get(sid, set())
        for item in scan(store.nvme.path(sid)):
            if isinstance(item, ScanEnd):
                rep.torn_bytes += item.skipped
            elif item.error:
                rep.corrupt_records += 1
            elif not item.header.is_tombstone and item.offset not in refs:
                rep.unreferenced_bytes += item.header.record_len


def _fix(store, rep: CheckReport, recount: dict[int, list[int]]) -> None:
    drops = {}
    for hex_key, why in rep.bad_object_copies.items():
        key = bytes.fromhex(hex_key)
        p = store.index.object_location(key)
        if p is not None:
            drops[key] = p
    if drops:
        store.index.commit(object_drops=drops)
    bad = [bytes.fromhex(k) for k in rep.bad_blocks]
    store.index.commit(deletes=bad, counters={"quarantined": len(bad)} if bad else None)
    store._drop_dram_copies(bad)
    usage = {sid: (b, n) for sid, (b, n) in recount.items() if sid not in rep.missing_segments}
    for sid in rep.orphan_segments:
        usage.setdefault(sid, (0, 0))
    store.index.set_segment_usage(usage)
    store.index.sync()
    rep.fixed = True
