"""The object-storage tier: block records packed into large objects, over fsspec.

    url = "s3://bucket/prefix"  (s3fs)   or   "file:///abs/dir" / "/abs/dir"  (local)

Writes (see object_queue.py for the write-back queue, object_pack.py for the pack layout):

    enqueue(writes)  returns at once (bounded memory); packs are built and PUT in the
                     background; on_stored([(key, Placement)]) reports what landed, so the
                     caller commits its index only for data that exists. flush() waits.
    put(writes)      synchronous: one or more packs PUT before returning the Placements
                     (the BlockTier contract; also compaction's write path).

    Placement(segment_id = pack id, offset of the record in the pack, record_len,
              payload_len = stored (possibly compressed) payload length)

Reads are one ranged GET of the record, then the header checksum, key and payload
checksum are verified exactly as in the NVMe tier. Corrupt or missing data is a miss
reported through on_corrupt; an unreachable store is a plain miss (never an exception,
never a quarantine), and after `breaker_failures` consecutive failures the circuit
breaker (object_io.py) answers misses immediately for `breaker_cooldown_s`.

Retention and space: the store's index decides what is live, exactly as for NVMe segments.
Expired or deleted blocks only leave packs sparse (delete() is a no-op). Compaction of a
sparse pack: rewrite_pack(old, live) PUTs a new pack with the live records copied verbatim
and returns their new Placements -> the caller commits the index -> remove_pack(old). A
crash between the steps leaves an unreferenced pack (a listed pack the index never
mentions), which GC removes. One writer per prefix: pack ids continue from the largest
listed id, like NVMe segments after a restart.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from kvcache.kvstore.block_format import RecordHeader, encode_header, verify_payload
from kvcache.kvstore.errors import BufferTooSmallError, CorruptBlockError, StoreError
from kvcache.kvstore.types import Tier
from kvcache.tiering.base import BlockTier, BlockWrite, CorruptCallback, Placement, TierUsage
from kvcache.tiering.codec_choice import CodecChoice
from kvcache.tiering.object_codec import ObjCodec, PayloadCodec, decode_header_any
from kvcache.tiering.config import ObjectConfig
from kvcache.tiering.object_io import CircuitBreaker, FsIO, ObjectStoreUnavailable, make_fs
from kvcache.tiering.object_pack import PackBuilder, pack_name, parse_pack_name, read_index
from kvcache.tiering.object_queue import DroppedCallback, StoredCallback, WriteBackQueue

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PackStat:
    size_bytes: int
    records: int = -1   # -1: not known to this process (listed, never indexed)


class ObjectTier(BlockTier):
    kind = Tier.OBJECT

    def __init__(self, config: ObjectConfig, on_corrupt: CorruptCallback | None = None,
                 on_stored: StoredCallback | None = None, on_dropped: DroppedCallback | None = None,
                 fs=None, on_missing: CorruptCallback | None = None):
        self.config = config
        self.fs = fs if fs is not None else make_fs(config)
        self.root = self.fs._strip_protocol(config.url).rstrip("/")
        self.pack_dir = f"{self.root}/packs"
        self._on_corrupt = on_corrupt or (lambda key, placement, why: None)
        self._on_missing = on_missing or self._on_corrupt   # a vanished pack is not corruption
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s)
        self.io = FsIO(self.fs, self.breaker, config.timeout_s)
        self.codec = PayloadCodec(config.zstd_level)
        self._lock = threading.Lock()
        self._counters: dict[str, float] = dict.fromkeys(
            ("records_encoded", "put_bytes_raw", "put_bytes_stored", "packs_uploaded", "upload_bytes",
             "upload_s", "upload_failures", "gets", "hits", "misses_unavailable", "corrupt", "dropped_writes",
             "dropped_bytes", "packs_removed", "torn_packs", "vanished"), 0)
        self._packs: dict[int, PackStat] = {}
        self._next_id: int | None = None      # learned from the first listing (lazily: no I/O here)
        self.codec_choice = CodecChoice(config)
        self._closed = False
        self._dirs_ready = False
        self._queue = WriteBackQueue(config, self.breaker, self._encode, self._upload, on_stored, on_dropped,
                                     self._count)

    def _count(self, **kw: float) -> None:
        with self._lock:
            for k, v in kw.items():
                self._counters[k] += v

    def path(self, pack_id: int) -> str:
        return f"{self.pack_dir}/{pack_name(pack_id)}"

    def _deadline(self, nbytes: int) -> float:
        return self.config.timeout_s + nbytes / self.config.min_bandwidth_bytes_s

    # ---------------------------------------------------------------- encoding
    def _encode(self, w: BlockWrite) -> tuple[bytes, object]:
        payload = memoryview(w.payload).cast("B")
        stored, used = self.codec.encode(payload, self.codec_choice.codec_for(w.layout))
        header = encode_header(w.key, w.namespace_id, w.layout, stored, payload.nbytes, w.created, used,
                               tenant=w.tenant)
        self._count(records_encoded=1, put_bytes_raw=payload.nbytes, put_bytes_stored=memoryview(stored).nbytes)
        if self.codec_choice.sampling:
            self._maybe_decide()
        return header, stored

    def _maybe_decide(self) -> None:
        """codec=auto, still sampling: decide if the numbers are in (tiering/codec_choice.py)."""
        with self._lock:
            up_b, up_s = self._counters["upload_bytes"], self._counters["upload_s"]
        self.codec_choice.maybe_decide(self.codec.totals(), up_b, up_s)

    # ---------------------------------------------------------------- writes
    def _alloc_id(self) -> int:
        with self._lock:
            known = self._next_id
        if known is None:
            self._ensure_dirs()
            self.list_packs()   # sets _next_id
        with self._lock:
            pid, self._next_id = self._next_id, self._next_id + 1
            return pid

    def _ensure_dirs(self) -> None:
        """Local storage needs its directory; object stores have no directories."""
        if not self._dirs_ready and self.config.split_url()[0] in ("file", "local"):
            self.io.call("makedirs", self.pack_dir, exist_ok=True)
        self._dirs_ready = True

    def _upload(self, builder: PackBuilder) -> int:
        """PUT one pack (retrying under the same id is an idempotent overwrite); its id."""
        pack_id = builder.pack_id or self._alloc_id()
        data = builder.finish(pack_id)
        t0 = time.perf_counter()
        try:
            self.io.call("pipe_file", self.path(pack_id), data, timeout=self._deadline(len(data)))
        except (ObjectStoreUnavailable, FileNotFoundError) as e:
            self._count(upload_failures=1)
            raise ObjectStoreUnavailable(str(e)) from e
        self._count(packs_uploaded=1, upload_bytes=len(data), upload_s=time.perf_counter() - t0)
        with self._lock:
            self._packs[pack_id] = PackStat(len(data), builder.count)
        if self.codec_choice.sampling:
            self._maybe_decide()
        return pack_id

    def put(self, writes: Sequence[BlockWrite]) -> list[Placement]:
        """Synchronous: PUT the writes as one or more packs, then return their Placements.
        Raises ObjectStoreUnavailable (a StoreError) when the store fails; nothing is then
        referenced (a pack that did land is unreferenced garbage for GC)."""
        if self._closed:
            raise StoreError("the object tier is closed")
        builders: list[PackBuilder] = []
        spots: list[tuple[int, int, int, int]] = []   # builder index, offset, record_len, stored len
        for w in writes:
            header, stored = self._encode(w)
            plen = memoryview(stored).nbytes
            b = builders[-1] if builders else None
            if b is None or (b.count and (b.size + len(header) + plen > self.config.pack_bytes
                                          or b.count >= self.config.pack_max_blocks)):
                builders.append(b := PackBuilder())
            spots.append((len(builders) - 1, b.add(header, stored), len(header) + plen, plen))
        ids = [self._upload(b) for b in builders]
        return [Placement(ids[bi], off, rlen, plen) for bi, off, rlen, plen in spots]

    def enqueue(self, writes: Sequence[BlockWrite]) -> int:
        """Queue copies for background upload; returns how many were accepted. Landed writes
        are reported through on_stored, dropped ones through on_dropped."""
        if self._closed:
            raise StoreError("the object tier is closed")
        return self._queue.enqueue(writes)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every enqueued write has landed or been dropped; False on timeout."""
        return self._queue.flush(timeout)

    def put_tombstones(self, keys: Sequence[bytes], deleted_at: float) -> set[int]:
        """Durable delete markers (one small pack) so a rebuild from packs does not resurrect
        deleted blocks; rebuild() yields them with header.is_tombstone set."""
        from kvcache.kvstore.block_format import FLAG_TOMBSTONE
        b = PackBuilder()
        for key in keys:
            b.add(encode_header(key, bytes(16), (), b"", 0, deleted_at, ObjCodec.RAW, FLAG_TOMBSTONE), b"")
        return {self._upload(b)} if b.count else set()

    # ---------------------------------------------------------------- reads
    def read_record(self, key: bytes, placement: Placement | None) -> tuple[RecordHeader, memoryview] | None:
        """The verified header and stored payload of `key`'s record, or None (a miss)."""
        if placement is None or placement.record_len <= 0:
            return None
        self._count(gets=1)
        p = placement
        try:
            raw = self.io.call("cat_file", self.path(p.segment_id), start=p.offset, end=p.offset + p.record_len,
                               timeout=self._deadline(p.record_len))
        except FileNotFoundError:   # deleted by a lifecycle rule or by hand: a miss, the copy is forgotten
            self._count(vanished=1)
            self._on_missing(key, p, f"pack {p.segment_id} is gone from the bucket")
            return None
        except ObjectStoreUnavailable:
            self._count(misses_unavailable=1)
            return None
        try:
            if len(raw) != p.record_len:
                raise CorruptBlockError(f"short read: {len(raw)} of {p.record_len} bytes")
            header = decode_header_any(raw)
            if (header.key != key or header.record_len != p.record_len or header.is_tombstone
                    or p.payload_len not in (header.payload_len, header.raw_len)):
                raise CorruptBlockError("record does not hold the requested block")
            body = memoryview(raw)[header.header_len:]
            verify_payload(header, body)
        except CorruptBlockError as e:
            return self._corrupt(key, p, f"pack {p.segment_id} offset {p.offset}: {e}")
        return header, body

    def _corrupt(self, key: bytes, placement: Placement, why: str) -> None:
        self._count(corrupt=1)
        self._on_corrupt(key, placement, why)
        return None

    def get(self, key: bytes, placement: Placement | None = None) -> bytes | None:
        got = self.read_record(key, placement)
        if got is None:
            return None
        try:
            data = self.codec.decode(*got)
        except CorruptBlockError as e:
            return self._corrupt(key, placement, str(e))
        self._count(hits=1)
        return data

    def get_into(self, key: bytes, placement: Placement | None, out) -> int | None:
        dst = memoryview(out).cast("B")
        if placement is not None and dst.nbytes < placement.payload_len:
            raise BufferTooSmallError(f"output buffer holds {dst.nbytes} bytes, block has {placement.payload_len}")
        got = self.read_record(key, placement)
        if got is None:
            return None
        header, body = got
        if dst.nbytes < header.raw_len:
            raise BufferTooSmallError(f"output buffer holds {dst.nbytes} bytes, block has {header.raw_len}")
        try:
            self.codec.decode_into(header, body, dst)
        except CorruptBlockError as e:
            return self._corrupt(key, placement, str(e))
        self._count(hits=1)
        return header.raw_len

    def delete(self, key: bytes, placement: Placement | None = None) -> None:
        """Packs are immutable: the index forgets the block and compaction reclaims it."""

    # ---------------------------------------------------------------- packs, GC, rebuild
    def list_packs(self) -> dict[int, int]:
        """pack id -> object size, from one listing (raises ObjectStoreUnavailable)."""
        self.fs.invalidate_cache(self.pack_dir)
        try:
            entries = self.io.call("ls", self.pack_dir, detail=True, refresh=True)
        except FileNotFoundError:
            entries = []
        packs = {pid: int(e.get("size") or 0) for e in entries
                 if (pid := parse_pack_name(e["name"])) is not None}
        with self._lock:
            for pid, size in packs.items():
                old = self._packs.get(pid)
                self._packs[pid] = PackStat(size, old.records if old else -1)
            for pid in set(self._packs) - set(packs):
                del self._packs[pid]
            floor = max(packs, default=0) + 1
            self._next_id = max(self._next_id or 0, floor)
        return packs

    def pack_usage(self) -> dict[int, PackStat]:
        """Packs known to this process (listed or written here): size and record count.
        Live bytes per pack belong to the store's index, as for NVMe segments."""
        with self._lock:
            return dict(self._packs)

    def remove_pack(self, pack_id: int) -> None:
        """Delete a pack the index no longer references (compaction's / GC's last step)."""
        try:
            self.io.call("rm_file", self.path(pack_id))
        except FileNotFoundError:
            pass
        with self._lock:
            self._packs.pop(pack_id, None)
        self._count(packs_removed=1)

    delete_pack = remove_pack

    def pack_index(self, pack_id: int, size: int):
        """The index entries of one pack (raises CorruptBlockError for a torn/damaged pack)."""
        path = self.path(pack_id)
        return read_index(lambda s, e: self.io.call("cat_file", path, start=s, end=e, timeout=self._deadline(e - s)),
                          size, self.config.index_tail_bytes)

    def rebuild(self) -> Iterator[tuple[bytes, Placement, RecordHeader]]:
        """(key, placement, header) of every record in every pack, in pack-id order, from the
        pack indexes only (no payload reads). Tombstones come with header.is_tombstone set;
        apply kvstore/rebuild.py's rule. A damaged pack is logged, counted and skipped; an
        unreachable store raises ObjectStoreUnavailable (retry the rebuild later)."""
        for pid, size in sorted(self.list_packs().items()):
            try:
                entries = self.pack_index(pid, size)
            except CorruptBlockError as e:
                log.error("object pack %d is unreadable (%s); skipped", pid, e)
                self._count(torn_packs=1)
                continue
            with self._lock:
                self._packs[pid] = PackStat(size, len(entries))
            for e in entries:
                h = e.header
                yield h.key, Placement(pid, e.offset, h.record_len, h.payload_len), h

    def rewrite_pack(self, pack_id: int, live: Iterable[tuple[bytes, Placement]]) -> dict[bytes, Placement]:
        """Compaction step 1: copy the records of `live` (key, placement in `pack_id`) verbatim
        into a new pack (one GET of the old pack, one PUT). Returns their new placements;
        the caller commits them, then calls remove_pack(pack_id)."""
        want = {p.offset: key for key, p in live if p.segment_id == pack_id}
        if not want:
            return {}
        path = self.path(pack_id)
        data = self.io.call("cat_file", path, timeout=self._deadline(self.config.pack_bytes))
        entries = read_index(lambda s, e: data[s:e], len(data), len(data))
        b, spots = PackBuilder(), {}
        for e in entries:
            h = e.header
            if want.get(e.offset) != h.key:
                continue
            rec = memoryview(data)[e.offset: e.offset + h.record_len]
            try:
                if decode_header_any(rec) != h:
                    raise CorruptBlockError("record header differs from the pack index")
                verify_payload(h, rec[h.header_len:])
            except CorruptBlockError as err:
                self._corrupt(h.key, Placement(pack_id, e.offset, h.record_len, h.payload_len), str(err))
                continue
            spots[h.key] = (b.add(rec[: h.header_len], rec[h.header_len:]), h.record_len, h.payload_len)
        if not b.count:
            return {}
        new_id = self._upload(b)
        return {k: Placement(new_id, off, rl, pl) for k, (off, rl, pl) in spots.items()}

    # ---------------------------------------------------------------- namespaces, stats
    def save_namespaces(self, descriptors: dict[str, dict]) -> None:
        """Namespace descriptors beside the packs, so an index rebuilt from packs knows them."""
        self._ensure_dirs()
        self.io.call("pipe_file", f"{self.root}/namespaces.json",
                     json.dumps(descriptors, sort_keys=True, indent=1).encode())

    def load_namespaces(self) -> dict[str, dict]:
        try:
            raw = json.loads(self.io.call("cat_file", f"{self.root}/namespaces.json"))
        except FileNotFoundError:
            return {}
        except ValueError as e:
            log.error("namespaces.json under %s is unreadable (%s)", self.root, e)
            return {}
        return {k: v for k, v in raw.items() if isinstance(v, dict)} if isinstance(raw, dict) else {}

    def usage(self) -> TierUsage:
        with self._lock:
            packs = list(self._packs.values())
        blocks = sum(p.records for p in packs) if all(p.records >= 0 for p in packs) else -1
        return TierUsage(Tier.OBJECT, blocks, sum(p.size_bytes for p in packs), self.config.capacity_bytes)

    def stats(self) -> dict:
        with self._lock:
            c = dict(self._counters)
        t = self.codec.totals()
        return {
            **{k: int(v) if k != "upload_s" else round(v, 3) for k, v in c.items()},
            "upload_MBps": round(c["upload_bytes"] / c["upload_s"] / 1e6, 2) if c["upload_s"] else 0.0,
            "stored_ratio": round(c["put_bytes_raw"] / c["put_bytes_stored"], 3) if c["put_bytes_stored"] else 0.0,
            "codec": self.config.codec, "codec_auto": self.codec_choice.snapshot(),
            "zstd_ratio": round(t["ratio"], 3), "zstd_compress_MBps": round(t["compress_MBps"], 1),
            "zstd_decompress_MBps": round(t["decompress_MBps"], 1),
            "breaker": self.breaker.snapshot(), **self._queue.snapshot(),
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.close(self.config.close_timeout_s)
        self.io.close()
