"""The index's bookkeeping tables: NVMe segment and object-pack usage, counters, object copies.

    segments / packs  id (u32 BE)   -> live bytes, live blocks (u64, u64)
    counters          name (UTF-8)  -> i64   (quarantined, expired, tenant_bytes/<tenant>, ...)
    objects           block key     -> pack id, offset, record length, stored payload length

The usage tables and counters are derived from the blocks table (`kvcache check --fix`
recounts them), so a value that does not unpack (bit flips at rest) reads as absent, with a
warning, and the next commit that touches it writes it afresh: a damaged bookkeeping value
must not fail every put that touches it. An object-copy value that does not unpack reads as
no copy (the block is served from the tiers above, or is a miss).

Every function here runs inside a transaction that kvstore/index.py opened.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass

from kvcache.kvstore.types import BlockMeta, Tier
from kvcache.tiering.base import Placement

log = logging.getLogger(__name__)
_SEG_KEY = struct.Struct(">I")
_SEG_VAL = struct.Struct("<QQ")
_I64 = struct.Struct("<q")
_OBJ_VAL = struct.Struct("<IQQQ")   # pack id, offset, record length, stored payload length
TENANT_BYTES, TENANT_BLOCKS = "tenant_bytes/", "tenant_blocks/"
_WARNED_MAX = 1024                  # damaged values warned about once each, up to this many
_warned: set[tuple[str, bytes]] = set()


@dataclass(frozen=True, slots=True)
class SegmentUsage:
    segment_id: int
    live_bytes: int
    live_blocks: int


def _damaged(table: str, key, what: str) -> None:
    """Warn once per damaged value: GC reads the usage tables every step."""
    mark = (table, bytes(key))
    if mark in _warned:
        return
    if len(_warned) < _WARNED_MAX:
        _warned.add(mark)
    log.warning("index %s entry %s is damaged (%s); it counts as absent until rewritten or "
                "`kvcache check --fix` recounts", table, bytes(key).hex(), what)


# ---------------------------------------------------------------- segment and pack usage
def seg_key(sid: int) -> bytes:
    return _SEG_KEY.pack(sid)


def _unpack_usage(table: str, k, v) -> SegmentUsage | None:
    if len(k) != _SEG_KEY.size or len(v) != _SEG_VAL.size:
        _damaged(table, k, f"a {len(k)}-byte key with a {len(v)}-byte value")
        return None
    sid = _SEG_KEY.unpack(k)[0]
    return SegmentUsage(sid, *_SEG_VAL.unpack(v))


def read_usage(txn, db, table: str) -> dict[int, SegmentUsage]:
    """The whole usage table; damaged rows left out."""
    rows = (_unpack_usage(table, k, v) for k, v in txn.cursor(db=db))
    return {u.segment_id: u for u in rows if u is not None}


def add_usage_row(txn, db, sid: int) -> None:
    """A row of zeros for a new segment, unless it has one."""
    if txn.get(seg_key(sid), db=db) is None:
        txn.put(seg_key(sid), _SEG_VAL.pack(0, 0), db=db)


def put_usage_row(txn, db, sid: int, nbytes: int, blocks: int) -> None:
    txn.put(seg_key(sid), _SEG_VAL.pack(nbytes, blocks), db=db)


def apply_usage(txn, db, table: str, delta: dict[int, list[int]]) -> None:
    """Add (bytes, blocks) deltas to a usage table, never below zero; a damaged row starts from 0."""
    for sid, (d_bytes, d_blocks) in delta.items():
        raw = txn.get(seg_key(sid), db=db)
        u = None if raw is None else _unpack_usage(table, seg_key(sid), raw)
        b, n = (u.live_bytes, u.live_blocks) if u is not None else (0, 0)
        put_usage_row(txn, db, sid, max(0, b + d_bytes), max(0, n + d_blocks))


def account(seg_delta: dict[int, list[int]], counters: dict[str, int], meta: BlockMeta | None,
            sign: int) -> None:
    """Segment usage (NVMe bytes) and the owning tenant's usage (payload bytes, blocks) of one
    block entering (+1) or leaving (-1) the index. A damaged entry (None) counts for nothing."""
    if meta is None:
        return
    if Tier.NVME in meta.residency:
        d = seg_delta.setdefault(meta.segment_id, [0, 0])
        d[0] += sign * meta.record_len
        d[1] += sign
    for name, n in ((TENANT_BYTES + meta.tenant, meta.payload_len), (TENANT_BLOCKS + meta.tenant, 1)):
        counters[name] = counters.get(name, 0) + sign * n


# ---------------------------------------------------------------- counters
def _counter_value(k, v) -> int | None:
    if len(v) != _I64.size:
        _damaged("counters", k, f"a {len(v)}-byte value")
        return None
    return _I64.unpack(v)[0]


def _counter_name(k) -> str | None:
    try:
        return bytes(k).decode()
    except UnicodeDecodeError:
        _damaged("counters", k, "a name that is not UTF-8")
        return None


def read_counters(txn, db) -> dict[str, int]:
    out = {}
    for k, v in txn.cursor(db=db):
        name, value = _counter_name(k), _counter_value(k, v)
        if name is not None and value is not None:
            out[name] = value
    return out


def read_counter(txn, db, name: str) -> int:
    """One counter; 0 when absent or damaged."""
    raw = txn.get(name.encode(), db=db)
    return (_counter_value(name.encode(), raw) or 0) if raw is not None else 0


def bump_counters(txn, db, deltas: dict[str, int]) -> None:
    """Add each delta to its counter; a damaged counter starts from 0."""
    for name, delta in deltas.items():
        if delta:
            txn.put(name.encode(), _I64.pack(read_counter(txn, db, name) + delta), db=db)


def set_counters(txn, db, values: dict[str, int], prefixes: tuple[str, ...]) -> None:
    """Overwrite counters; counters under `prefixes` not in `values` are zeroed (recounts)."""
    for k, _ in list(txn.cursor(db=db)):
        name = _counter_name(k)
        if name is None:
            txn.delete(k, db=db)
        elif name.startswith(prefixes) and name not in values:
            txn.put(k, _I64.pack(0), db=db)
    for name, v in values.items():
        txn.put(name.encode(), _I64.pack(v), db=db)


# ---------------------------------------------------------------- object copies
def pack_object(p: Placement) -> bytes:
    return _OBJ_VAL.pack(p.segment_id, p.offset, p.record_len, p.payload_len)


def unpack_object(key, raw) -> Placement | None:
    """Where an objects-table value places a copy; None when absent or damaged."""
    if raw is None:
        return None
    if len(raw) != _OBJ_VAL.size:
        _damaged("objects", key, f"a {len(raw)}-byte value")
        return None
    return Placement(*_OBJ_VAL.unpack(raw))
