"""DRAM landings: free arena chunks lent to the daemon's bulk upload, which receives payloads
straight into them (one copy in all), and which DramTier.put then adopts instead of copying.

    reserve(n) ──> view of a free chunk: not a block yet, never evicted, never leased
    recv_into(view) ──> put([BlockWrite(payload=view)]) ──> the chunk is adopted, nothing copied
    unreserve(views) ──> chunks that were not adopted (a duplicate, an error) are freed

A mixin only to keep dram.py readable: it uses DramTier's lock, slab allocator and arena.
"""

from __future__ import annotations

import ctypes
from typing import Sequence


class DramLandings:
    def reserve(self, nbytes: int, span: bool = False) -> memoryview | None:
        """A writable view of a free chunk for a payload about to arrive, or None (no free chunk
        below the high watermark, or max_reserved_bytes already set aside): the caller then
        receives elsewhere and put() copies. Never evicts: that is put()'s job, off this path.
        Blocks larger than a page get a span of whole pages only with `span` (a read from NVMe,
        whose size is known; an upload's declared size is not yet bytes that arrived)."""
        if nbytes <= 0 or nbytes > (self._slab.capacity if span else self._slab.page_bytes):
            return None
        if not self._lock.acquire(blocking=False):   # a put may hold it for a while (demotions):
            return None                              # receiving into staging beats waiting
        try:
            chunk = self._slab.chunk_size(nbytes)
            if (self._reserved_bytes + chunk > self.max_reserved_bytes
                    or self._slab.used_bytes + chunk > self.config.high_watermark * self._slab.capacity):
                return None
            off = self._slab.alloc(nbytes)
            if off is None:
                return None
            self._reserved[off] = nbytes
            self._reserved_bytes += chunk
        finally:
            self._lock.release()
        return self._mv[off: off + nbytes]

    def unreserve(self, views: Sequence[memoryview]) -> int:
        """Free the reserved chunks among `views` that put() did not adopt; how many were freed."""
        freed = 0
        if not self._reserved:
            return 0
        with self._lock:
            for v in views:
                off = self._claim(v)
                if off is not None:
                    self._slab.free(off)
                    freed += 1
        return freed

    def _adopt(self, payload, nbytes: int) -> int | None:
        """The offset of the reserved chunk that `payload` is (all of it), or None. Under the lock."""
        off = self._claim(payload, nbytes) if nbytes > 0 else None
        if off is not None:
            self.adopted += 1
        return off

    def _claim(self, buf, nbytes: int | None = None) -> int | None:
        """Under the lock: end the reservation that `buf` starts (of `nbytes` payload bytes when
        given) and return its offset; None when `buf` is no reserved chunk (or read-only bytes)."""
        if not self._reserved:
            return None
        try:
            off = address(buf) - self._base
        except TypeError:
            return None
        reserved = self._reserved.get(off)
        if reserved is None or (nbytes is not None and reserved != nbytes):
            return None
        del self._reserved[off]
        self._reserved_bytes -= self._slab.chunk_size(reserved)
        return off


    @property
    def reserved_bytes(self) -> int:
        return self._reserved_bytes



def address(buf) -> int:
    """Address of a writable buffer's first byte (the ctypes object, and its export, die at once)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))
