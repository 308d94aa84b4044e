"""The block index: LMDB, key -> BlockMeta, plus namespaces, segments and counters.

Four named databases in one environment, all changed together in one transaction:

    blocks      block key          -> BlockMeta.pack()
    namespaces  namespace id (16B) -> JSON descriptor
    segments    segment id (u32 BE)-> live bytes, live blocks   (NVMe space accounting)
    counters    name               -> i64                       (quarantined, expired, ...)
    objects, packs                                              (object-tier copies and usage)

The bookkeeping tables' encoding lives in kvstore/index_usage.py. A value that does not
unpack (bit flips in the index) reads as absent, never as an error; LMDB failures surface as
StoreError (TierFullError when the disk is full), never as lmdb.Error.

Access times are not written on every read: `touch()` buffers them and `flush_touches()`
writes a batch. A crash loses at most one flush interval of access times, which only
makes blocks look slightly older; it never loses a block.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import threading
from typing import Iterable, Iterator

import lmdb

from kvcache.kvstore import index_usage as usage
from kvcache.kvstore.errors import StoreError, TierFullError
from kvcache.kvstore.hashing import Namespace
from kvcache.kvstore.index_usage import TENANT_BLOCKS, TENANT_BYTES, SegmentUsage  # noqa: F401 (re-exported)
from kvcache.kvstore.types import BlockMeta, Tier
from kvcache.tiering.base import Placement

log = logging.getLogger(__name__)
_FULL_BELOW = 1 << 20   # free bytes under which a failed LMDB write is taken for a full disk


def unpack_meta(key: bytes, raw, *, quiet: bool = False) -> BlockMeta | None:
    """BlockMeta of an index value, or None when absent or damaged (too short, an unknown
    residency, a tenant that is not UTF-8): such a block reads as absent. `quiet`: no warning
    (a touch flush skips what a read has reported already)."""
    if raw is None:
        return None
    try:
        return BlockMeta.unpack(raw)
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        if not quiet:
            log.warning("index entry of %s is damaged (%s); it reads as absent until `kvcache check --fix`",
                        bytes(key).hex(), e)
        return None


class Index:
    """Thread-safe: LMDB serialises writers; readers each use their own read transaction."""

    def __init__(self, path: str, *, map_size: int = 64 << 30, sync: bool = True, readonly: bool = False):
        self.path = path
        self.readonly = readonly
        self.objects_pending = False   # set by open_index: packs not indexed yet (a rebuild met an outage)
        try:
            if not readonly:
                os.makedirs(path, exist_ok=True)
            # read-only still takes LMDB's reader lock where it can (lock.mdb is shared): without it
            # a daemon writing meanwhile reuses pages this reader is walking (MDB_PAGE_NOTFOUND, an abort)
            lock = not readonly or os.access(os.path.join(path, "lock.mdb"), os.W_OK)
            self.env = lmdb.open(path, map_size=map_size, max_dbs=8, subdir=True, sync=sync,
                                 metasync=sync, readonly=readonly, lock=lock,
                                 max_readers=512, create=not readonly)
        except lmdb.Error as e:
            raise StoreError(f"cannot open the index at {path}: {e}") from e
        try:
            # read-only: lmdb opens the handles in a read transaction of its own
            (self._blocks, self._namespaces, self._segments, self._counters) = (
                self.env.open_db(name, create=not readonly)
                for name in (b"blocks", b"namespaces", b"segments", b"counters"))
            self._objects = self._open_optional(b"objects")
            self._packs = self._open_optional(b"packs")
        except lmdb.Error as e:
            self.env.close()
            raise StoreError(f"the index at {path} is not a kvcache index or is damaged ({e}); "
                             "move it aside and run `kvcache check DIR --rebuild`") from e
        self._touch_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._touches: dict[bytes, tuple[float, int]] = {}
        self._flushing: dict[bytes, tuple[float, int]] = {}     # touches being written (flush_touches)

    def _open_optional(self, name: bytes):
        """A database added after the first release: created when writable, absent when an
        older index is opened read-only."""
        try:
            return self.env.open_db(name, create=not self.readonly)
        except lmdb.NotFoundError:
            return None

    # ---------------------------------------------------------------- reads
    def get(self, key: bytes) -> BlockMeta | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Iterable[bytes]) -> list[BlockMeta | None]:
        """Metadata per key (None if absent), with access times not yet flushed folded in."""
        touches, flushing, objects = self._touches, self._flushing, self._objects
        with self._read(db=self._blocks, buffers=True) as txn:
            if objects is not None and not txn.stat(objects)["entries"]:
                objects = None     # no object copy of any block (no object tier): no second get per key
            out, get, unpack = [], txn.get, BlockMeta.unpack
            for k in keys:
                raw = get(k)
                try:               # unpack_meta's work without its call on the common path
                    meta = None if raw is None else unpack(raw)
                except (struct.error, IndexError, UnicodeDecodeError):
                    meta = unpack_meta(k, raw)              # damaged: warns, reads as absent
                if meta is not None:
                    if touches and k in touches:
                        ts, n = touches[k]
                        meta.last_access, meta.access_count = max(meta.last_access, ts), meta.access_count + n
                    if flushing and k in flushing:     # being written: its time counts already (max:
                        meta.last_access = max(meta.last_access, flushing[k][0])   # twice is harmless)
                    if objects is not None and txn.get(k, db=objects) is not None:
                        meta.residency |= Tier.OBJECT  # derived, never stored: no lost updates
                out.append(meta)
            return out

    def object_location(self, key: bytes) -> Placement | None:
        """Where the object tier holds `key` (pack id, offset, lengths), if it does."""
        if self._objects is None:
            return None
        with self._read(db=self._objects) as txn:
            return usage.unpack_object(key, txn.get(key))

    def scan(self, after: bytes | None = None, limit: int = 1000) -> list[tuple[bytes, BlockMeta]]:
        """Up to `limit` entries in key order, strictly after `after` (None: from the start)."""
        out: list[tuple[bytes, BlockMeta]] = []
        with self._read(db=self._blocks) as txn:
            cur = txn.cursor()
            ok = cur.set_range(after) if after is not None else cur.first()
            if ok and after is not None and cur.key() == after:
                ok = cur.next()
            while ok and len(out) < limit:
                key, meta = cur.key(), unpack_meta(cur.key(), cur.value())
                if meta is not None:
                    if self._objects is not None and txn.get(key, db=self._objects) is not None:
                        meta.residency |= Tier.OBJECT
                    out.append((key, meta))
                ok = cur.next()
        return out

    def iter_all(self, batch: int = 10_000) -> Iterator[tuple[bytes, BlockMeta]]:
        after = None
        while True:
            chunk = self.scan(after, batch)
            if not chunk:
                return
            yield from chunk
            after = chunk[-1][0]

    def sample(self, n: int, rng) -> list[tuple[bytes, BlockMeta]]:
        """About `n` entries at uniformly random places: keys are hashes, so a random
        16-byte probe lands uniformly in the key space (approximate-LRU eviction input). Read
        through get_many, so access times not yet flushed count: a block read a moment ago is
        not the oldest of its sample."""
        keys: dict[bytes, None] = {}
        with self._read(db=self._blocks) as txn:
            cur = txn.cursor()
            for _ in range(n):
                if cur.set_range(rng.randbytes(16)) or cur.first():
                    keys[cur.key()] = None
        return [(k, m) for k, m in zip(keys, self.get_many(keys)) if m is not None]

    def count(self) -> int:
        with self._read() as txn:
            return txn.stat(self._blocks)["entries"]

    def namespaces(self) -> dict[bytes, Namespace]:
        with self._read(db=self._namespaces) as txn:
            rows = list(txn.cursor())
        try:
            return {k: Namespace.from_dict(json.loads(v)) for k, v in rows}
        except (ValueError, TypeError) as e:     # a newer build's fields, or a damaged descriptor
            raise StoreError(f"the index at {self.path} holds a namespace this kvcache cannot read ({e}); "
                             "open it with the kvcache that wrote it, or move it aside and run "
                             "`kvcache check DIR --rebuild`") from e

    def segments(self) -> dict[int, SegmentUsage]:
        with self._read() as txn:
            return usage.read_usage(txn, self._segments, "segments")

    def object_copies_in(self, pack_ids: Iterable[int]) -> dict[bytes, Placement]:
        """Every block whose object copy lives in one of `pack_ids` (a full scan of the objects
        table: only for packs that vanished, which is rare)."""
        wanted, out = set(pack_ids), {}
        if self._objects is None or not wanted:
            return out
        with self._read(db=self._objects) as txn:
            for key, raw in txn.cursor():
                p = usage.unpack_object(key, raw)
                if p is not None and p.segment_id in wanted:
                    out[bytes(key)] = p
        return out

    def pack_usage(self) -> dict[int, SegmentUsage]:
        """Live bytes and blocks per object-tier pack (the object tier's segment table)."""
        if self._packs is None:
            return {}
        with self._read() as txn:
            return usage.read_usage(txn, self._packs, "packs")

    def counters(self) -> dict[str, int]:
        with self._read() as txn:
            return usage.read_counters(txn, self._counters)

    # ---------------------------------------------------------------- writes
    def add_namespace(self, ns: Namespace) -> None:
        with self._write() as txn:
            txn.put(ns.id, json.dumps(ns.to_dict(), sort_keys=True).encode(), db=self._namespaces)

    def commit(self, puts: dict[bytes, BlockMeta] | None = None, deletes: Iterable[bytes] = (),
               counters: dict[str, int] | None = None, new_segments: Iterable[int] = (),
               drop_segments: Iterable[int] = (), object_puts: dict[bytes, Placement] | None = None,
               object_drops: dict[bytes, Placement] | None = None,
               object_moves: dict[bytes, tuple[Placement, Placement]] | None = None,
               drop_packs: Iterable[int] = ()) -> None:
        """Apply puts, deletes and counter bumps atomically, keeping segment and pack usage exact.

        `object_puts` records object-tier copies of blocks still in the index (others are
        skipped: deleted or expired meanwhile); `object_drops` forgets copies that are still
        at the given place (a quarantined pack record); `object_moves` repoints copies that are
        still at their old place (pack compaction). Deleting a block forgets its copy."""
        with self._write() as txn:
            seg_delta: dict[int, list[int]] = {}
            counters = dict(counters or {})
            for sid in new_segments:
                usage.add_usage_row(txn, self._segments, sid)
            pack_delta: dict[int, list[int]] = {}
            for key in deletes:
                if self._objects is not None:
                    self._set_object(txn, key, None, pack_delta)
                old = txn.pop(key, db=self._blocks)
                if old is not None:
                    usage.account(seg_delta, counters, unpack_meta(key, old), -1)
            for key, meta in (puts or {}).items():
                old = txn.get(key, db=self._blocks)
                if old is not None:
                    usage.account(seg_delta, counters, unpack_meta(key, old), -1)
                usage.account(seg_delta, counters, meta, +1)
                txn.put(key, meta.pack(), db=self._blocks)
            usage.apply_usage(txn, self._segments, "segments", seg_delta)
            for sid in drop_segments:
                txn.delete(usage.seg_key(sid), db=self._segments)
            self._commit_objects(txn, pack_delta, object_puts or {}, object_drops or {}, object_moves or {},
                                 drop_packs)
            usage.bump_counters(txn, self._counters, counters)

    def _commit_objects(self, txn, pack_delta, puts, drops, moves, drop_packs) -> None:
        for key, p in puts.items():
            if txn.get(key, db=self._blocks) is not None:
                self._set_object(txn, key, p, pack_delta)
        for key, p in drops.items():
            if txn.get(key, db=self._objects) == usage.pack_object(p):
                self._set_object(txn, key, None, pack_delta)
        for key, (old, new) in moves.items():
            if txn.get(key, db=self._objects) == usage.pack_object(old):
                self._set_object(txn, key, new, pack_delta)
        usage.apply_usage(txn, self._packs, "packs", pack_delta)
        for pid in drop_packs:
            txn.delete(usage.seg_key(pid), db=self._packs)

    def _set_object(self, txn, key: bytes, new: Placement | None, pack_delta: dict[int, list[int]]) -> None:
        """Point `key`'s object copy at `new` (None: forget it), keeping pack usage exact."""
        old = usage.unpack_object(key, txn.get(key, db=self._objects))
        if old is not None:
            d = pack_delta.setdefault(old.segment_id, [0, 0])
            d[0], d[1] = d[0] - old.record_len, d[1] - 1
        if new is None:
            txn.delete(key, db=self._objects)
            return
        txn.put(key, usage.pack_object(new), db=self._objects)
        d = pack_delta.setdefault(new.segment_id, [0, 0])
        d[0], d[1] = d[0] + new.record_len, d[1] + 1

    def set_segment_usage(self, rows: dict[int, tuple[int, int]]) -> None:
        """Replace the whole segment table (used by check --fix after recounting)."""
        with self._write() as txn:
            txn.drop(self._segments, delete=False)
            for sid, (b, n) in rows.items():
                usage.put_usage_row(txn, self._segments, sid, b, n)

    def tenant_usage(self, tenant: str) -> tuple[int, int]:
        """(payload bytes, blocks) that `tenant` holds in the index: two point reads (it runs per
        payload of an upload, for the quota), not a scan of every tenant's counters."""
        with self._read() as txn:
            return (usage.read_counter(txn, self._counters, TENANT_BYTES + tenant),
                    usage.read_counter(txn, self._counters, TENANT_BLOCKS + tenant))

    def set_counters(self, values: dict[str, int], prefixes: tuple[str, ...] = ()) -> None:
        """Overwrite counters; counters under `prefixes` not in `values` are zeroed (recounts)."""
        with self._write() as txn:
            usage.set_counters(txn, self._counters, values, prefixes)

    @contextlib.contextmanager
    def _read(self, **kw):
        try:
            with self.env.begin(**kw) as txn:
                yield txn
        except lmdb.Error as e:      # a damaged page, a reader table that is full: the store, not the caller
            raise StoreError(f"the index at {self.path} cannot be read ({e}); if this persists, stop the "
                             "daemon and run `kvcache check DIR --rebuild`") from e

    @contextlib.contextmanager
    def _write(self):
        if self.readonly:
            raise StoreError(f"the index at {self.path} is open read-only")
        try:
            with self.env.begin(write=True) as txn:
                yield txn
        except lmdb.MapFullError as e:
            raise TierFullError(f"the index map is full; raise index_map_bytes in the store config ({e})") from e
        except lmdb.Error as e:
            raise self._write_error(e) from e

    def _write_error(self, e: lmdb.Error) -> StoreError:
        """LMDB reports a write the disk could not take as EIO (a short pwrite), so a full disk
        is told apart by the free space left."""
        try:
            st = os.statvfs(self.path)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = _FULL_BELOW
        if free < _FULL_BELOW:
            return TierFullError(f"the disk holding the index at {self.path} is full; delete blocks or free "
                                 f"space on it ({e})")
        return StoreError(f"the index at {self.path} could not be written ({e}); check the disk "
                          "(read-only, failing?)")

    # ---------------------------------------------------------------- access times
    def touch(self, key: bytes, now: float) -> None:
        with self._touch_lock:
            _, n = self._touches.get(key, (0.0, 0))
            self._touches[key] = (now, n + 1)

    def touch_many(self, keys, now: float) -> None:
        touches = self._touches
        with self._touch_lock:
            for key in keys:
                n = touches.get(key, (0.0, 0))[1]
                touches[key] = (now, n + 1)

    def pending_touches(self) -> int:
        return len(self._touches)

    def flush_touches(self) -> int:
        # one flush at a time (the periodic thread, a store flush, close): a second would replace
        # `_flushing` while the first's batch is not yet committed, and end it under the first
        with self._flush_lock:
            with self._touch_lock:
                # readers keep seeing these times until the write commits (else a block read just now
                # looks idle for that moment, and GC's re-check may expire it)
                touches, self._touches = self._touches, {}
                self._flushing = touches
            try:
                if not touches or self.readonly:
                    return 0
                with self._write() as txn:
                    for key, (ts, n) in touches.items():
                        meta = unpack_meta(key, txn.get(key, db=self._blocks), quiet=True)
                        if meta is None:
                            continue
                        meta.last_access = max(meta.last_access, ts)
                        meta.access_count += n
                        txn.put(key, meta.pack(), db=self._blocks)
                return len(touches)
            finally:
                self._flushing = {}

    def sync(self) -> None:
        if not self.readonly:
            self.env.sync(True)

    def close(self) -> None:
        if not self.readonly:
            self.flush_touches()
        self.env.close()

