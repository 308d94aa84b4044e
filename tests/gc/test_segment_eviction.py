"""NVMe capacity by segment (gc/segment_eviction.py): the oldest segments lose their cold blocks
and go; read, recently written and pinned blocks are copied forward intact."""

import random

import pytest

from kvcache.gc import segment_eviction
from kvcache.gc.collector import Collector
from kvcache.kvstore.types import BlockMeta, Tier
from kvcache.tiering.config import NvmeConfig
from tests.conftest import make_keys, payload_for, put_blocks

BLOCK = 16384


def _store(make_store, capacity=4 << 20, **kw):
    cfg = NvmeConfig(segment_bytes=1 << 20, capacity_bytes=capacity, high_watermark=0.9, low_watermark=0.7, **kw)
    return make_store(dram_mib=None, nvme_config=cfg)


def _fill(s, clock, keys):
    for i in range(0, len(keys), 10):
        put_blocks(s, keys[i:i + 10], n=BLOCK)
        clock.advance(seconds=60)


def test_the_oldest_segment_goes_and_what_was_read_is_copied_intact(make_store, clock):
    s = _store(make_store)
    keys = make_keys(300)
    _fill(s, clock, keys[:200])                                  # ~3.2 MiB: under the watermark
    first = s.index.get(keys[0]).segment_id
    in_first = [i for i in range(200) if s.index.get(keys[i]).segment_id == first]
    read = in_first[::4]
    for i in read:
        assert s.get(keys[i]) == payload_for(keys[i], BLOCK)
    clock.advance(seconds=60)
    s.pin([keys[in_first[1]]])
    _fill(s, clock, keys[200:])                                  # puts make room
    assert first not in s.nvme.segment_ids()
    assert s.nvme.disk_bytes() <= 0.9 * s.nvme.capacity_bytes()
    for i in read + [in_first[1]]:                                # copied forward, bytes intact
        assert s.index.get(keys[i]).segment_id != first and s.get(keys[i]) == payload_for(keys[i], BLOCK)
    cold = [i for i in in_first if i not in read and i != in_first[1]]
    assert all(s.index.get(keys[i]) is None for i in cold)
    assert all(s.get(keys[i]) == payload_for(keys[i], BLOCK) for i in range(280, 300))   # the newest stay
    assert s.stats().counters["evictions_nvme"] >= len(cold)
    from kvcache.gc.fsck import check
    assert check(s).ok


def test_a_segment_of_hot_blocks_still_frees_room(make_store, clock):
    """Every block read since the threshold: the coldest MIN_EVICTED of the segment go anyway,
    so a put never copies a whole segment to free nothing."""
    s = _store(make_store)
    keys = make_keys(200)
    _fill(s, clock, keys)
    for i in range(200):
        s.get(keys[i])
    sid = s.index.get(keys[0]).segment_id
    live = s.index.segments()[sid].live_bytes
    freed, n = segment_eviction.evict_cold(s, sid, threshold=0.0, now=clock())
    assert n > 0 and segment_eviction.MIN_EVICTED * live <= freed < 0.5 * live


def test_with_no_sealed_segment_the_sampled_rule_evicts(make_store, clock):
    """A tier smaller than a segment: nothing to drop yet, but lookups must miss what is over
    capacity (the sampled rule's eviction), or the tier would grow past it unchecked."""
    cfg = NvmeConfig(segment_bytes=4 << 20, capacity_bytes=1 << 20, high_watermark=0.9, low_watermark=0.7)
    s = make_store(dram_mib=None, nvme_config=cfg)
    keys = make_keys(100)
    _fill(s, clock, keys)
    assert s.stats().counters["evictions_nvme"] > 0
    live = sum(u.live_bytes for u in s.index.segments().values())
    assert live <= 0.9 * (1 << 20) + 10 * (BLOCK + 512)                  # the watermark, plus one put


def test_the_threshold_is_the_sampled_quantile():
    class Index:
        def __init__(self, rec):
            self.rows = [(bytes([i]), BlockMeta(b"n", 1, Tier.NVME, created=r, last_access=0.0))
                         for i, r in enumerate(rec)]

        def sample(self, n, rng):
            return self.rows
    assert segment_eviction.cold_threshold(Index([40, 10, 30, 20]), random.Random(0), 0.5) == 30
    assert segment_eviction.cold_threshold(Index([40, 10, 30, 20]), random.Random(0), 0.0) == 10
    assert segment_eviction.cold_threshold(Index([]), random.Random(0), 0.5) == float("-inf")


@pytest.mark.parametrize("rule", ["segment-lru", "sampled-lru"])
def test_recency_beats_insertion_order_under_either_rule(make_store, clock, rule):
    s = _store(make_store, eviction=rule)
    keys = make_keys(300)
    _fill(s, clock, keys[:200])
    for k in keys[:20]:                                          # the oldest blocks, but read lately
        s.get(k)
    s.index.flush_touches()
    clock.advance(seconds=60)
    _fill(s, clock, keys[200:])
    Collector(s, sample=32).step()
    kept = [s.index.get(k) is not None for k in keys]
    assert sum(kept[:20]) > sum(kept[20:40]) and all(kept[-20:])
