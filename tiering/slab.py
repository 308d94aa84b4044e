"""A slab allocator over one preallocated arena (memcached-style size classes).

    arena: | page 0 (class 64K) | page 1 (class 1M) | page 2 (free) | page 3 (class 64K) | ...
             [c][c][c]...[c]      [ c ][ c ]...                        [c][c]...

The arena is cut into fixed pages. A page is given to one size class on demand and carved
into equal chunks; a page whose chunks are all free goes back to the free-page list, so
memory moves between classes as the block-size mix changes. With no page of its class and
no free page, a block takes a free chunk of the next larger class that has one: an arena of
a few pages would otherwise hold one size class per page, and each block of another size
would evict a whole page to get one. Nothing is allocated per block: fresh memory is slow
to touch on our VMs (2-3 GB/s against 15 GB/s reused).

A block larger than a page takes a **span**: the fewest whole pages that hold it, contiguous,
as one chunk (its class is that many pages' bytes). A span wastes up to a page less one byte,
so the DRAM tier warns when blocks need them: dram.page_bytes should be at least the largest
block size.

    | page 4 (span of 2: one 17 MiB block) | page 5 (continues page 4) | page 6 (class 1M) |
Not thread-safe on its own: the DRAM tier serialises calls.
"""

from __future__ import annotations

import bisect

from dataclasses import dataclass, field

_ALIGN = 4096
_CONTINUED = -1          # the class of a span's pages after its first


@dataclass(slots=True)
class _Page:
    index: int
    chunk: int = 0
    free: list[int] = field(default_factory=list)
    used: int = 0


def size_classes(page_bytes: int, growth: float = 1.125) -> list[int]:
    """Chunk sizes: 4 KiB-aligned, growing by `growth` (<= ~12 % waste), plus every power
    of two (KV blocks usually are one, and then waste nothing), up to the page size."""
    out, size = {page_bytes}, _ALIGN
    while size < page_bytes:
        out.add(size)
        size = max(size + _ALIGN, int(size * growth) // _ALIGN * _ALIGN)
    size = _ALIGN
    while size < page_bytes:
        out.add(size)
        size *= 2
    return sorted(out)


class SlabAllocator:
    def __init__(self, capacity: int, page_bytes: int):
        if page_bytes % _ALIGN or page_bytes <= 0:
            raise ValueError(f"page size must be a positive multiple of {_ALIGN}")
        if capacity < page_bytes:
            raise ValueError(f"capacity {capacity} is smaller than one page ({page_bytes})")
        self.page_bytes = page_bytes
        self.num_pages = capacity // page_bytes
        self.classes = size_classes(page_bytes)
        self._pages = [_Page(i) for i in range(self.num_pages)]
        self._free_pages = list(range(self.num_pages - 1, -1, -1))
        self._partial: dict[int, dict[int, None]] = {c: {} for c in self.classes}
        self.used_bytes = 0
        self.spans = 0                      # spans allocated (blocks larger than a page)
        self._class_of: dict[int, int] = {}

    @property
    def capacity(self) -> int:
        return self.num_pages * self.page_bytes

    def chunk_size(self, nbytes: int) -> int:
        c = self._class_of.get(nbytes)      # a cache: a namespace's blocks mostly share one size,
        if c is not None:                   # and a put asks three times per block
            return c
        if nbytes > self.page_bytes:
            c = -(-nbytes // self.page_bytes) * self.page_bytes
            if c > self.capacity:
                raise ValueError(f"a {nbytes}-byte block exceeds the DRAM tier's capacity ({self.capacity})")
            return c
        c = self.classes[bisect.bisect_left(self.classes, nbytes)]
        if len(self._class_of) < 4096:
            self._class_of[nbytes] = c
        return c

    def alloc(self, nbytes: int) -> int | None:
        """Byte offset of a chunk holding `nbytes`, or None when no chunk of that class is free."""
        chunk = self.chunk_size(max(nbytes, 1))
        if chunk > self.page_bytes:
            return self._alloc_span(chunk // self.page_bytes)
        partial = self._partial[chunk]
        if partial:
            page = self._pages[next(iter(partial))]
        elif self._free_pages:
            page = self._pages[self._free_pages.pop()]
            page.chunk, page.used = chunk, 0
            page.free = list(range(self.page_bytes // chunk - 1, -1, -1))
            partial[page.index] = None
        else:
            page = self._larger_partial(chunk)
            if page is None:
                return None
            partial = self._partial[page.chunk]
        slot = page.free.pop()
        page.used += 1
        if not page.free:
            del partial[page.index]
        self.used_bytes += page.chunk
        return page.index * self.page_bytes + slot * page.chunk

    def _alloc_span(self, pages: int) -> int | None:
        """The first run of `pages` contiguous free pages, as one chunk (rare: a scan is fine)."""
        run, start = 0, 0
        for i in sorted(self._free_pages):
            run, start = (run + 1, start) if run and i == start + run else (1, i)
            if run == pages:
                break
        else:
            return None
        taken = set(range(start, start + pages))
        self._free_pages = [i for i in self._free_pages if i not in taken]
        for i in taken:
            self._pages[i].chunk, self._pages[i].used = _CONTINUED, 1
        head = self._pages[start]
        head.chunk = pages * self.page_bytes
        self.spans += 1
        self.used_bytes += head.chunk
        return start * self.page_bytes

    def _larger_partial(self, chunk: int) -> _Page | None:
        """A page of the smallest class above `chunk` with a free chunk (wasteful, but a block
        kept beats a page of blocks evicted)."""
        for c in self.classes[bisect.bisect_right(self.classes, chunk):]:
            if self._partial[c]:
                return self._pages[next(iter(self._partial[c]))]
        return None

    def chunk_at(self, offset: int) -> int:
        """The size of the chunk at `offset` (a block may sit in a larger class than its own)."""
        return self._pages[offset // self.page_bytes].chunk

    def free(self, offset: int) -> None:
        page = self._pages[offset // self.page_bytes]
        if page.chunk > self.page_bytes:          # a span: all its pages go back
            pages = page.chunk // self.page_bytes
            self.used_bytes -= page.chunk
            for i in range(page.index, page.index + pages):
                self._pages[i].chunk, self._pages[i].used, self._pages[i].free = 0, 0, []
                self._free_pages.append(i)
            return
        slot = (offset - page.index * self.page_bytes) // page.chunk
        page.free.append(slot)
        page.used -= 1
        self.used_bytes -= page.chunk
        if page.used == 0:
            self._partial[page.chunk].pop(page.index, None)
            page.chunk, page.free = 0, []
            self._free_pages.append(page.index)
        else:
            self._partial[page.chunk][page.index] = None
