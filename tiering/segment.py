"""Append-only segment files: the on-disk layout of the NVMe tier.

    seg-00000007.kvs
    ┌──────────────┬───────────────────┬─────┬───────────────────┬─────┬──── ...
    │ segment head │ record (hdr|data) │ pad │ record (hdr|data) │ pad │
    │  4096 bytes  │ kvstore/block_format.py │   │                   │     │
    └──────────────┴───────────────────┴─────┴───────────────────┴─────┴──── ...

Records start on `align` boundaries (8 bytes, or 4096 with O_DIRECT). Records are never
rewritten in place: a segment only grows until it is sealed, and space comes back only by
compaction (copy the live records forward, commit the index, then unlink the segment).
Because each record describes itself, the index can be rebuilt by scanning; a scan stops
at the first record that does not verify (a torn tail after a crash).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Iterator

from kvcache.kvstore.block_format import RecordHeader, decode_header, peek_header_len, verify_payload
from kvcache.kvstore.errors import CorruptBlockError

SEGMENT_MAGIC = b"KVCSEG01"
HEAD_BYTES = 4096
_HEAD = struct.Struct("<8sIIId")  # magic, version, segment id, align, created


def segment_name(segment_id: int) -> str:
    return f"seg-{segment_id:08d}.kvs"


def parse_segment_name(name: str) -> int | None:
    if name.startswith("seg-") and name.endswith(".kvs") and name[4:-4].isdigit():
        return int(name[4:-4])
    return None


def align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def encode_head(segment_id: int, align: int, created: float) -> bytes:
    head = _HEAD.pack(SEGMENT_MAGIC, 1, segment_id, align, created)
    return head + bytes(HEAD_BYTES - len(head))


@dataclass(frozen=True, slots=True)
class SegmentHead:
    segment_id: int
    align: int
    created: float


def read_head(fd: int) -> SegmentHead:
    raw = os.pread(fd, _HEAD.size, 0)
    if len(raw) < _HEAD.size:
        raise CorruptBlockError("segment shorter than its header")
    magic, version, sid, align, created = _HEAD.unpack(raw)
    if magic != SEGMENT_MAGIC or version != 1 or align <= 0 or align & (align - 1):
        raise CorruptBlockError("not a kvcache segment file")
    return SegmentHead(sid, align, created)


@dataclass(frozen=True, slots=True)
class ScannedRecord:
    """A record whose header verified; `error` is set when its payload did not."""

    offset: int
    header: RecordHeader
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ScanEnd:
    """Where a scan stopped: `valid_end` is the end of the last record with a good header;
    `skipped` counts bytes that held no verifiable header (torn or overwritten)."""

    valid_end: int
    file_size: int
    skipped: int
    error: str | None


def _resync(fd: int, pos: int, size: int, align: int) -> int | None:
    """Next aligned offset after `pos` where a verifiable header starts, or None."""
    chunk = 1 << 20
    probe = align_up(pos + 1, align)
    while probe < size:
        buf = os.pread(fd, min(chunk + 8, size - probe), probe)
        at = buf.find(b"KVCB")
        while at != -1:
            cand = probe + at
            if cand % align == 0:
                try:
                    hlen = peek_header_len(os.pread(fd, 8, cand))
                    decode_header(os.pread(fd, hlen, cand))
                    return cand
                except CorruptBlockError:
                    pass
            at = buf.find(b"KVCB", at + 1)
        probe += chunk
    return None


def scan(path: str, verify_payloads: bool = True, start: int = HEAD_BYTES) -> Iterator[ScannedRecord | ScanEnd]:
    """Yield every record with a verifiable header in file order, then one ScanEnd.

    A bad payload is reported on its record and skipped (its length is known); a bad
    header makes the scan look for the next aligned header, so one flipped bit never hides
    the records after it. A good header whose record runs past the end is a torn tail: the
    scan ends there. Bytes after the last good record are a torn tail.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        try:
            align = read_head(fd).align
        except CorruptBlockError as e:
            yield ScanEnd(0, size, size, str(e))
            return
        pos, valid_end, skipped, first_error = start, start, 0, None
        while pos < size:
            try:
                header = decode_header(os.pread(fd, peek_header_len(os.pread(fd, 8, pos)), pos))
            except CorruptBlockError as e:
                first_error = first_error or f"offset {pos}: {e}"
                nxt = _resync(fd, pos, size, align)
                skipped += (nxt if nxt is not None else size) - pos
                if nxt is None:
                    break
                pos = nxt
                continue
            if pos + header.record_len > size:
                # a good header whose record the file does not hold: a torn tail. Never look for
                # headers inside its extent: its payload is a client's bytes, and may hold a
                # well-formed record for another key (a rebuild would index it)
                first_error = first_error or f"offset {pos}: record runs past the end of the segment"
                skipped += size - pos
                break
            error = None
            if verify_payloads:
                try:
                    verify_payload(header, os.pread(fd, header.payload_len, pos + header.header_len))
                except CorruptBlockError as e:
                    error = str(e)
                    first_error = first_error or f"offset {pos}: {e}"
            yield ScannedRecord(pos, header, error)
            valid_end = pos + header.record_len
            pos = align_up(valid_end, align)
        yield ScanEnd(valid_end, size, skipped, first_error)
    finally:
        os.close(fd)
