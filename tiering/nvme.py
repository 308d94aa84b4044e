"""The NVMe tier: block records appended to segment files in one directory.

Write path (the order is the durability contract):

    put(writes) ── append records to the active segment (pwritev, or O_DIRECT from an
                   aligned staging buffer)
                ── fsync per policy ("always": before returning)
                ── return Placements ──> the store commits them to the index
    A failed write (ENOSPC, EIO) truncates the segment back, so nothing half-written
    is ever referenced.

Reads (tiering/nvme_reads.py) are one preadv of header and payload straight into the
caller's buffer, then the header checksum, the key and the payload checksum are verified;
any mismatch is a miss, reported through `on_corrupt` so the store can quarantine the block.
Namespace descriptors are kept beside the segments (tiering/namespace_file.py).

Capacity: the bound that eviction works against is the configured capacity or what the
filesystem can still hold (segments written + free space), whichever
is smaller, so GC makes room before writes fail even when the disk is smaller than configured.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from typing import Callable, Sequence

from kvcache.kvstore.block_format import FLAG_TOMBSTONE, Codec, encode_header
from kvcache.kvstore.durable import fsync_dir, fsync_file
from kvcache.kvstore.errors import StoreError, TierFullError
from kvcache.kvstore.types import Tier
from kvcache.tiering import namespace_file
from kvcache.tiering.base import BlockTier, BlockWrite, CorruptCallback, Placement, TierUsage
from kvcache.tiering.config import NvmeConfig
from kvcache.tiering.nvme_reads import NvmeReads, file_size
from kvcache.tiering.segment_readers import SegmentReaders
from kvcache.tiering.space_reserve import SpaceReserve
from kvcache.tiering.segment import (
    HEAD_BYTES, align_up, encode_head, parse_segment_name, segment_name,
)

log = logging.getLogger(__name__)
_IOV_MAX = 512
_WRITEBACK_CHUNK = 4 << 20   # with fsync "always", start writeback every 4 MiB of a batch


def _load_sync_file_range():
    """libc sync_file_range (Linux), or None: lets the disk work while a put is still encoding."""
    try:
        import ctypes
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


class NvmeTier(NvmeReads, BlockTier):
    kind = Tier.NVME

    def __init__(self, root: str, config: NvmeConfig, on_corrupt: CorruptCallback | None = None,
                 clock: Callable[[], float] = time.time):
        self.root = root
        self.config = config
        self.align = 4096 if config.o_direct else 8
        self._on_corrupt = on_corrupt or (lambda key, placement, why: None)
        self._clock = clock
        self._write_lock = threading.Lock()
        self.readers = SegmentReaders(self.path)
        self._staging = mmap.mmap(-1, 8 << 20) if config.o_direct else None
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create the NVMe tier directory {root}: {e.strerror}") from e
        if not os.access(root, os.W_OK):
            raise StoreError(f"the NVMe tier directory {root} is not writable; fix its permissions "
                             "or point data_dir somewhere writable")
        ids = self.segment_ids()
        # Never append to a segment a crash may have torn: always start a fresh one.
        self._active_id = (max(ids) + 1) if ids else 1
        self._active_fd = -1
        self._active_end = 0
        self._sealed_bytes = sum(file_size(self.path(i)) for i in ids)
        self._sealed_sizes: dict[int, int] = {}     # segment id -> size, for holds_extent
        self.reserve = SpaceReserve(os.path.join(root, "reserve.bin"), config.reserve_bytes)
        self._keep_reserve(self.free_bytes())   # allocates the delete reserve if the disk is low already
        self._last_sync = clock()
        self._unsynced = False

    # ---------------------------------------------------------------- segments
    def path(self, segment_id: int) -> str:
        return os.path.join(self.root, segment_name(segment_id))

    def segment_ids(self) -> list[int]:
        ids = (parse_segment_name(n) for n in os.listdir(self.root))
        return sorted(i for i in ids if i is not None)

    @property
    def active_segment(self) -> int:
        return self._active_id

    def _open_active(self) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if self.config.o_direct:
            flags |= os.O_DIRECT
        path = self.path(self._active_id)
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            raise _tier_error(e, self.root) from e
        try:
            head = encode_head(self._active_id, self.align, self._clock())
            if self._staging is not None:  # O_DIRECT: write from page-aligned memory
                self._staging[: len(head)] = head
                head = memoryview(self._staging)[: len(head)]
            self._pwrite_all(fd, [head], 0)
            if self.config.fsync != "never":
                os.fsync(fd)
                fsync_dir(self.root)
        except BaseException as e:
            os.close(fd)
            os.unlink(path)
            if isinstance(e, OSError):
                raise _tier_error(e, self.root) from e
            raise
        self._active_fd, self._active_end = fd, HEAD_BYTES

    def _seal_active(self) -> None:
        if self._active_fd >= 0:
            if self.config.fsync != "never":
                os.fsync(self._active_fd)
            os.close(self._active_fd)
            self._sealed_bytes += file_size(self.path(self._active_id))
            self._active_fd = -1
            self._active_id += 1

    def remove_segment(self, segment_id: int) -> None:
        """Unlink a segment the index no longer references (compaction's last step)."""
        if segment_id == self._active_id:
            raise StoreError("cannot remove the active segment")
        size = file_size(self.path(segment_id))
        try:
            os.unlink(self.path(segment_id))
            self._sealed_bytes -= size
            self._sealed_sizes.pop(segment_id, None)
        except FileNotFoundError:
            pass
        # after the unlink: a reader that opened it in between is detached here (its fd closes when
        # it is done), and one that comes later finds no file; dropped first, such an fd stayed cached
        self.readers.drop(segment_id)

    # ---------------------------------------------------------------- writes
    def put(self, writes: Sequence[BlockWrite]) -> list[Placement]:
        with self._write_lock:
            placements: list[Placement] = []
            batch: list[tuple[bytes, memoryview]] = []
            batch_start = self._active_end
            for w in writes:
                payload = memoryview(w.payload).cast("B")
                header = encode_header(w.key, w.namespace_id, w.layout, payload, payload.nbytes, w.created, Codec.RAW,
                                       tenant=w.tenant)
                rec_len = len(header) + payload.nbytes
                if self._active_fd < 0 or (self._active_end + rec_len > self.config.segment_bytes
                                           and self._active_end > HEAD_BYTES):
                    self._write_batch(batch, batch_start)
                    batch = []
                    self._seal_active()
                    self._open_active()
                    batch_start = self._active_end
                placements.append(Placement(self._active_id, self._active_end, rec_len, payload.nbytes))
                batch.append((header, payload))
                self._active_end = align_up(self._active_end + rec_len, self.align)
            self._write_batch(batch, batch_start)
            self._sync_after_put()
            return placements

    def put_tombstones(self, keys: Sequence[bytes], deleted_at: float) -> set[int]:
        """Durable delete markers, so an index rebuilt from segments does not resurrect
        deleted blocks (see kvstore/rebuild.py for the ordering rule). Returns the segments
        written, for the index's segment table."""
        ns = bytes(16)
        with self._write_lock:
            if self._active_fd < 0:
                self._open_active()
            start, batch = self._active_end, []
            for key in keys:
                header = encode_header(key, ns, (), b"", 0, deleted_at, Codec.RAW, FLAG_TOMBSTONE)
                batch.append((header, memoryview(b"")))
                self._active_end = align_up(self._active_end + len(header), self.align)
            self._write_batch(batch, start)
            self._sync_after_put()
            return {self._active_id}

    def _write_batch(self, batch: list[tuple[bytes, memoryview]], start: int) -> None:
        if not batch:
            return
        try:
            if self.config.o_direct:
                self._write_direct(batch, start)
            else:
                self._write_buffered(batch, start)
        except OSError as e:
            self._rollback(start)
            raise _tier_error(e, self.root) from e

    def _write_buffered(self, batch: list[tuple[bytes, memoryview]], start: int) -> None:
        """pwritev the batch; with fsync "always", in ~4 MiB pieces whose writeback starts at
        once (sync_file_range WRITE, non-blocking), so the closing fdatasync waits for the tail only."""
        early = self.config.fsync == "always" and _sync_file_range is not None
        bufs, pos, pending = [], start, 0
        for header, payload in batch:
            pad = align_up(len(header) + payload.nbytes, self.align) - len(header) - payload.nbytes
            bufs += [header, payload] + ([bytes(pad)] if pad else [])
            pending += len(header) + payload.nbytes + pad
            if early and pending >= _WRITEBACK_CHUNK:
                self._pwrite_all(self._active_fd, bufs, pos)
                _sync_file_range(self._active_fd, pos, pending, _SYNC_FILE_RANGE_WRITE)
                bufs, pos, pending = [], pos + pending, 0
        if bufs:
            self._pwrite_all(self._active_fd, bufs, pos)

    def _rollback(self, start: int) -> None:
        self._active_end = start
        try:
            os.ftruncate(self._active_fd, start)
        except OSError:
            log.exception("could not truncate %s after a failed write", self.path(self._active_id))
            self._seal_active()  # the tail is unknown: never append after it

    @staticmethod
    def _pwrite_all(fd: int, bufs: list, offset: int) -> None:
        views = [memoryview(b).cast("B") for b in bufs if memoryview(b).nbytes]
        while views:
            n = os.pwritev(fd, views[:_IOV_MAX], offset)
            offset += n
            while views and n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]

    def _write_direct(self, batch: list[tuple[bytes, memoryview]], start: int) -> None:
        """O_DIRECT needs aligned buffers: copy records through the aligned staging map."""
        stage = memoryview(self._staging)
        fill, offset = 0, start
        for header, payload in batch:
            for part in (memoryview(header), payload):
                while part.nbytes:
                    n = min(part.nbytes, len(stage) - fill)
                    stage[fill: fill + n] = part[:n]
                    fill, part = fill + n, part[n:]
                    if fill == len(stage):
                        self._pwrite_all(self._active_fd, [stage], offset)
                        offset, fill = offset + fill, 0
            pad = align_up(fill, self.align) - fill
            stage[fill: fill + pad] = bytes(pad)
            fill += pad
        if fill:
            self._pwrite_all(self._active_fd, [stage[:fill]], offset)

    def _sync_after_put(self) -> None:
        policy, now = self.config.fsync, self._clock()
        if policy == "always" or (policy == "interval" and now - self._last_sync >= self.config.fsync_interval_s):
            os.fdatasync(self._active_fd)
            self._last_sync, self._unsynced = now, False
        else:
            self._unsynced = True

    def sync(self, segments=()) -> None:
        """Make what was written durable. `segments`: also these segments' files and their
        directory entries, whatever the fsync policy (compaction's copies must be on disk before
        the index names them, even when one filled a segment that was sealed without an fsync)."""
        with self._write_lock:
            for sid in set(segments) - {self._active_id}:
                try:
                    fsync_file(self.path(sid))
                except FileNotFoundError:     # removed meanwhile: nothing of it left to sync
                    continue
            if self._active_fd >= 0 and (self._unsynced or segments):
                os.fdatasync(self._active_fd)
                self._unsynced = False
            if segments:
                fsync_dir(self.root)

    # ---------------------------------------------------------------- namespaces
    def save_namespaces(self, descriptors: dict[str, dict]) -> None:
        """Keep namespace descriptors beside the data, so a rebuilt index knows them."""
        try:
            namespace_file.save(self.root, descriptors)
        except OSError as e:
            raise _tier_error(e, self.root) from e

    def load_namespaces(self) -> dict[str, dict]:
        return namespace_file.load(self.root)

    # ---------------------------------------------------------------- misc
    def delete(self, key: bytes, placement: Placement | None = None) -> None:
        """Records are immutable: the index forgets the block and compaction reclaims it."""

    def disk_bytes(self) -> int:
        """Bytes of all segment files (tracked, not stat'ed: cheap enough for every put)."""
        return self._sealed_bytes + (self._active_end if self._active_fd >= 0 else 0)

    def capacity_bytes(self) -> int:
        """The bound eviction works against: nvme.capacity_bytes, or less when the filesystem
        cannot hold that much (the index and other files share it). One statvfs, ~1 us; a pure
        getter (stats and usage call it): the delete reserve is kept by is_over_watermark."""
        return self._capacity_from(self.free_bytes())

    def _capacity_from(self, free: int) -> int:
        """capacity_bytes given the filesystem's free bytes (-1: unknown, the configured bound)."""
        if free < 0:
            return self.config.capacity_bytes
        return max(0, min(self.config.capacity_bytes, self.disk_bytes() + free))

    def _keep_reserve(self, free: int) -> None:
        """Allocate the delete reserve if the disk is low (free < 0: statvfs failed, leave it)."""
        if free >= 0:
            self.reserve.keep(free)

    def free_bytes(self) -> int:
        """What the filesystem under the tier can still take (-1: statvfs failed)."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return -1
        return st.f_bavail * st.f_frsize

    def is_over_watermark(self) -> bool:
        """Checked on each put: keeps the delete reserve and compares against the capacity,
        from one statvfs."""
        free = self.free_bytes()
        self._keep_reserve(free)
        return self.disk_bytes() > self.config.high_watermark * self._capacity_from(free)

    def usage(self) -> TierUsage:
        return TierUsage(Tier.NVME, -1, self.disk_bytes(), self.capacity_bytes())

    def close(self) -> None:
        with self._write_lock:
            self._seal_active()
        self.readers.close_all()
        if self._staging is not None:
            self._staging.close()


def _tier_error(e: OSError, root: str) -> StoreError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return TierFullError(f"NVMe tier at {root}: the disk is full; free space or lower "
                             "nvme.capacity_bytes so eviction starts earlier")
    if e.errno == errno.EROFS:
        return StoreError(f"NVMe tier at {root}: the filesystem is read-only; remount it read-write "
                          "or point data_dir somewhere writable")
    return StoreError(f"NVMe tier write failed at {root}: {e.strerror}")
