"""The NVMe tier's read half: one preadv of header and payload, then verification.

A read checks the placement the index gave it against the segment file before it sizes any
buffer (a damaged size in the index must not become a large allocation), reads header and
payload straight into the caller's buffer, and verifies the header checksum, the key and the
payload checksum. Any mismatch is a miss reported through `on_corrupt`, so the store can
quarantine the block; an OSError is a miss without a quarantine (the machine, not the record).

`NvmeReads` is a mixin of `NvmeTier` (tiering/nvme.py), which provides `readers`, `path`,
`_on_corrupt`, `_active_id` and `_sealed_sizes`; it is not meant to be used on its own.
"""

from __future__ import annotations

import logging
import os

from kvcache.kvstore.block_format import MAX_HEADER, Codec, RecordHeader, decode_header, decode_payload, verify_payload
from kvcache.kvstore.errors import BufferTooSmallError, CorruptBlockError
from kvcache.tiering.base import Placement

log = logging.getLogger(__name__)


class NvmeReads:
    def read_record(self, key: bytes, placement: Placement, out=None) -> tuple[RecordHeader, memoryview] | None:
        """Header and payload view (into `out` when given and the codec is raw), or None."""
        try:
            with self.readers.open(placement.segment_id) as fd:
                if fd is None:
                    self._on_corrupt(key, placement, f"segment {placement.segment_id} is missing")
                    return None
                return self._read_at(fd, key, placement, out)
        except OSError as e:     # EMFILE, EIO opening it: the machine, not the record: a miss, no quarantine
            log.warning("cannot read segment %d: %s (a miss)", placement.segment_id, e.strerror or e)
            return None

    def _read_at(self, fd: int, key: bytes, placement: Placement, out) -> tuple[RecordHeader, memoryview] | None:
        try:
            # sizes come from the index: check them against the file before sizing a buffer
            hlen = placement.record_len - placement.payload_len
            if not 0 < hlen <= MAX_HEADER or placement.offset + placement.record_len > os.fstat(fd).st_size:
                raise CorruptBlockError(f"a {placement.record_len}-byte record does not fit in the segment")
            hbuf = bytearray(hlen)
            if out is not None and memoryview(out).nbytes >= placement.payload_len:
                body = memoryview(out).cast("B")[: placement.payload_len]
            else:
                body = memoryview(bytearray(placement.payload_len))
            got = os.preadv(fd, [hbuf, body], placement.offset)
            if got != placement.record_len:
                raise CorruptBlockError(f"short read: {got} of {placement.record_len} bytes")
            header = decode_header(hbuf)
            if header.key != key or header.payload_len != placement.payload_len or header.is_tombstone:
                raise CorruptBlockError("record does not hold the requested block")
            verify_payload(header, body)
        except CorruptBlockError as e:
            self._on_corrupt(key, placement, f"segment {placement.segment_id} offset {placement.offset}: {e}")
            return None
        except OSError as e:     # the disk, not the record: a miss this time, not a quarantine
            log.warning("read error in segment %d at %d: %s (a miss)", placement.segment_id, placement.offset,
                        e.strerror)
            return None
        return header, body

    def dup_reader(self, segment_id: int) -> int | None:
        """A read-only descriptor of the segment that the caller owns (and closes), or None
        (the segment is gone: compacted away). Records are never rewritten in place, so what
        a placement read from the index names stays readable through it."""
        try:
            with self.readers.open(segment_id) as fd:
                return None if fd is None else os.dup(fd)
        except OSError as e:     # EMFILE: the block is promoted the usual way instead
            log.warning("cannot share segment %d: %s", segment_id, e.strerror or e)
            return None

    def holds_extent(self, p: Placement) -> bool:
        """Whether segment `p.segment_id` can hold a record at `p` (sizes from the index are checked
        before a reader allocates for them). A missing segment passes: the read reports it."""
        hlen = p.record_len - p.payload_len
        if not 0 < hlen <= MAX_HEADER:
            return False
        active = self._active_id            # read first: a segment below it is sealed and never grows
        size = self._sealed_sizes.get(p.segment_id) if p.segment_id < active else None
        if size is None:
            size = file_size(self.path(p.segment_id), missing=-1)
            if size < 0:
                return True
            if p.segment_id < active:
                self._sealed_sizes[p.segment_id] = size
        return p.offset + p.record_len <= size

    def get(self, key: bytes, placement: Placement | None = None) -> bytes | None:
        got = self.read_record(key, placement)
        if got is None:
            return None
        header, body = got
        return bytes(decode_payload(header, body))

    def read_into(self, key: bytes, placement: Placement, out) -> RecordHeader | None:
        """Read and verify a block into `out`; its header (payload length, layout), or None."""
        dst = memoryview(out).cast("B")
        if dst.nbytes < placement.payload_len:
            raise BufferTooSmallError(f"output buffer holds {dst.nbytes} bytes, block has {placement.payload_len}")
        got = self.read_record(key, placement, dst)
        if got is None:
            return None
        header, body = got
        if header.codec is not Codec.RAW:
            data = decode_payload(header, body)
            dst[: len(data)] = data
        return header

    def get_into(self, key: bytes, placement: Placement | None, out) -> int | None:
        header = self.read_into(key, placement, out)
        return None if header is None else header.raw_len


def file_size(path: str, missing: int = 0) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return missing
