"""DRAM tier specifics: slab reuse, exact LRU eviction order, watermarks, pins, leases."""

import pytest

from kvcache.kvstore.errors import TierFullError
from kvcache.kvstore.types import raw_layout
from kvcache.tiering.base import BlockWrite
from kvcache.tiering.config import DramConfig
from kvcache.tiering.dram import DramTier
from kvcache.tiering.slab import SlabAllocator, size_classes

KB = 1024


def _w(i, n=64 * KB):
    return BlockWrite(i.to_bytes(16, "little"), bytes(16), bytes([i % 256]) * n, raw_layout(n), 0.0)


def _k(i):
    return i.to_bytes(16, "little")


def test_size_classes_cover_powers_of_two_exactly():
    classes = size_classes(16 << 20)
    for p in range(12, 25):
        assert 1 << p in classes
    assert all(b > a for a, b in zip(classes, classes[1:]))


def test_slab_reuses_chunks_and_returns_pages():
    s = SlabAllocator(1 << 20, 256 * KB)
    offs = [s.alloc(64 * KB) for _ in range(16)]
    assert None not in offs and len(set(offs)) == 16
    assert s.alloc(64 * KB) is None
    s.free(offs[5])
    assert s.alloc(64 * KB) == offs[5]
    for o in offs[:4]:  # empty the first page: it may now serve another class
        s.free(o)
    assert s.alloc(200 * KB) is not None
    assert s.used_bytes == 12 * 64 * KB + s.chunk_size(200 * KB)


def test_a_block_larger_than_a_page_takes_a_span_of_contiguous_pages():
    s = SlabAllocator(1 << 20, 256 * KB)                  # pages 0-3
    small = s.alloc(64 * KB)                              # page 0
    span = s.alloc(300 * KB)                              # two pages: 1 and 2
    assert span == 256 * KB and s.chunk_at(span) == 512 * KB
    assert s.used_bytes == 64 * KB + 512 * KB
    assert s.alloc(300 * KB) is None                      # page 3 alone is not two contiguous pages
    s.free(small)
    assert s.alloc(300 * KB) is None                      # pages 0 and 3 are free, not adjacent
    s.free(span)
    assert s.used_bytes == 0
    assert s.alloc(700 * KB) == 0                         # three pages from 0, the freed span's among them
    with pytest.raises(ValueError, match="capacity"):
        s.alloc(2 << 20)


def test_a_block_larger_than_a_page_is_kept_and_warned_of_once(caplog):
    t, _ = _tier(cap=2 << 20, page=256 * KB, high_watermark=1.0, low_watermark=1.0)
    big = [_w(i, 300 * KB) for i in range(5)]             # two pages each: four fit in eight pages
    with caplog.at_level("WARNING"):
        for w in big:
            t.put([w])
    assert caplog.text.count("dram.page_bytes") == 1 and "takes 2 pages" in caplog.text
    kept = t.keys()
    assert len(kept) == 4 and big[0].key not in kept      # the oldest left to make room
    for w in big[1:]:
        assert t.get(w.key) == bytes(w.payload)
    t.close()


def _tier(cap=1 << 20, page=256 * KB, **kw):
    evicted = []
    cfg = DramConfig(capacity_bytes=cap, page_bytes=page, prefault=False, **kw)
    t = DramTier(cfg, on_evict=lambda blocks: evicted.extend((b.key, b.dirty, bytes(b.write.payload)) for b in blocks))
    return t, evicted


def test_lru_order_is_exact():
    t, evicted = _tier(high_watermark=1.0, low_watermark=1.0)
    t.put([_w(i) for i in range(16)])  # exactly full
    assert t.get(_k(0)) is not None    # 0 becomes most recent
    t.put([_w(16)])
    assert [e[0] for e in evicted] == [_k(1)]
    t.put([_w(17), _w(18)])
    assert [e[0] for e in evicted] == [_k(1), _k(2), _k(3)]
    assert t.contains(_k(0))


def test_fifo_ignores_reads():
    t, evicted = _tier(high_watermark=1.0, low_watermark=1.0, eviction="fifo")
    t.put([_w(i) for i in range(16)])
    t.get(_k(0))
    t.put([_w(16)])
    assert [e[0] for e in evicted] == [_k(0)]


def test_watermark_evicts_down_to_low():
    t, evicted = _tier(high_watermark=0.75, low_watermark=0.5)
    t.put([_w(i) for i in range(12)])  # 75 %: not above high
    assert not evicted
    t.put([_w(12)])
    assert t.usage().used_bytes <= 0.5 * t.usage().capacity_bytes
    assert [e[0] for e in evicted] == [_k(i) for i in range(len(evicted))]


def test_evicted_payload_is_intact_when_demoted():
    t, evicted = _tier(high_watermark=1.0, low_watermark=1.0)
    t.put([_w(i) for i in range(16)], dirty=True)
    t.put([_w(16)])
    key, dirty, payload = evicted[0]
    assert dirty and payload == bytes(_w(0).payload)


def test_pins_and_leases_block_eviction():
    t, evicted = _tier(high_watermark=1.0, low_watermark=1.0)
    t.put([_w(i) for i in range(16)])
    t.set_pin(_k(0), 1, 0.0)
    with t.view(_k(1)) as mv:
        t.put([_w(16)])
        assert bytes(mv[:1]) == b"\x01"
    assert [e[0] for e in evicted] == [_k(2)]
    for i in range(16):
        t.set_pin(_k(i), 1, 0.0)
    t.set_pin(_k(16), 1, 0.0)
    with pytest.raises(TierFullError, match="pinned"):
        t.put([_w(17)])


def test_delete_during_lease_frees_after():
    t, _ = _tier()
    t.put([_w(1)])
    used = t.usage().used_bytes
    with t.view(_k(1)) as mv:
        t.delete(_k(1))
        assert not t.contains(_k(1))
        assert t.usage().used_bytes == used  # still leased
        assert bytes(mv[:1]) == b"\x01"
    assert t.usage().used_bytes == used - 64 * KB


def test_pin_memory_on_without_accelerator_is_a_clear_error(monkeypatch):
    from kvcache.kvstore.errors import StoreError
    from kvcache.tiering import arena
    monkeypatch.setattr(arena, "load_cuda_runtime", lambda: None)     # a host without libcudart
    with pytest.raises(StoreError, match="pin_memory"):
        DramTier(DramConfig(capacity_bytes=1 << 20, page_bytes=256 * KB, pin_memory="on", prefault=False))
    t = DramTier(DramConfig(capacity_bytes=1 << 20, page_bytes=256 * KB, pin_memory="auto"))
    assert not t.pinned


# ---------------------------------------------------------------- landings (reserve / adopt / unreserve)
NS = bytes(16)


def tier(capacity: int, page: int) -> DramTier:
    return DramTier(DramConfig(capacity_bytes=capacity, page_bytes=page, pin_memory="off", prefault=False))

def test_a_payload_received_into_a_reservation_is_adopted_without_a_copy():
    t = tier(capacity=4 << 20, page=1 << 20)
    view = t.reserve(300_000)
    view[:] = b"k" * 300_000
    used = t.usage().used_bytes
    t.put([BlockWrite(b"a", NS, view, raw_layout(300_000), 0.0)])
    assert t.adopted == 1 and t.reserved_bytes == 0 and t.usage().used_bytes == used   # no second chunk
    assert t.get(b"a") == b"k" * 300_000
    assert t.unreserve([view]) == 0                    # adopted: not freed by a late release
    assert t.get(b"a") == b"k" * 300_000


def test_unadopted_reservations_are_freed_and_other_payloads_copied():
    t = tier(capacity=4 << 20, page=1 << 20)
    t.put([BlockWrite(b"a", NS, b"x" * 1000, raw_layout(1000), 0.0)])
    dup = t.reserve(1000)                              # a duplicate: put() keeps the existing block
    dup[:] = b"y" * 1000
    other = bytearray(b"z" * 1000)                     # writable, but not in the arena: copied
    t.put([BlockWrite(b"a", NS, dup, raw_layout(1000), 0.0), BlockWrite(b"b", NS, other, raw_layout(1000), 0.0)])
    assert t.adopted == 0 and t.get(b"a") == b"x" * 1000 and t.get(b"b") == b"z" * 1000
    before = t.usage().used_bytes
    assert t.unreserve([dup, memoryview(other), b"read-only"]) == 1
    assert t.reserved_bytes == 0 and t.usage().used_bytes < before


def test_reservations_are_bounded_and_never_evict():
    t = tier(capacity=8 << 20, page=1 << 20)
    views = []
    while (v := t.reserve(256 << 10)) is not None:
        views.append(v)
    assert 0 < t.reserved_bytes <= t.max_reserved_bytes   # an eighth of the arena at most
    t.unreserve(views)
    for i in range(31):                                   # 31 of 32 chunks: one more would pass 0.98
        t.put([BlockWrite(bytes([i]), NS, b"p" * (256 << 10), raw_layout(256 << 10), 0.0)])
    assert t.reserve(256 << 10) is None                   # above the watermark: put() must make room
    assert t.evictions == 0
