"""BlockStore with an object tier below NVMe (a file:// pack directory here; the tier itself is
tested against a real S3 server in tests/tiering/test_object_store.py)."""

import pytest

from kvcache.gc.collector import Collector
from kvcache.gc.fsck import check
from kvcache.kvstore import Tier
from kvcache.kvstore.config import StoreConfig
from kvcache.tiering.config import NvmeConfig, ObjectConfig
from tests.conftest import make_keys, payload_for, put_blocks


@pytest.fixture
def object_store(make_store, tmp_path):
    def factory(**kw):
        cfg = ObjectConfig(url=f"file://{tmp_path / 'bucket'}", pack_linger_s=0.05, **kw)
        return make_store(dram_mib=None, object_store=cfg,
                          nvme_config=NvmeConfig(segment_bytes=1 << 20, capacity_bytes=2 << 20,
                                                 high_watermark=0.9, low_watermark=0.5))
    return factory


def test_blocks_reach_the_object_tier_and_serve_after_nvme_eviction(object_store, clock):
    s = object_store()
    keys = make_keys(60)
    put_blocks(s, keys, n=16384)        # ~1 MiB: under the NVMe watermark
    s.flush()                           # waits for the packs to land
    assert s.stats().counters["object_stored"] == 60
    assert set(s.lookup(keys).tiers) == {Tier.NVME}          # NVMe is the faster copy
    more = make_keys(80, start=10_000)
    for i in range(0, 80, 10):          # push NVMe over its watermark: old blocks lose NVMe copies
        put_blocks(s, more[i:i + 10], n=16384)
        clock.advance(seconds=30)
    Collector(s).step()
    tiers = s.lookup(keys).tiers
    assert Tier.OBJECT in tiers and len(tiers) == 60        # nothing lost: still a full prefix
    objects_only = [k for k, t in zip(keys, tiers) if t == Tier.OBJECT]
    assert all(s.get(k) == payload_for(k, 16384) for k in objects_only)
    assert s.stats().counters["hits_object"] == len(objects_only)
    assert check(s).ok


def test_object_locations_survive_restart_and_delete_forgets_them(object_store, make_store, clock):
    s = object_store()
    keys = make_keys(5)
    put_blocks(s, keys)
    s.close()
    s = object_store()
    assert all(s.index.object_location(k) is not None for k in keys)
    s.delete(keys[:2])
    assert s.index.object_location(keys[0]) is None and s.get(keys[0]) is None
    assert s.get(keys[3]) == payload_for(keys[3])


def test_corrupt_object_copy_is_quarantined_not_served(object_store, tmp_path):
    s = object_store()
    keys = make_keys(3)
    put_blocks(s, keys)
    s.flush()
    # drop the NVMe copies so reads must come from the pack
    for k in keys:
        meta = s.index.get(k)
        meta.residency = Tier.NONE
        s.index.commit({k: meta})
    p = s.index.object_location(keys[1])
    pack = next((tmp_path / "bucket").rglob(f"*{p.segment_id:010d}*"))
    data = bytearray(pack.read_bytes())
    data[p.offset + p.record_len - 10] ^= 0xFF
    pack.write_bytes(bytes(data))
    assert s.get(keys[1]) is None
    assert s.index.object_location(keys[1]) is None
    assert s.get(keys[0]) == payload_for(keys[0]) and s.get(keys[2]) == payload_for(keys[2])


def test_object_tier_needs_nvme(tmp_path):
    with pytest.raises(ValueError, match="below NVMe"):
        StoreConfig(str(tmp_path), nvme=None, object_store=ObjectConfig(url=f"file://{tmp_path}"))


def test_lookup_prefetches_object_only_blocks_into_dram(make_store, tmp_path, clock):
    from kvcache.tiering.config import ObjectConfig
    cfg = ObjectConfig(url=f"file://{tmp_path / 'bucket'}", pack_linger_s=0.05)
    s = make_store(dram_mib=4, object_store=cfg)
    keys = make_keys(8)
    put_blocks(s, keys)
    s.flush()
    for k in keys:  # leave only the object copies
        s.dram.delete(k)
        meta = s.index.get(k)
        meta.residency = Tier.NONE
        s.index.commit({k: meta})
    assert set(s.lookup(keys).tiers) == {Tier.OBJECT}
    s._prefetcher.shutdown(wait=True)   # let the prefetches finish
    assert s.stats().counters["prefetched"] == 8
    assert set(s.lookup(keys).tiers) == {Tier.DRAM}
    assert all(s.get(k) == payload_for(k) for k in keys)
    assert s.stats().counters.get("hits_object", 0) == 0


def test_gc_reclaims_sparse_and_dead_packs(make_store, tmp_path, clock):
    from kvcache.tiering.config import ObjectConfig
    cfg = ObjectConfig(url=f"file://{tmp_path / 'bucket'}", pack_linger_s=0.05, pack_max_blocks=20)
    s = make_store(dram_mib=None, object_store=cfg)
    keys = make_keys(200)
    put_blocks(s, keys)                 # 10 packs of 20 blocks
    s.flush()
    packs_before = s.object.list_packs()
    assert len(packs_before) == 10 and sum(u.live_blocks for u in s.index.pack_usage().values()) == 200
    s.delete(keys[:20])                 # pack 1: dead
    s.delete([k for i, k in enumerate(keys[20:40]) if i % 4])   # pack 2: a quarter live
    rep = Collector(s).run()
    assert rep.packs_removed >= 2 and rep.packs_compacted >= 1
    packs_after = s.object.list_packs()
    assert min(packs_before) not in packs_after
    usage = s.index.pack_usage()
    assert sum(u.live_blocks for u in usage.values()) == 200 - 20 - 15
    survivors = keys[20:40:4] + keys[40:]
    for k in survivors:                 # read from the object copy: drop the NVMe ones
        meta = s.index.get(k)
        meta.residency = Tier.NONE
        s.index.commit({k: meta})
    assert all(s.get(k) == payload_for(k) for k in survivors)
    assert all(s.get(k) is None for k in keys[:20])


def test_index_rebuilt_from_packs_keeps_object_only_blocks_and_deletes(make_store, tmp_path, clock):
    import shutil
    from kvcache.tiering.config import ObjectConfig
    cfg = ObjectConfig(url=f"file://{tmp_path / 'bucket'}", pack_linger_s=0.05, pack_max_blocks=10)
    s = make_store(dram_mib=None, object_store=cfg)
    keys = make_keys(40)
    put_blocks(s, keys)
    s.flush()
    s.delete(keys[:2])                  # 2 of the first pack's 10: too live to compact
    clock.advance(seconds=1)
    later = make_keys(50, start=5_000)
    put_blocks(s, later)                # five newer packs: the tombstone pack is old enough for GC
    s.flush()
    rep = Collector(s).run()            # it has no live blocks: reclaimed, tombstones carried on
    assert rep.packs_removed >= 1
    s.close()
    shutil.rmtree(tmp_path / "data")    # lose the NVMe tier and the index: only packs remain
    s = make_store(dram_mib=None, object_store=cfg)
    assert s.index.count() == 88
    assert all(s.get(k) is None for k in keys[:2])
    assert all(s.get(k) == payload_for(k) for k in keys[2:] + later)
    assert set(s.lookup(keys[2:]).tiers) == {Tier.OBJECT}


def _object_only(s, keys):
    """Drop the NVMe copies so reads must come from the packs."""
    for k in keys:
        meta = s.index.get(k)
        meta.residency = Tier.NONE
        s.index.commit({k: meta})


def _pack_file(tmp_path, s, key):
    p = s.index.object_location(key)
    return next((tmp_path / "bucket").rglob(f"*{p.segment_id:010d}*"))


def test_packs_deleted_by_a_lifecycle_rule_become_misses_not_corruption(object_store, tmp_path):
    s = object_store()
    first = make_keys(3)
    put_blocks(s, first)
    s.flush()
    second = make_keys(3, start=500)
    put_blocks(s, second)
    s.flush()
    _object_only(s, first + second)
    assert _pack_file(tmp_path, s, first[0]) != _pack_file(tmp_path, s, second[0])
    _pack_file(tmp_path, s, first[0]).unlink()            # the bucket's rule expired the first pack
    assert s.get(first[0]) is None                        # a miss, and that copy is forgotten
    assert s.index.object_location(first[0]) is None
    c = s.stats().counters
    assert c["object_vanished"] == 1 and c.get("quarantined", 0) == 0
    vanished_pack = _pack_file(tmp_path, s, second[0])
    vanished_pack.unlink()
    r = Collector(s).step()                               # GC notices both packs are gone: all their copies go
    assert r.packs_vanished == 2 and s.stats().counters["object_vanished"] == 1 + 5
    assert all(s.index.object_location(k) is None for k in first + second)
    assert s.lookup(second).num_hits == 0                 # no phantom hits, no GETs for missing objects
    assert int(vanished_pack.name.split(".")[0].split("-")[-1]) not in s.index.pack_usage()
    assert s.get(first[1]) is None and s.stats().counters.get("quarantined", 0) == 0


def test_check_objects_verifies_every_copy_and_fix_forgets_bad_ones(object_store, tmp_path):
    s = object_store()
    keys = make_keys(4)
    put_blocks(s, keys)
    s.flush()
    rep = check(s, objects=True)
    assert rep.ok and rep.objects_checked == 4
    pack = _pack_file(tmp_path, s, keys[2])
    p = s.index.object_location(keys[2])
    data = bytearray(pack.read_bytes())
    data[p.offset + p.record_len - 5] ^= 0x55
    pack.write_bytes(bytes(data))
    assert check(s).ok                                     # without --objects the copies are not read
    rep = check(s, objects=True)
    assert not rep.ok and list(rep.bad_object_copies) == [keys[2].hex()]
    rep = check(s, objects=True, fix=True)
    assert s.index.object_location(keys[2]) is None and s.get(keys[2]) == payload_for(keys[2])   # NVMe copy stays
    assert check(s, objects=True).ok


def test_retention_longer_than_the_bucket_lifecycle_warns(object_store, caplog):
    with caplog.at_level("WARNING"):
        object_store(lifecycle_days=1)                     # retention: 72 h by default
    assert "lifecycle rule deletes objects after 1.0 days" in caplog.text
    with pytest.raises(ValueError, match="lifecycle_days"):
        ObjectConfig(url="file:///tmp/x", lifecycle_days=-1)


def test_a_corrupt_nvme_copy_leaves_the_object_copy_serving(object_store):
    s = object_store()
    keys = make_keys(3)
    put_blocks(s, keys)
    s.flush()                                       # the packs have landed
    meta = s.index.get(keys[1])
    with open(s.nvme.path(meta.segment_id), "r+b") as f:
        f.seek(meta.offset + meta.record_len - 10)
        f.write(b"\xff\xfe")
    assert s.get(keys[1]) == payload_for(keys[1])   # served from the object tier
    after = s.index.get(keys[1])
    assert after is not None and Tier.NVME not in after.residency and s.index.object_location(keys[1])
    assert s.stats().persistent_counters["quarantined"] == 1
    assert s.get(keys[1]) == payload_for(keys[1])
