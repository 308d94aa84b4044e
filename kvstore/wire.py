"""The binary framing for batches of blocks over HTTP (see docs/api.md).

A batch body is a stream of frames after one stream header; payloads are never JSON:

    stream:  b"KVB1" | u32 count
    put frame (client -> daemon):
             u8 key_len | key | 16B namespace id | u32 meta_len | meta JSON (may be empty:
             {"layout": [[name, dtype, [dims...]], ...], "ttl_s": float}) | u64 len | payload
    get frame (daemon -> client, one per requested key, in order):
             u8 key_len | key | u8 status (0 hit, 1 miss) | u8 tier bits | u64 len | payload

A miss's len is 0, except in a sized stream (batch_get with "sized": true, whose response
has a Content-Length computed before the first block is read): a block sized as present but
gone, or of another size, by the time it is read keeps its promised bytes as a miss whose len
zero bytes follow (a padded miss). Readers skip those bytes.

All integers little-endian. Readers pull frames one at a time from an async byte stream,
so neither side holds a whole batch in memory beyond what it chooses to.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Awaitable, Callable

from kvcache.kvstore.errors import BlockFormatError
from kvcache.kvstore.types import TensorSpec, Tier, is_real

MAGIC = b"KVB1"


class FrameLimitError(BlockFormatError):
    """A batch or a block over the daemon's limits (HTTP 413)."""


_STREAM = struct.Struct("<4sI")
_U8, _U32, _U64 = struct.Struct("<B"), struct.Struct("<I"), struct.Struct("<Q")
HIT, MISS = 0, 1
MAX_META = 1 << 16

ReadExactly = Callable[[int], Awaitable[bytes]]


@dataclass(frozen=True, slots=True)
class PutFrame:
    key: bytes
    namespace_id: bytes
    payload: bytes
    layout: tuple[TensorSpec, ...] | None = None
    ttl_s: float | None = None


@dataclass(frozen=True, slots=True)
class GetFrame:
    key: bytes
    payload: bytes | None
    tier: Tier = Tier.NONE


def stream_header(count: int) -> bytes:
    return _STREAM.pack(MAGIC, count)


def encode_put_frame(f: PutFrame) -> list[bytes | memoryview]:
    meta = {}
    if f.layout is not None:
        meta["layout"] = [[t.name, t.dtype, list(t.shape)] for t in f.layout]
    if f.ttl_s is not None:
        meta["ttl_s"] = f.ttl_s
    mj = json.dumps(meta).encode() if meta else b""
    if len(f.namespace_id) != 16 or not 1 <= len(f.key) <= 64:
        raise BlockFormatError("a frame needs a 1-64 byte key and a 16-byte namespace id")
    return [_U8.pack(len(f.key)) + f.key + f.namespace_id + _U32.pack(len(mj)) + mj
            + _U64.pack(memoryview(f.payload).nbytes), f.payload]


def encode_get_frame(key: bytes, payload, tier: Tier) -> list[bytes | memoryview]:
    if payload is None:
        return [get_frame_head(key, None, None)]
    return [get_frame_head(key, memoryview(payload).nbytes, tier), payload]


def get_frame_head(key: bytes, nbytes: int | None, tier: Tier | None) -> bytes:
    """A get frame up to its payload: a hit of `nbytes` bytes from `tier`, or a miss (None)."""
    if nbytes is None:
        return _U8.pack(len(key)) + key + bytes([MISS, 0]) + _U64.pack(0)
    return _U8.pack(len(key)) + key + bytes([HIT, int(tier)]) + _U64.pack(nbytes)


def padded_miss_head(key: bytes, padding: int) -> bytes:
    """A miss followed by `padding` zero bytes: a sized stream's frame for a block that was
    sized as `padding` bytes and could not be sent as such."""
    return _U8.pack(len(key)) + key + bytes([MISS, 0]) + _U64.pack(padding)


def frame_bytes(key: bytes, nbytes: int | None) -> int:
    """Bytes on the wire of a get frame for `key` with an `nbytes` payload (None: a miss)."""
    return 11 + len(key) + (nbytes or 0)


STREAM_HEADER_BYTES = _STREAM.size


async def read_stream_header(read: ReadExactly, max_count: int) -> int:
    return parse_stream_header(await read(_STREAM.size), max_count)


def parse_stream_header(raw: bytes, max_count: int) -> int:
    magic, count = _STREAM.unpack(raw)
    if magic != MAGIC:
        raise BlockFormatError("batch body does not start with the KVB1 stream header")
    if count > max_count:
        raise FrameLimitError(f"batch of {count} blocks exceeds the limit of {max_count}")
    return count


async def read_put_frame(read: ReadExactly, max_payload: int, read_payload: ReadExactly | None = None) -> PutFrame:
    """One put frame; `read_payload(n)` reads the payload when given (e.g. chunk by chunk into one
    buffer, sparing the join that readexactly does), else `read`."""
    (klen,) = _U8.unpack(await read(1))
    _check_key_len(klen)
    rest = await read(klen + 20)
    (mlen,) = _U32.unpack_from(rest, klen + 16)
    _check_meta_len(mlen)
    tail = await read(mlen + 8)
    plen = _check_payload_len(_U64.unpack_from(tail, mlen)[0], max_payload)
    meta = _parse_meta(tail[:mlen]) if mlen else {}
    return PutFrame(rest[:klen], rest[klen: klen + 16], await (read_payload or read)(plen),
                    meta.get("layout"), meta.get("ttl_s"))


def parse_put_head(buf, max_payload: int) -> tuple[PutFrame, int, int] | None:
    """A put frame up to its payload, parsed from bytes already at hand: (the frame with an
    empty payload, payload length, header bytes), or None when `buf` ends inside the header. The synchronous twin of
    read_put_frame, for readers that hold a buffer (server/front/bulk_put.py): no await per field."""
    n = len(buf)
    if n < 1:
        return None
    klen = _check_key_len(buf[0])
    if n < 1 + klen + 20:
        return None
    (mlen,) = _U32.unpack_from(buf, 1 + klen + 16)
    _check_meta_len(mlen)
    end = 1 + klen + 20 + mlen + 8
    if n < end:
        return None
    plen = _check_payload_len(_U64.unpack_from(buf, end - 8)[0], max_payload)
    meta = _parse_meta(bytes(buf[end - 8 - mlen: end - 8])) if mlen else {}
    key, ns = bytes(buf[1: 1 + klen]), bytes(buf[1 + klen: 17 + klen])
    return PutFrame(key, ns, b"", meta.get("layout"), meta.get("ttl_s")), plen, end


def _check_key_len(klen: int) -> int:
    if not 1 <= klen <= 64:
        raise BlockFormatError(f"frame key length {klen} is outside 1-64")
    return klen


def _check_meta_len(mlen: int) -> None:
    if mlen > MAX_META:
        raise BlockFormatError(f"frame metadata of {mlen} bytes exceeds {MAX_META}")


def _check_payload_len(plen: int, max_payload: int) -> int:
    if plen > max_payload:
        raise FrameLimitError(f"block of {plen} bytes exceeds the {max_payload}-byte limit")
    return plen


async def read_get_frame(read: ReadExactly) -> GetFrame:
    (klen,) = _U8.unpack(await read(1))
    key = await read(klen)
    status, tier = await read(2)
    (plen,) = _U64.unpack(await read(8))
    if status == MISS:
        if plen:
            await read(plen)             # a padded miss (a sized stream): the promised bytes, zeros
        return GetFrame(key, None)
    return GetFrame(key, await read(plen), Tier(tier))


async def read_get_frame_header(read: ReadExactly) -> tuple[bytes, bool, Tier, int]:
    """A get frame up to its payload: (key, hit, tier, payload length); the caller reads the payload."""
    (klen,) = _U8.unpack(await read(1))
    return parse_get_head(await read(klen + 10))


def parse_get_head(rest: bytes) -> tuple[bytes, bool, Tier, int]:
    """A get frame header after its key-length byte (key_len + 10 bytes): (key, hit, tier, payload length)."""
    klen = len(rest) - 10
    status, tier = rest[klen], rest[klen + 1]
    (plen,) = _U64.unpack_from(rest, klen + 2)
    return rest[:klen], status == HIT, Tier(tier), plen


def _parse_meta(raw: bytes) -> dict:
    """A frame's metadata (both upload paths parse it here): a JSON object with at most a layout
    and a ttl_s (other keys are ignored). Whatever else the client's bytes hold (JSON nested past
    the parser's recursion limit, an integer too large for a float) is a BlockFormatError (400)."""
    try:
        meta = json.loads(raw)
    except RecursionError:
        raise BlockFormatError("frame metadata is JSON nested too deeply") from None
    except ValueError as e:
        raise BlockFormatError(f"frame metadata is not JSON: {e}") from None
    if not isinstance(meta, dict):       # other keys are ignored, as before: room for newer clients
        raise BlockFormatError('frame metadata is a JSON object {"layout": [[name, dtype, [dims...]], ...], '
                               '"ttl_s": seconds}, both optional')
    try:
        return {"layout": parse_layout(meta.get("layout")), "ttl_s": _meta_ttl(meta.get("ttl_s"))}
    except (ValueError, TypeError, OverflowError) as e:
        raise BlockFormatError(f"frame metadata is not valid: {e}") from None


def parse_layout(layout) -> tuple[TensorSpec, ...] | None:
    """A layout as JSON sends it (frame metadata, the X-KVCache-Layout header); None for none."""
    if layout is None:
        return None
    if not isinstance(layout, list) or not all(isinstance(t, list) and len(t) == 3 for t in layout):
        raise TypeError("layout is a list of [name, dtype, [dims...]]")
    return tuple(TensorSpec(n, d, tuple(s) if isinstance(s, list) else s) for n, d, s in layout)


def _meta_ttl(ttl) -> float | None:
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):   # float(True) would be a 1-second TTL
        raise TypeError(f"ttl_s is a number of seconds, not a boolean or a string, got {ttl!r}"[:120])
    if not is_real(ttl):                                           # a 400-digit integer is no float
        raise ValueError(f"ttl_s must be a finite number of seconds, got {ttl!r}"[:120])
    return float(ttl)
