"""A DRAM tier of a few slab pages with blocks of mixed sizes: blocks of a size class that has
no page take a free chunk of a larger class, and eviction frees a chunk that fits, so the arena
keeps about as many blocks as its bytes allow."""

import logging
import random

from kvcache.tiering.base import BlockWrite
from kvcache.tiering.config import DramConfig
from kvcache.tiering.dram import DramTier
from kvcache.tiering.slab import SlabAllocator


def _payload(i: int, n: int) -> bytes:
    return random.Random(i).randbytes(n)


def test_mixed_sizes_share_a_small_arena(caplog):
    with caplog.at_level(logging.WARNING):
        t = DramTier(DramConfig(capacity_bytes=8 << 20, page_bytes=4 << 20, prefault=False, pin_memory="off"))
    assert "2 slab pages" in caplog.text                  # told at start, with the numbers
    rng, sizes, put = random.Random(0), [16 << 10, 40 << 10, 100 << 10], {}
    for i in range(3000):
        n = rng.choice(sizes)
        key = i.to_bytes(16, "little")
        t.put([BlockWrite(key, bytes(16), _payload(i, n), (), 0.0)])
        put[key] = (i, n)
    kept = t.keys()
    assert len(kept) > 100                               # ~150 fit in 8 MiB at these sizes
    for key in kept:
        i, n = put[key]
        assert t.get(key) == _payload(i, n)
    t.close()


def test_a_block_in_a_larger_class_is_accounted_by_its_chunk():
    slab = SlabAllocator(2 << 20, 1 << 20)
    big = [slab.alloc(500 << 10), slab.alloc(16 << 10)]    # two pages: classes 512K and 16K
    assert slab.alloc(16 << 10) is not None
    fallback = slab.alloc(200 << 10)                       # no 200K page, no free page: a 512K chunk
    assert fallback is not None and slab.chunk_at(fallback) == 512 << 10
    assert slab.used_bytes == 2 * (512 << 10) + 2 * (16 << 10)
    slab.free(fallback)
    assert slab.used_bytes == (512 << 10) + 2 * (16 << 10)
    for off in big:
        slab.free(off)
    assert slab.used_bytes == 16 << 10
    assert slab.alloc(1 << 20) == 0                        # page 0 went back to the free list: a whole page
    assert slab.alloc(1 << 20) is None                     # and page 1 still holds the 16K block
