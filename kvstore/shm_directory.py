"""The read directory: where a local client finds a block in the shared DRAM arena without asking.

    daemon (DramTier, under its lock)              local client (no round trip)
    ─────────────────────────────────              ─────────────────────────────────────────────
    a put into DRAM or a lease publishes           bucket = xxh3_64(key) % buckets
      key -> (offset, nbytes, valid_until)         for each way of the bucket:
    unlinking a block (evict, delete, unpin)         s1 = seq; even? key equal? valid_until > now?
      clears its entry *before* the chunk can          copy arena[offset : offset + nbytes]
      go back to the allocator                         s2 = seq; s1 == s2: the copy is the block
                                                   not found or changed: lease it (one round trip);
                                                   the lease publishes it, the next read is direct

    header (64 B):  magic "KVCDIR01" | u32 buckets | u32 ways | u32 entry_bytes
    entry (128 B):  u64 seq | f64 valid_until | u64 offset | u64 nbytes | u8 key_len | key[64] | pad
                    writer: seq+1 (odd) ... fields ... seq+1 (even)        (a seqlock per entry)

Why a copy that passes the check is the block: a chunk is reused only after its block was
unlinked, and unlinking bumps the seq of the entry that points at it before the chunk is freed
(same thread, under the DRAM lock, which orders it before whoever writes the chunk next). The
reader loads seq again after copying; had any byte it copied been the next block's, that load sees
the bumped seq and the copy is thrown away. This needs loads kept in order with loads and stores
with stores, which x86-64 (TSO) gives plain Python code; Arm does not without barriers, so clients
there keep leasing (DIRECT_READS). valid_until is when the block could expire (sliding TTLs
move it on at the next lease or put), at most HORIZON_S ahead; deletes, unpins and a reconfigured
retention clear entries at once. Entries are a
cache: a full bucket overwrites one of its ways, and a missing entry only costs a lease.
"""

from __future__ import annotations

import platform
import struct

import numpy as np
import xxhash

MAGIC = b"KVCDIR01"
WAYS = 4
ENTRY_BYTES = 128
HEADER_BYTES = 64
MAX_KEY = 64
HORIZON_S = 300.0           # longest an entry stays valid without a new lease or put
MAX_BUCKETS = 1 << 16       # 32 MiB of table at most; beyond that entries just get overwritten
DIRECT_READS = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")

_HEADER = struct.Struct("<8sIII")
_ENTRY = struct.Struct("<QdQQB")    # seq, valid_until, offset, nbytes, key_len; the key follows
_SEQ = struct.Struct("<Q")
_KEY_AT = _ENTRY.size
_KEY_LEN_AT, _VALID_AT, _OFFSET_AT, _NBYTES_AT = _KEY_AT - 1, 8, 16, 24
BATCH_FROM = 8              # keys from which find_many's fixed cost (~20 us of numpy calls) pays off


class DirectoryError(ValueError):
    """The mapped table is not a read directory this client understands."""


def bucket_of(key: bytes, buckets: int) -> int:
    return xxhash.xxh3_64_intdigest(key) & (buckets - 1)


def table_bytes(arena_bytes: int) -> int:
    """Table size for an arena: a bucket (4 entries) per 128 KiB of arena, a power of two."""
    want = max(64, arena_bytes // (128 << 10))
    buckets = 1 << min((want - 1).bit_length(), MAX_BUCKETS.bit_length() - 1)
    return HEADER_BYTES + buckets * WAYS * ENTRY_BYTES


class Directory:
    """The daemon's side, over a writable buffer (a shared memfd). Not thread-safe: the DRAM
    tier calls it under its lock, so that publishing and unlinking are ordered with the chunks."""

    def __init__(self, buf: memoryview):
        self.buf = buf
        self.buckets = (len(buf) - HEADER_BYTES) // (WAYS * ENTRY_BYTES)
        if self.buckets < 1 or self.buckets & (self.buckets - 1):
            raise ValueError(f"a {len(buf)}-byte table is not a power-of-two bucket count (use table_bytes)")
        _HEADER.pack_into(buf, 0, MAGIC, self.buckets, WAYS, ENTRY_BYTES)
        self._where: dict[bytes, int] = {}   # key -> entry position
        self._next_way = bytearray(self.buckets)   # which way a full bucket overwrites next

    def publish(self, key: bytes, offset: int, nbytes: int, valid_until: float) -> None:
        pos = self._where.get(key)
        if pos is None:
            pos = self._free_way(key)
            self._where[key] = pos
        self._write(pos, valid_until, offset, nbytes, key)

    def remove(self, key: bytes) -> None:
        pos = self._where.pop(key, None)
        if pos is not None:
            self._write(pos, 0.0, 0, 0, b"")

    def clear(self) -> None:
        for key in list(self._where):
            self.remove(key)

    def __len__(self) -> int:
        return len(self._where)

    def _free_way(self, key: bytes) -> int:
        b = bucket_of(key, self.buckets)
        first = HEADER_BYTES + b * WAYS * ENTRY_BYTES
        for way in range(WAYS):
            pos = first + way * ENTRY_BYTES
            if self.buf[pos + _KEY_AT - 1] == 0:          # key_len 0: empty
                return pos
        way = self._next_way[b] % WAYS
        self._next_way[b] = (way + 1) % WAYS
        pos = first + way * ENTRY_BYTES
        old_len = self.buf[pos + _KEY_AT - 1]
        del self._where[bytes(self.buf[pos + _KEY_AT: pos + _KEY_AT + old_len])]
        return pos

    def _write(self, pos: int, valid_until: float, offset: int, nbytes: int, key: bytes) -> None:
        seq = _SEQ.unpack_from(self.buf, pos)[0]
        _SEQ.pack_into(self.buf, pos, seq + 1)             # odd: readers skip the entry
        _ENTRY.pack_into(self.buf, pos, seq + 1, valid_until, offset, nbytes, len(key))
        self.buf[pos + _KEY_AT: pos + _KEY_AT + len(key)] = key
        _SEQ.pack_into(self.buf, pos, seq + 2)             # even again: the entry is whole


class DirectoryReader:
    """A local client's side, over a read-only mapping of the daemon's table."""

    def __init__(self, buf, search=None):
        """`buf`: the table's bytes; `search`: the same bytes as an object with a C-level
        find(sub, start, end) (the mmap `buf` views), which answers most misses in one call."""
        if len(buf) < HEADER_BYTES:
            raise DirectoryError(f"the read directory is {len(buf)} bytes, shorter than its header")
        magic, buckets, ways, entry = _HEADER.unpack_from(buf, 0)
        if magic != MAGIC or ways != WAYS or entry != ENTRY_BYTES:
            raise DirectoryError(f"unknown read directory layout {magic!r}/{ways}/{entry}: a daemon of "
                                 "another version? Reads fall back to leases")
        if buckets < 1 or buckets & (buckets - 1) or HEADER_BYTES + buckets * ways * entry > len(buf):
            raise DirectoryError(f"read directory claims {buckets} buckets in {len(buf)} bytes")
        self.buf, self.buckets = buf, buckets
        self._search = search.find if search is not None else None
        # the same entries as arrays, for find_many: rows of ENTRY_BYTES, and each row's seq
        self._rows = np.frombuffer(buf, np.uint8, buckets * WAYS * ENTRY_BYTES, HEADER_BYTES).reshape(-1, ENTRY_BYTES)
        self._seqs = self._rows[:, :8].view("<u8")[:, 0]

    def find(self, key: bytes, now: float) -> tuple[int, int, int, int] | None:
        """(position, seq, offset, nbytes) of a valid entry for `key`, or None. The caller copies
        arena[offset : offset + nbytes] and then asks unchanged(position, seq).
        With `search`, the key's bytes are looked for first: absent, a miss; at a key field, that
        way is checked alone. Anything else (the bytes elsewhere, a stale entry that kept them)
        checks every way, as without `search`."""
        first = HEADER_BYTES + bucket_of(key, self.buckets) * WAYS * ENTRY_BYTES
        end = first + WAYS * ENTRY_BYTES
        if self._search is not None:
            at = self._search(key, first + _KEY_AT, end)
            if at < 0:
                return None        # its bytes are nowhere in its bucket (after a restart: every key)
            if (at - _KEY_AT - first) % ENTRY_BYTES == 0:
                hit = self._valid(at - _KEY_AT, key, now)
                if hit is not None:
                    return hit
        for pos in range(first, end, ENTRY_BYTES):
            hit = self._valid(pos, key, now)
            if hit is not None:
                return hit
        return None

    def _valid(self, pos: int, key: bytes, now: float) -> tuple[int, int, int, int] | None:
        buf, n = self.buf, len(key)
        seq, valid_until, offset, nbytes, key_len = _ENTRY.unpack_from(buf, pos)
        if (key_len == n and not seq & 1 and valid_until > now and buf[pos + _KEY_AT: pos + _KEY_AT + n] == key
                and self.unchanged(pos, seq)):   # the fields were read whole: no torn offset or size
            return pos, seq, offset, nbytes
        return None

    def find_many(self, keys: list[bytes], now: float) -> tuple[list[int], np.ndarray, np.ndarray, list, list]:
        """find() of many keys in a few array passes (per key: a hash, no Python loop over ways):
        (indices of the keys found, their entries' rows and seqs, offsets, sizes). Pass rows and
        seqs to unchanged_many after copying. The seqlock, for all keys at once:

            seq1 = seqs[rows] ── entries = rows' bytes ── seq2 = seqs[rows]     (three passes, in order)
            valid: seq1 == seq2, even, key and key_len equal, valid_until > now; the first valid way

        Keys of several lengths, or fewer than BATCH_FROM, go through find() one by one."""
        n = len(keys)
        klen = len(keys[0]) if keys else 0
        if n < BATCH_FROM or len(set(map(len, keys))) != 1 or not 1 <= klen <= MAX_KEY:
            found = [(i, self.find(k, now)) for i, k in enumerate(keys)]
            hits = [(i, h) for i, h in found if h is not None]
            rows = np.array([(h[0] - HEADER_BYTES) // ENTRY_BYTES for _, h in hits], np.intp)
            return ([i for i, _ in hits], rows, np.array([h[1] for _, h in hits], np.uint64),
                    [h[2] for _, h in hits], [h[3] for _, h in hits])
        buckets = np.fromiter(map(xxhash.xxh3_64_intdigest, keys), np.uint64, n) & np.uint64(self.buckets - 1)
        rows = buckets.astype(np.intp)[:, None] * WAYS + np.arange(WAYS)
        seq1 = self._seqs[rows]
        entries = self._rows[rows]
        seq2 = self._seqs[rows]
        want = np.frombuffer(b"".join(keys), np.uint8).reshape(n, 1, klen)
        valid_until = entries[:, :, _VALID_AT: _VALID_AT + 8].copy().view("<f8")[..., 0]
        ok = ((seq1 == seq2) & (seq1 & np.uint64(1) == 0) & (entries[:, :, _KEY_LEN_AT] == klen)
              & (valid_until > now) & (entries[:, :, _KEY_AT: _KEY_AT + klen] == want).all(axis=2))
        found = np.flatnonzero(ok.any(axis=1))
        way = ok[found].argmax(axis=1)
        hit = entries[found, way]
        return (found.tolist(), rows[found, way], seq1[found, way],
                hit[:, _OFFSET_AT: _OFFSET_AT + 8].copy().view("<u8").ravel().tolist(),
                hit[:, _NBYTES_AT: _NBYTES_AT + 8].copy().view("<u8").ravel().tolist())

    def unchanged_many(self, rows: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        """unchanged() of find_many's entries, as booleans."""
        return self._seqs[rows] == seqs

    def unchanged(self, pos: int, seq: int) -> bool:
        return _SEQ.unpack_from(self.buf, pos)[0] == seq
