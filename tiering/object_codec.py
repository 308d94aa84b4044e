"""Payload codecs of the object tier: raw, zstd, and zstd over byte-shuffled 16-bit data.

    codec byte (record header offset 8)   stored payload
    0  RAW             the block's bytes
    1  ZSTD            zstd(bytes)
    2  ZSTD_SHUFFLE2   zstd(hi bytes of every 16-bit word ‖ lo bytes ‖ odd tail byte)

bf16/fp16 tensors keep sign and exponent in the high byte of each little-endian word;
grouping those bytes gives zstd long runs of similar values (bf16 KV: ~1.3x plain, ~1.5x
shuffled; see dev-machine-notes section 8). A record is stored compressed only when that
makes it smaller, so incompressible blocks stay RAW.

Codec value 2 is not yet known to `kvstore.block_format.Codec`, whose `decode_header`
therefore refuses such a record as malformed: an unaware reader misses, it never serves
shuffled bytes. `decode_header_any` reads all three until block_format gains the value
(it then defers to `decode_header`).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time

import xxhash

from kvcache.kvstore.block_format import Codec, RecordHeader, decode_header, peek_header_len
from kvcache.kvstore.errors import CorruptBlockError
from kvcache.kvstore.shuffle import shuffle2, unshuffle2_into  # noqa: F401  (re-exported)

_CODEC_OFFSET = 8


class ObjCodec(enum.IntEnum):
    RAW = 0
    ZSTD = 1
    ZSTD_SHUFFLE2 = 2


CODEC_NAMES = {"none": ObjCodec.RAW, "zstd": ObjCodec.ZSTD, "zstd-shuffle2": ObjCodec.ZSTD_SHUFFLE2}
_NATIVE = {int(c) for c in Codec}


class PayloadCodec:
    """Thread-safe encoder/decoder (zstd contexts are per thread), with running totals."""

    def __init__(self, level: int = 1):
        self.level = level
        self._local = threading.local()
        self._lock = threading.Lock()
        self.raw_bytes = 0          # bytes offered to a compressor
        self.compressed_bytes = 0   # what came out (before the keep-raw-if-larger choice)
        self.compress_s = 0.0
        self.decoded_bytes = 0
        self.decompress_s = 0.0

    def _cctx(self):
        c = getattr(self._local, "c", None)
        if c is None:
            import zstandard
            c = self._local.c = zstandard.ZstdCompressor(level=self.level)
        return c

    def _dctx(self):
        d = getattr(self._local, "d", None)
        if d is None:
            import zstandard
            d = self._local.d = zstandard.ZstdDecompressor()
        return d

    def encode(self, payload: memoryview, codec: ObjCodec) -> tuple[memoryview | bytes, ObjCodec]:
        """(stored bytes, codec used): RAW when `codec` is RAW or compression does not pay."""
        if codec is ObjCodec.RAW or payload.nbytes == 0:
            return payload, ObjCodec.RAW
        t0 = time.perf_counter()
        src = shuffle2(payload) if codec is ObjCodec.ZSTD_SHUFFLE2 else payload
        out = self._cctx().compress(src)
        dt = time.perf_counter() - t0
        with self._lock:
            self.raw_bytes += payload.nbytes
            self.compressed_bytes += len(out)
            self.compress_s += dt
        if len(out) >= payload.nbytes:
            return payload, ObjCodec.RAW
        return out, codec

    def decode_into(self, header: RecordHeader, stored, out: memoryview) -> None:
        """Decode a verified payload into `out[:header.raw_len]`."""
        codec = int(header.codec)
        dst = out[: header.raw_len]
        if codec == ObjCodec.RAW:
            dst[:] = stored
            return
        t0 = time.perf_counter()
        try:
            data = self._dctx().decompress(stored, max_output_size=header.raw_len)
        except Exception as e:  # zstandard.ZstdError: the checksum matched, so this is a writer bug
            raise CorruptBlockError(f"zstd payload does not decode: {e}") from e
        if len(data) != header.raw_len:
            raise CorruptBlockError("decompressed size disagrees with header")
        if codec == ObjCodec.ZSTD_SHUFFLE2:
            unshuffle2_into(data, dst)
        elif codec == ObjCodec.ZSTD:
            dst[:] = data
        else:
            raise CorruptBlockError(f"unknown codec {codec}")
        with self._lock:
            self.decoded_bytes += header.raw_len
            self.decompress_s += time.perf_counter() - t0

    def decode(self, header: RecordHeader, stored) -> bytes:
        if int(header.codec) == ObjCodec.RAW:
            return bytes(stored)
        out = bytearray(header.raw_len)
        self.decode_into(header, stored, memoryview(out))
        return bytes(out)

    def totals(self) -> dict[str, float]:
        with self._lock:
            return {
                "raw_bytes": self.raw_bytes, "compressed_bytes": self.compressed_bytes,
                "ratio": self.raw_bytes / self.compressed_bytes if self.compressed_bytes else 0.0,
                "compress_MBps": self.raw_bytes / self.compress_s / 1e6 if self.compress_s else 0.0,
                "decompress_MBps": self.decoded_bytes / self.decompress_s / 1e6 if self.decompress_s else 0.0,
            }


def decode_header_any(buf) -> RecordHeader:
    """`decode_header`, also accepting codec 2 (ZSTD_SHUFFLE2) while block_format lacks it.

    The header checksum is verified on the bytes as stored before anything is trusted."""
    mv = memoryview(buf)
    hlen = peek_header_len(mv)
    if mv.nbytes < hlen:
        raise CorruptBlockError("truncated header")
    codec = mv[_CODEC_OFFSET]
    if codec in _NATIVE:
        return decode_header(mv)
    if codec != ObjCodec.ZSTD_SHUFFLE2:
        raise CorruptBlockError(f"malformed header: unknown codec {codec}")
    if xxhash.xxh3_64_digest(mv[: hlen - 8]) != bytes(mv[hlen - 8: hlen]):
        raise CorruptBlockError("header checksum mismatch")
    patched = bytearray(mv[:hlen])
    patched[_CODEC_OFFSET] = int(Codec.ZSTD)
    patched[hlen - 8:] = xxhash.xxh3_64_digest(memoryview(patched)[: hlen - 8])
    return dataclasses.replace(decode_header(patched), codec=ObjCodec.ZSTD_SHUFFLE2)
