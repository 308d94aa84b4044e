"""Reused response buffers of block reads (batch_get groups, GET /v1/blocks/{key}).

A fresh multi-MiB bytearray costs more than the copy into it: glibc serves it with mmap, returns
it to the kernel on free, and every page faults in again (zero-filled) on the next read. On the
2-core development VM that ran a group read at ~2.2 GB/s against 17-20 GB/s into a buffer used
before. So a read takes a buffer from here and gives it back once the socket is done with it.

    take(n) ──> smallest idle buffer >= n, else a new one (n rounded up: the next one fits more)
    give(buf, reusable) ──> kept while idle buffers hold <= keep_bytes; else dropped

"Done with it" is the caller's call: asyncio's transport keeps a reference to the bytes the
kernel did not take (3.12+ keeps views instead of copying), so a buffer goes back only when the
transport's write buffer is empty after the last write. Runs on the event loop only.
"""

from __future__ import annotations

import bisect

KEEP_BYTES = 64 << 20       # idle buffers kept, at most (in flight they count against the GetBudget)
_MIB = 1 << 20


def _rounded(n: int) -> int:
    """Up to the next power of two below 1 MiB, else to whole MiB: few distinct sizes."""
    if n <= _MIB:
        return max(4096, 1 << (n - 1).bit_length())
    return -(-n // _MIB) * _MIB


class ReadBuffers:
    def __init__(self, keep_bytes: int = KEEP_BYTES):
        self.keep_bytes = keep_bytes
        self._idle: list[tuple[int, int, bytearray]] = []    # (size, id, buffer), sorted by size
        self.idle_bytes = 0

    def take(self, n: int) -> bytearray:
        """A buffer of at least `n` bytes (its contents are whatever the last read left)."""
        i = bisect.bisect_left(self._idle, (n, -1))
        if i < len(self._idle):
            size, _, buf = self._idle.pop(i)
            self.idle_bytes -= size
            return buf
        return bytearray(_rounded(n))

    def give(self, buf: bytearray, reusable: bool) -> None:
        """Return `buf`; `reusable` = nothing else refers to it any more."""
        if reusable and self.idle_bytes + len(buf) <= self.keep_bytes:
            bisect.insort(self._idle, (len(buf), id(buf), buf))
            self.idle_bytes += len(buf)
