"""Same-host reads of blocks that are only on the daemon's NVMe tier: the daemon answers a
LEASE_FILES with where each record sits in a segment file and a read-only descriptor of that
file, and the client reads the record straight into the caller's buffer and verifies it.

    daemon: index -> (segment, offset, header_len, nbytes), dup(segment fd) ──SCM_RIGHTS──>
    client: preadv(fd, [header, *dst pieces], offset)     one copy: page cache -> dst
            header checksum, key == tenant_key(tenant, key), payload length, raw codec,
            xxh3-128 of dst                                 a mismatch: read over the socket

Why not promote first and copy out of the arena: that is two copies and a checksum pass in
series (read into DRAM, verify, then the client's memcpy), about a third of pread's speed on
the machine this was measured on; this is one copy and the checksum. The daemon promotes those
blocks in the background, so their next read is a DRAM one.

Who may: only a control connection whose HELLO was accepted for shared memory, whose token is
trusted with every tenant's bytes (the arena it maps holds them all); a segment descriptor
reveals no more than that (records of several tenants, and deleted records until compaction
removes the segment). The descriptor is read-only, and records are never rewritten in place, so
the bytes at a placement stay the block's for as long as the descriptor is open; a damaged
record fails verification here and is then read over the socket, where the daemon's own read
quarantines it.
"""

from __future__ import annotations

import os

from kvcache.kvstore.block_format import MAX_HEADER, raw_record_problem
from kvcache.kvstore.shm_wire import FileSlot


def read_record_into(fd: int, slot: FileSlot, stored_key: bytes, dst: list[memoryview]) -> bool:
    """Read the record `slot` names into `dst` (its payload, in order over the pieces, whose
    lengths add up to slot.nbytes: kvstore/types.py Scatter) and verify it: True when those bytes are
    the block `stored_key`; False otherwise (dst's bytes are then undefined)."""
    hlen, n = slot.header_len, slot.nbytes
    if not 0 < hlen <= MAX_HEADER or (dst[0].nbytes if len(dst) == 1 else sum(p.nbytes for p in dst)) != n:
        return False
    head = bytearray(hlen)
    try:
        if os.preadv(fd, [head, *dst], slot.offset) != hlen + n:
            return False
    except OSError:
        return False
    return raw_record_problem(head, stored_key, dst, n) is None
