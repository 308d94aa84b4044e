"""Reused response buffers of block reads (batch_get groups, GET /v1/blocks/{key}).

A fresh multi-MiB bytearray costs more than the copy into it: glibc serves it with mmap, returns
it to the kernel on free, and every page faults in again (zero-filled) on the next read. On the
2-core development VM that ran a group read at ~2.2 GB/s against 17-20 GB/s into a buffer used
before. So a read takes a buffer from here and gives it back once the socket is done with it.

    size_for(n)  ──> n's size class: the next power of two below 1 MiB, else whole MiB
    take(n)      ──> an idle buffer of that class, else a new one
    give(buf, reusable) ──> kept while idle buffers hold <= keep_bytes; else dropped

A buffer is exactly its class's size, so what the GetBudget charges (size_for) is what is held.
"Done with it" is the caller's call: asyncio's transport keeps a reference to the bytes the
kernel did not take (3.12+ keeps views instead of copying), so a buffer goes back only after
the transport's write buffer drained to empty. Runs on the event loop only.
"""

from __future__ import annotations

KEEP_BYTES = 64 << 20       # idle buffers kept, at most
_MIB = 1 << 20


def size_for(n: int) -> int:
    """The size class of an `n`-byte read: few distinct sizes, so buffers fit the next read."""
    if n <= _MIB:
        return max(4096, 1 << (n - 1).bit_length())
    return -(-n // _MIB) * _MIB


class ReadBuffers:
    def __init__(self, keep_bytes: int = KEEP_BYTES):
        self.keep_bytes = keep_bytes
        self._idle: dict[int, list[bytearray]] = {}
        self.idle_bytes = 0

    def take(self, n: int) -> bytearray:
        """A buffer of size_for(n) bytes (its contents are whatever the last read left)."""
        size = size_for(n)
        free = self._idle.get(size)
        if free:
            self.idle_bytes -= size
            return free.pop()
        return bytearray(size)

    def give(self, buf: bytearray, reusable: bool) -> None:
        """Return `buf`; `reusable` = nothing else refers to it any more."""
        if reusable and self.idle_bytes + len(buf) <= self.keep_bytes:
            self._idle.setdefault(len(buf), []).append(buf)
            self.idle_bytes += len(buf)
