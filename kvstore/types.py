"""The store's vocabulary as small typed values (see ARCHITECTURE.md, "Vocabulary").

block      the KV of `block_size` consecutive tokens, stored as one payload
block key  the chained content hash of a block (16 bytes for xxh3-128, 32 for sha256)
namespace  everything a key depends on besides tokens: model, KV layout, block size, salt
tier       where a block's bytes live: DRAM, NVMe, OBJECT (HBM belongs to the engine); Tier is the
           store's residency bits, TierName the one label store and engine print and key by
pin        a hold that keeps a block from eviction and expiry: hard, or soft with a TTL
"""

from __future__ import annotations

import enum
import functools
import struct
import sys
from dataclasses import asdict, dataclass, field
from typing import Sequence

from kvcache.kvstore.errors import BufferTooSmallError


class Tier(enum.IntFlag):
    """Residency bits. A block may live in several tiers at once."""

    NONE = 0
    DRAM = 1
    NVME = 2
    OBJECT = 4

    @property
    def label(self) -> str:
        return _TIER_LABELS[self]   # "dram|nvme"; a dict lookup, it is written once per block in replies

    def fastest(self) -> "Tier":
        return _FASTEST[self]       # a table: IntFlag membership tests cost ~0.2 us each


_TIER_OF = tuple(Tier(v) for v in range(8))
_TIER_LABELS = {Tier(v): "|".join(t.name.lower() for t in (Tier.DRAM, Tier.NVME, Tier.OBJECT) if t & v) or "none"
                for v in range(8)}
_FASTEST = {Tier(v): next((t for t in (Tier.DRAM, Tier.NVME, Tier.OBJECT) if t & v), Tier.NONE) for v in range(8)}


class TierName(enum.StrEnum):
    """One tier's label, fastest first: the engine's pool (HBM) and the store's tiers. A str, so
    JSON fields, log lines and metrics labels keyed by it read "dram", as plain strings did."""

    HBM = "hbm"
    DRAM = "dram"
    NVME = "nvme"
    OBJECT = "object"

    @classmethod
    def of(cls, residency: Tier) -> "TierName":
        """The fastest tier a block lives in (what a read of it is served from)."""
        if not residency:
            raise ValueError("a block in no tier has no tier name")
        return _NAME_OF[residency.fastest()]


_NAME_OF = {Tier.DRAM: TierName.DRAM, Tier.NVME: TierName.NVME, Tier.OBJECT: TierName.OBJECT}
STORE_TIERS = (TierName.DRAM, TierName.NVME, TierName.OBJECT)     # the store's, fastest first


# dtype name -> item size in bytes. Names follow torch's spelling so layouts read naturally.
DTYPE_SIZES: dict[str, int] = {
    "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e8m0fnu": 1,
    "float16": 2, "bfloat16": 2, "int16": 2,
    "float32": 4, "int32": 4,
    "float64": 8, "int64": 8,
}


MAX_DIM = 1 << 63


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One named tensor inside a block payload, stored contiguously in declaration order."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        # layouts arrive from clients (a header, frame metadata) and are stored as u64 dims
        # (kvstore/block_format.py): anything else is refused here, not when it is packed
        if not 1 <= utf8_len(self.name) <= 255:
            raise ValueError(f"tensor name must be a string of 1-255 UTF-8 bytes, got {self.name!r}"[:200])
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {str(self.dtype)[:40]!r}; known: {sorted(DTYPE_SIZES)}")
        if not isinstance(self.shape, tuple) or len(self.shape) > 16 or not all(
                type(d) is int and 0 <= d < MAX_DIM for d in self.shape):
            raise ValueError(f"shape must be at most 16 ints in [0, 2**63), got {self.shape!r}"[:200])

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def is_real(v) -> bool:
    """A finite int or float, not a bool: what a float holds (a 400-digit int is too large)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and -sys.float_info.max <= v <= sys.float_info.max


def utf8_len(text) -> int:
    """Bytes of `text` in UTF-8; -1 for what is no string or cannot be encoded (a lone surrogate)."""
    try:
        return len(text.encode()) if isinstance(text, str) else -1
    except UnicodeEncodeError:
        return -1


@functools.lru_cache(maxsize=1024)
def raw_layout(nbytes: int) -> tuple[TensorSpec, ...]:
    """The layout of an opaque payload: one uint8 tensor."""
    return (TensorSpec("raw", "uint8", (nbytes,)),)


@dataclass(slots=True)
class BlockMeta:
    """What the index knows about one block. Times are seconds on the store's clock.

    `segment_id/offset/record_len/payload_len` locate the block's record in the NVMe
    tier when `Tier.NVME in residency`.
    """

    namespace_id: bytes
    payload_len: int
    residency: Tier = Tier.NONE
    created: float = 0.0
    last_access: float = 0.0
    access_count: int = 0
    hard_pins: int = 0
    soft_pin_until: float = 0.0
    expires_at: float = 0.0        # >0: an explicit deadline set at put time (overrides the policy)
    segment_id: int = 0
    offset: int = 0
    record_len: int = 0
    tenant: str = ""

    _FMT = struct.Struct("<16sQBdddIIdIQQ")

    def is_pinned(self, now: float) -> bool:
        return self.hard_pins > 0 or self.soft_pin_until > now

    def pack(self) -> bytes:
        # only NVMe residency is stored: DRAM residency is the DRAM tier's own map and object
        # residency the index's objects table, both folded in when metadata is read
        head = self._FMT.pack(
            self.namespace_id, self.payload_len, int(self.residency & Tier.NVME), self.created,
            self.last_access, self.expires_at, self.access_count, self.hard_pins, self.soft_pin_until,
            self.segment_id, self.offset, self.record_len,
        )
        return head + self.tenant.encode()

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> "BlockMeta":
        # on every read path (lookups of 1,000 blocks): no copy of `raw`, no IntFlag construction
        (ns, plen, res, created, last, expires, count, hard, soft, seg, off, rlen) = cls._FMT.unpack_from(raw)
        tenant = str(raw[cls._FMT.size:], "utf-8") if len(raw) > cls._FMT.size else ""
        return cls(ns, plen, _TIER_OF[res], created, last, count, hard, soft, expires, seg, off, rlen, tenant)


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest contiguous run of hits from the first key, and the tier of each hit."""

    num_hits: int
    tiers: tuple[Tier, ...] = field(default=())

    def num_tokens(self, block_size: int) -> int:
        return self.num_hits * block_size


@dataclass(frozen=True, slots=True)
class PutResult:
    """How a put landed: `durable` is True once the block survives a crash."""

    stored: int
    already_present: int
    durable: bool
    rejected: int = 0


@dataclass(frozen=True, slots=True)
class PutItem:
    """One block to put: its key, payload bytes (any buffer; never copied before it is stored),
    namespace, layout (None: one opaque uint8 tensor) and owner."""

    key: bytes
    payload: bytes | bytearray | memoryview
    namespace_id: bytes
    layout: tuple[TensorSpec, ...] | None = None
    tenant: str = ""
    ttl_s: float | None = None     # an explicit lifetime for this block instead of the retention policy


UNKNOWN = -1     # a count offline stats cannot know (what a daemon holds in DRAM)


@dataclass
class TierStats:
    tier: str
    blocks: int              # UNKNOWN offline for DRAM
    used_bytes: int          # UNKNOWN offline for DRAM
    capacity_bytes: int


@dataclass
class StoreStats:
    """What stats() answers, from a store or a daemon (kvstore/stats.py collects it)."""

    data_dir: str
    index_blocks: int
    namespaces: int
    tiers: list[TierStats]
    counters: dict[str, int]
    persistent_counters: dict[str, int]
    pinned_blocks: int = 0
    age_histogram: dict[str, int] = field(default_factory=dict)
    segments: int = 0
    live_bytes: int = 0
    offline: bool = False     # read from the directory, not from the store that holds it

    def to_dict(self) -> dict:
        return asdict(self)


MAX_PARTS = 512          # a Scatter's buffers at most: preadv's iovec limit (IOV_MAX 1024) with room
                         # for the record header


class Scatter:
    """A block's destination in pieces: a payload read straight into several buffers, in order.

    An engine whose KV cache keeps each layer's blocks in a tensor of its own would otherwise read a
    block into one staging buffer and copy each layer's part out of it again (two copies). With a
    `Scatter` the client's reads split the payload as they copy it:

        payload   |<- part 0 ->|<- part 1 ->| ... |<- part k ->|
                        |            |                  |
        Scatter   [ layer 0's block, layer 1's block, ..., layer k's block ]    (any writable buffers)

        shared memory   arena slice ─memcpy─> each part
        NVMe file slot  preadv(fd, [header, part 0, ..., part k])  then xxh3 over the parts
        socket          each part read in turn from the response

    A payload shorter than the parts fills them from the first on (like a larger buffer); a longer
    one raises ValueError, as a too-small buffer does. Only the daemon clients (KVClient,
    AsyncKVClient) take a Scatter; BlockStore's readers take single buffers.
    """

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: Sequence):
        try:
            views = [memoryview(p).cast("B") for p in parts]
        except TypeError as e:          # not a buffer, or not contiguous
            raise ValueError(f"a Scatter takes contiguous buffers: {e}") from e
        if not views or len(views) > MAX_PARTS:
            raise ValueError(f"a Scatter takes 1 to {MAX_PARTS} buffers, not {len(views)}")
        if any(v.readonly for v in views):
            raise ValueError("a Scatter's buffers must be writable")
        self.parts = views
        self.nbytes = sum(v.nbytes for v in views)

    def pieces(self, n: int) -> list[memoryview]:
        """The first n bytes as views of the parts (ValueError when they hold fewer)."""
        if self.nbytes < n:
            raise ValueError(f"output buffers hold {self.nbytes} bytes, block has {n}")
        out: list[memoryview] = []
        for v in self.parts:
            if n <= 0:
                break
            out.append(v if v.nbytes <= n else v[:n])
            n -= v.nbytes
        return out


def check_room(out, n: int) -> None:
    """BufferTooSmallError unless `out` (any buffer) holds `n` bytes (a memoryview is not re-viewed)."""
    nbytes = out.nbytes if type(out) is memoryview else memoryview(out).nbytes
    if nbytes < n:
        raise BufferTooSmallError(f"output buffer holds {nbytes} bytes, block has {n}")


def _fit(out, n: int) -> memoryview:
    check_room(out, n)
    return memoryview(out).cast("B")


def copy_flat(out, src: memoryview) -> None:
    """src's bytes into the first bytes of `out`, any writable buffer (BufferTooSmallError if it
    is smaller). A flat byte view, the usual buffer, takes one slice assignment as it is; other
    formats and shapes are cast first (a step fewer per block for the many: every read copies)."""
    try:
        (out if type(out) is memoryview else memoryview(out))[: src.nbytes] = src
    except (TypeError, ValueError, NotImplementedError):     # not flat bytes, or too small
        _fit(out, src.nbytes)[: src.nbytes] = src


def dest_pieces(out, n: int) -> list[memoryview]:
    """Where an n-byte payload goes: one view of a buffer, or a Scatter's pieces."""
    return out.pieces(n) if isinstance(out, Scatter) else [_fit(out, n)[:n]]


def copy_into(out, src: memoryview) -> int:
    """src's bytes into `out` (a buffer or a Scatter); their length. A plain buffer takes one
    slice assignment, no piece list: this is the shared-memory read's per-block copy."""
    n = src.nbytes
    if isinstance(out, Scatter):
        return copy_pieces(out.pieces(n), src)
    copy_flat(out, src)
    return n


def copy_pieces(pieces: list[memoryview], src: memoryview) -> int:
    """src's bytes into the pieces, in order (their lengths add up to src's); src's length."""
    pos = 0
    for p in pieces:
        p[:] = src[pos: pos + p.nbytes]
        pos += p.nbytes
    return pos
