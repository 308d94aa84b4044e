"""The self-describing block record, as written to persistent tiers.

    offset  size  field
    0       4     magic b"KVCB"
    4       2     format version (1)
    6       2     header length H (bytes, including both checksums)
    8       1     codec (0 raw, 1 zstd, 2 zstd of byte-shuffled 16-bit words)
    9       1     flags (bit 0: tombstone)
    10      1     key length K
    11      1     number of tensors T
    12      8     payload length as stored
    20      8     raw payload length (after decoding)
    28      8     created (float64 seconds)
    36      16    namespace id
    52      K     block key
    ..      ..    T x tensor spec: u8 name len, name, u8 dtype len, dtype, u8 ndim, ndim x u64
    ..      ..    version 2 only: u16 tenant length, tenant (UTF-8): whose block, for a rebuilt
                  index's quotas and retention (a block of no tenant is written as version 1)
    H-24    16    xxh3-128 of the stored payload
    H-8     8     xxh3-64 of header bytes [0, H-8)
    H       ...   payload

A reader trusts nothing before both checksums match and the key is the one it asked for;
any mismatch raises CorruptBlockError, which the store turns into a miss plus quarantine.
"""

from __future__ import annotations

import enum
import functools
import struct
from dataclasses import dataclass

import xxhash

from kvcache.kvstore.errors import BlockFormatError, CorruptBlockError
from kvcache.kvstore.shuffle import unshuffle2_into
from kvcache.kvstore.types import TensorSpec, raw_layout

MAGIC = b"KVCB"
FORMAT_VERSION = 1
TENANT_VERSION = 2          # version 1 and the tenant's name after the tensor specs
FLAG_TOMBSTONE = 1
_FIXED = struct.Struct("<4sHHBBBBQQd16s")
_TRAILER = 24
MAX_HEADER = 65535


class Codec(enum.IntEnum):
    RAW = 0
    ZSTD = 1
    ZSTD_SHUFFLE2 = 2   # zstd of byte-shuffled 16-bit words: all high bytes, then all low bytes


@dataclass(frozen=True, slots=True)
class RecordHeader:
    key: bytes
    namespace_id: bytes
    layout: tuple[TensorSpec, ...]
    payload_len: int
    raw_len: int
    created: float
    codec: Codec = Codec.RAW
    flags: int = 0
    header_len: int = 0
    payload_digest: bytes = b""
    tenant: str = ""

    @property
    def is_tombstone(self) -> bool:
        return bool(self.flags & FLAG_TOMBSTONE)

    @property
    def record_len(self) -> int:
        return self.header_len + self.payload_len


def check_layout(layout: tuple[TensorSpec, ...] | None, nbytes: int) -> tuple[TensorSpec, ...]:
    """The layout to store for a raw payload of `nbytes`, rejecting a size mismatch."""
    if nbytes == 0:
        raise BlockFormatError("a block payload must not be empty")
    if layout is None:
        return raw_layout(nbytes)
    layout = tuple(layout)
    if not 0 < len(layout) <= 255:
        raise BlockFormatError(f"a block has 1-255 tensors, got {len(layout)}")
    want = sum(t.nbytes for t in layout)
    if want != nbytes:
        names = ", ".join(f"{t.name}{list(t.shape)}:{t.dtype}" for t in layout)
        raise BlockFormatError(f"payload is {nbytes} bytes but its layout ({names}) needs {want}")
    return layout


@functools.lru_cache(maxsize=1024)
def _pack_layout(layout: tuple[TensorSpec, ...]) -> bytes:
    out = bytearray()
    for t in layout:
        name, dtype = t.name.encode(), t.dtype.encode()
        out += bytes([len(name)]) + name + bytes([len(dtype)]) + dtype + bytes([len(t.shape)])
        out += struct.pack(f"<{len(t.shape)}Q", *t.shape)
    return bytes(out)


def encode_header(key: bytes, namespace_id: bytes, layout: tuple[TensorSpec, ...], payload,
                  raw_len: int, created: float, codec: Codec = Codec.RAW, flags: int = 0,
                  tenant: str = "") -> bytes:
    """Header bytes for `payload` (already encoded by `codec`). The payload is not copied."""
    if not 1 <= len(key) <= 64:
        raise BlockFormatError(f"block key must be 1-64 bytes, got {len(key)}")
    if len(namespace_id) != 16:
        raise BlockFormatError("namespace id must be 16 bytes")
    body = _pack_layout(layout)
    if tenant:
        name = tenant.encode()
        body += struct.pack("<H", len(name)) + name
    header_len = _FIXED.size + len(key) + len(body) + _TRAILER
    if header_len > MAX_HEADER:
        raise BlockFormatError("block layout too large to describe in a header")
    plen = memoryview(payload).nbytes
    head = _FIXED.pack(MAGIC, TENANT_VERSION if tenant else FORMAT_VERSION, header_len, int(codec), flags,
                       len(key), len(layout), plen, raw_len, created, namespace_id) + key + body
    head += xxhash.xxh3_128_digest(payload)
    return head + xxhash.xxh3_64_digest(head)


def peek_header_len(buf) -> int:
    """Header length from the first 8 bytes; raises CorruptBlockError on a bad magic."""
    mv = memoryview(buf)
    if mv.nbytes < 8 or bytes(mv[:4]) != MAGIC:
        raise CorruptBlockError("bad record magic")
    (hlen,) = struct.unpack_from("<H", mv, 6)
    if hlen < _FIXED.size + _TRAILER:
        raise CorruptBlockError(f"impossible header length {hlen}")
    return hlen


def decode_header(buf) -> RecordHeader:
    """Parse and verify a header (not the payload). `buf` must hold at least the header."""
    mv = memoryview(buf)
    hlen = peek_header_len(mv)
    if mv.nbytes < hlen:
        raise CorruptBlockError("truncated header")
    if xxhash.xxh3_64_digest(mv[: hlen - 8]) != bytes(mv[hlen - 8: hlen]):
        raise CorruptBlockError("header checksum mismatch")
    (_, version, _, codec, flags, klen, ntensors, plen, raw_len, created, ns) = _FIXED.unpack_from(mv)
    if version not in (FORMAT_VERSION, TENANT_VERSION):
        raise CorruptBlockError(f"unsupported block format version {version}")
    pos = _FIXED.size
    key = bytes(mv[pos: pos + klen])
    pos += klen
    layout = []
    try:
        for _ in range(ntensors):
            n = mv[pos]
            name = bytes(mv[pos + 1: pos + 1 + n]).decode()
            pos += 1 + n
            n = mv[pos]
            dtype = bytes(mv[pos + 1: pos + 1 + n]).decode()
            pos += 1 + n
            nd = mv[pos]
            shape = struct.unpack_from(f"<{nd}Q", mv, pos + 1)
            pos += 1 + 8 * nd
            layout.append(TensorSpec(name, dtype, tuple(shape)))
        tenant = ""
        if version == TENANT_VERSION:
            (n,) = struct.unpack_from("<H", mv, pos)
            tenant = bytes(mv[pos + 2: pos + 2 + n]).decode()
            pos += 2 + n
        codec = Codec(codec)
    except (ValueError, IndexError, struct.error, UnicodeDecodeError) as e:
        raise CorruptBlockError(f"malformed header: {e}") from e
    if pos != hlen - _TRAILER:
        raise CorruptBlockError("header length disagrees with its contents")
    digest = bytes(mv[hlen - _TRAILER: hlen - 8])
    return RecordHeader(key, ns, tuple(layout), plen, raw_len, created, codec, flags, hlen, digest, tenant)


def verify_payload(header: RecordHeader, payload) -> None:
    mv = memoryview(payload)
    if mv.nbytes != header.payload_len:
        raise CorruptBlockError(f"payload is {mv.nbytes} bytes, header says {header.payload_len}")
    if xxhash.xxh3_128_digest(mv) != header.payload_digest:
        raise CorruptBlockError("payload checksum mismatch")


# _FIXED's first fields: magic, version, header_len, codec, flags, key_len, (tensor count), payload_len
_RAW_HEAD = struct.Struct("<4sHHBBBxQ")
_VERSIONS = (FORMAT_VERSION, TENANT_VERSION)


def raw_record_problem(head, key: bytes, payload, nbytes: int) -> str | None:
    """What is wrong with a raw (uncompressed, live) record of block `key` whose header is `head`
    (bytes or bytearray, exactly the header) and whose `nbytes`-byte payload is `payload` (a
    buffer, or a list of buffers holding it in order: a scattered read); None when nothing is.
    decode_header's checks without building its layout (the header checksum covers that), and
    no exception on the way: beside a 64 KiB read each Python step per block shows."""
    try:
        magic, version, hlen, codec, flags, klen, plen = _RAW_HEAD.unpack_from(head)
    except struct.error:
        return "truncated header"
    if magic != MAGIC or hlen != len(head) or hlen < _FIXED.size + klen + _TRAILER:
        return "header length disagrees with the record's place"
    if xxhash.xxh3_64_digest(head[: hlen - 8]) != head[hlen - 8:]:
        return "header checksum mismatch"
    if (version not in _VERSIONS or codec or flags & FLAG_TOMBSTONE or plen != nbytes
            or head[_FIXED.size: _FIXED.size + klen] != key):
        return "record does not hold the requested block"
    if type(payload) is not list:
        digest = xxhash.xxh3_128_digest(payload)
    elif len(payload) == 1:
        digest = xxhash.xxh3_128_digest(payload[0])
    else:
        h = xxhash.xxh3_128()
        for p in payload:
            h.update(p)
        digest = h.digest()
    return None if digest == head[hlen - _TRAILER: hlen - 8] else "payload checksum mismatch"


def verify_raw_record(head, key: bytes, payload) -> None:
    """raw_record_problem as an exception: CorruptBlockError on any mismatch."""
    parts = payload if isinstance(payload, list) else [payload]
    problem = raw_record_problem(head, key, parts, sum(memoryview(p).nbytes for p in parts))
    if problem is not None:
        raise CorruptBlockError(problem)


def decode_payload(header: RecordHeader, payload) -> bytes | memoryview:
    if header.codec is Codec.RAW:
        return payload
    import zstandard
    out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=header.raw_len)
    if len(out) != header.raw_len:
        raise CorruptBlockError("decompressed size disagrees with header")
    if header.codec is Codec.ZSTD_SHUFFLE2:
        raw = bytearray(header.raw_len)
        unshuffle2_into(out, raw)
        return raw
    return out
