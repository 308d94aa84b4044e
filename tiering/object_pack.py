"""Packs: the object-storage layout of the object tier (many block records per object).

    <root>/packs/pack-0000000007.kvp
    ┌───────────┬──────────────────────┬──────────────────────┬─────┬─────────────┬─────────┐
    │ pack head │ record 0 (hdr|data)  │ record 1 (hdr|data)  │ ... │ pack index  │ trailer │
    │  64 bytes │ kvstore/block_format │                      │     │             │ 40 bytes│
    └───────────┴──────────────────────┴──────────────────────┴─────┴─────────────┴─────────┘
    head     magic b"KVCPACK1", u32 version, u32 pack id, f64 created, zero padding
    record   exactly the NVMe tier's record: header (key, layout, codec, checksums) + payload
    index    per record: u64 offset, then a copy of its header bytes (self-delimiting,
             checksummed on its own), so a rebuild learns key, namespace, layout, lengths
             and codec of every record without reading a payload
    trailer  magic b"KVCPIDX1", u32 version, u32 record count, u64 index offset,
             u64 index length, xxh3-64 of (index ‖ first 32 trailer bytes)

A pack is written by one PUT, so it is visible whole or not at all (S3 semantics; the
local backend may leave a torn file after a crash, which has no valid trailer and is
reported by `read_index`). Packs are immutable: space comes back by compaction (copy the
live records into a new pack, commit the index, then delete the old pack).

A read is one ranged GET of [offset, offset + record_len): header and payload, verified
like every persistent-tier read. A rebuild is one GET of the pack's tail per pack (the
index usually fits in `tail_bytes`; a second ranged GET fetches the rest otherwise).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Callable

import xxhash

from kvcache.kvstore.block_format import RecordHeader, peek_header_len
from kvcache.kvstore.errors import CorruptBlockError
from kvcache.tiering.object_codec import decode_header_any

PACK_MAGIC = b"KVCPACK1"
INDEX_MAGIC = b"KVCPIDX1"
PACK_VERSION = 1
HEAD_BYTES = 64
_HEAD = struct.Struct("<8sIId")
_TRAILER = struct.Struct("<8sIIQQ")
TRAILER_BYTES = _TRAILER.size + 8
_OFF = struct.Struct("<Q")
MAX_PACK_ID = 0xFFFF_FFFF   # BlockMeta keeps segment ids as u32


def pack_name(pack_id: int) -> str:
    return f"pack-{pack_id:010d}.kvp"


def parse_pack_name(name: str) -> int | None:
    base = name.rsplit("/", 1)[-1]
    if base.startswith("pack-") and base.endswith(".kvp") and base[5:-4].isdigit():
        return int(base[5:-4])
    return None


@dataclass(frozen=True, slots=True)
class IndexEntry:
    offset: int
    header: RecordHeader


class PackBuilder:
    """Accumulates records into one pack buffer; `finish(pack_id)` stamps the id into the
    head and appends index and trailer. The id is chosen at upload time, so a failed
    upload can be retried under the same id (an idempotent overwrite)."""

    def __init__(self, created: float | None = None):
        head = _HEAD.pack(PACK_MAGIC, PACK_VERSION, 0, time.time() if created is None else created)
        self.buf = bytearray(head + bytes(HEAD_BYTES - len(head)))
        self._index = bytearray()
        self.pack_id: int | None = None
        self.count = 0
        self.payload_bytes = 0
        self.first_added = 0.0

    @property
    def size(self) -> int:
        """Bytes so far, including the index and trailer `finish()` will add."""
        return len(self.buf) + len(self._index) + (0 if self.pack_id else TRAILER_BYTES)

    def add(self, header: bytes, payload) -> int:
        """Append one record (header bytes, stored payload); returns its offset."""
        assert self.pack_id is None, "pack already finished"
        if not self.count:
            self.first_added = time.monotonic()
        offset = len(self.buf)
        self.buf += header
        self.buf += payload
        self._index += _OFF.pack(offset)
        self._index += header
        self.count += 1
        self.payload_bytes += memoryview(payload).nbytes
        return offset

    def finish(self, pack_id: int) -> bytearray:
        """The whole pack object. Idempotent for the same id."""
        if self.pack_id is None:
            if not 0 < pack_id <= MAX_PACK_ID:
                raise ValueError(f"pack id {pack_id} out of range 1..{MAX_PACK_ID}")
            struct.pack_into("<I", self.buf, 12, pack_id)
            index_off = len(self.buf)
            fixed = _TRAILER.pack(INDEX_MAGIC, PACK_VERSION, self.count, index_off, len(self._index))
            self.buf += self._index
            self.buf += fixed + xxhash.xxh3_64_digest(bytes(self._index) + fixed)
            self._index = bytearray()
            self.pack_id = pack_id
        elif pack_id != self.pack_id:
            raise ValueError(f"pack already finished as {self.pack_id}")
        return self.buf


def parse_head(raw) -> int:
    """The pack id from a pack's first bytes."""
    if len(raw) < _HEAD.size:
        raise CorruptBlockError("pack shorter than its head")
    magic, version, pack_id, _ = _HEAD.unpack_from(raw)
    if magic != PACK_MAGIC or version != PACK_VERSION:
        raise CorruptBlockError("not a kvcache pack")
    return pack_id


def read_index(read_range: Callable[[int, int], bytes], size: int, tail_bytes: int = 64 << 10) -> list[IndexEntry]:
    """The records of a pack of `size` bytes, from its index: `read_range(start, end)` returns
    those bytes of the object. Raises CorruptBlockError when trailer or index do not verify."""
    if size < HEAD_BYTES + TRAILER_BYTES:
        raise CorruptBlockError(f"pack of {size} bytes is too short (torn upload?)")
    start = max(HEAD_BYTES, size - max(tail_bytes, TRAILER_BYTES))
    tail = read_range(start, size)
    if len(tail) != size - start:
        raise CorruptBlockError("short read of the pack tail")
    fixed, digest = tail[-TRAILER_BYTES:-8], tail[-8:]
    magic, version, count, index_off, index_len = _TRAILER.unpack(fixed)
    if magic != INDEX_MAGIC or version != PACK_VERSION:
        raise CorruptBlockError("pack has no valid trailer (torn upload?)")
    if index_off < HEAD_BYTES or index_off + index_len + TRAILER_BYTES != size:
        raise CorruptBlockError("pack trailer disagrees with the object size")
    if index_off >= start:
        index = tail[index_off - start: index_off - start + index_len]
    else:
        index = read_range(index_off, index_off + index_len)
    if len(index) != index_len or xxhash.xxh3_64_digest(bytes(index) + fixed) != digest:
        raise CorruptBlockError("pack index checksum mismatch")
    return parse_index(index, count, index_off)


def parse_index(index, count: int, records_end: int) -> list[IndexEntry]:
    mv = memoryview(index)
    out, pos = [], 0
    while pos < mv.nbytes:
        if pos + 8 > mv.nbytes:
            raise CorruptBlockError("truncated pack index")
        (offset,) = _OFF.unpack_from(mv, pos)
        hlen = peek_header_len(mv[pos + 8: pos + 16])
        header = decode_header_any(mv[pos + 8: pos + 8 + hlen])
        if not HEAD_BYTES <= offset or offset + header.record_len > records_end:
            raise CorruptBlockError(f"pack index entry at {offset} runs outside the records")
        out.append(IndexEntry(offset, header))
        pos += 8 + hlen
    if len(out) != count:
        raise CorruptBlockError(f"pack index holds {len(out)} records, trailer says {count}")
    return out
