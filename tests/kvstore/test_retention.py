"""Retention across simulated days: 72 h default, overrides, pins, GC and compaction."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.gc.collector import Collector
from kvcache.kvstore.retention import HOUR, RetentionPolicy, RetentionRule
from kvcache.kvstore.types import BlockMeta
from tests.conftest import NS, make_keys, payload_for, put_blocks


def test_rule_precedence_and_expiry_math():
    p = RetentionPolicy(RetentionRule(72 * HOUR), namespaces={"docs": RetentionRule(24 * HOUR)},
                        tenants={"gold": RetentionRule(240 * HOUR, max_age_s=300 * HOUR)})
    m = BlockMeta(bytes(16), 1, created=0.0, last_access=10 * HOUR)
    assert p.expires_at(m) == 82 * HOUR
    assert p.expires_at(m, "docs") == 34 * HOUR
    m.tenant = "gold"
    assert p.expires_at(m, "docs") == 250 * HOUR     # tenant beats namespace
    m.last_access = 100 * HOUR
    assert p.expires_at(m) == 300 * HOUR             # capped by max age
    assert not p.is_expired(m, 299 * HOUR) and p.is_expired(m, 300 * HOUR)
    m.hard_pins = 1
    assert not p.is_expired(m, 10_000 * HOUR)


_hours = st.floats(0.01, 500)
_rule = st.builds(RetentionRule, _hours.map(lambda h: h * HOUR), st.none() | _hours.map(lambda h: h * HOUR))


@settings(max_examples=300, deadline=None)
@given(default=_rule, ns_rule=_rule, tenant_rule=_rule, created=st.floats(0, 1e6), idle=st.floats(0, 1e6),
       age=st.floats(0, 3e6), pins=st.integers(0, 1), deadline=st.floats(0, 3e6), namespace=st.sampled_from(["", "a"]),
       tenant=st.sampled_from(["", "t"]))
def test_surely_live_is_a_lower_bound_of_every_rule(default, ns_rule, tenant_rule, created, idle, age, pins,
                                                    deadline, namespace, tenant):
    """The read path's shortcut never calls a block live that is_expired, under any rule it may fall under."""
    policy = RetentionPolicy(default, {"a": ns_rule}, {"t": tenant_rule})
    meta = BlockMeta(NS.id, 1, created=created, last_access=created + idle, hard_pins=pins,
                     expires_at=deadline if deadline > 1e6 else 0.0, tenant=tenant)
    now = created + age
    if policy.surely_live(meta, now):
        assert not policy.is_expired(meta, now, namespace)


@settings(max_examples=300, deadline=None)
@given(default=_rule, ns_rule=_rule, created=st.lists(st.floats(0, 1e6), min_size=1, max_size=5),
       age=st.floats(0, 3e6), deadline=st.lists(st.floats(0, 3e6), min_size=5, max_size=5))
def test_surely_live_all_is_a_lower_bound_for_every_block(default, ns_rule, created, age, deadline):
    """The batch shortcut never calls a batch live that holds a block is_expired would drop."""
    policy = RetentionPolicy(default, {"a": ns_rule})
    metas = [BlockMeta(NS.id, 1, created=c, last_access=c, expires_at=d if d > 2e6 else 0.0)
             for c, d in zip(created, deadline)]
    now = max(created) + age
    if policy.surely_live_all(metas, now):
        assert not any(policy.is_expired(m, now, ns) for m in metas for ns in ("", "a"))


def test_surely_live_all_of_young_blocks_and_of_none():
    policy = RetentionPolicy(RetentionRule(2 * HOUR, 3 * HOUR))
    metas = [BlockMeta(NS.id, 1, created=c * HOUR, last_access=c * HOUR) for c in (0.0, 0.5)]
    assert policy.surely_live_all(metas, 1.9 * HOUR) and policy.surely_live_all([], 1e9)
    assert not policy.surely_live_all(metas, 2.1 * HOUR)                 # the older one may be expired
    metas[1].expires_at = 10 * HOUR                                       # a deadline of its own: ask per block
    assert not policy.surely_live_all(metas, 0.1 * HOUR)


def test_surely_live_says_so_for_a_fresh_block():
    policy = RetentionPolicy(RetentionRule(2 * HOUR), {"a": RetentionRule(1 * HOUR, 3 * HOUR)})
    meta = BlockMeta(NS.id, 1, created=0.0, last_access=0.0)
    assert policy.surely_live(meta, 0.5 * HOUR)
    assert not policy.surely_live(meta, 1.5 * HOUR) and not policy.is_expired(meta, 1.5 * HOUR)   # ask the rule


def test_policy_from_toml_dict():
    p = RetentionPolicy.from_dict({"ttl_hours": 96, "max_age_hours": 720,
                                   "namespaces": {"docs": {"ttl_hours": 12}},
                                   "tenants": {"acme": {"ttl_hours": 168}}})
    assert p.default == RetentionRule(96 * HOUR, 720 * HOUR)
    assert p.rule("docs", "").ttl_s == 12 * HOUR and p.rule("docs", "acme").ttl_s == 168 * HOUR
    with pytest.raises(ValueError, match="ttl_hours"):
        RetentionPolicy.from_dict({"ttl": 5})


def test_blocks_live_72_hours_from_last_access(make_store, clock):
    s = make_store()
    keys = make_keys(4)
    put_blocks(s, keys)
    clock.advance(hours=48)
    assert s.get(keys[0]) == payload_for(keys[0])    # refreshes block 0 only
    clock.advance(hours=23)                         # 71 h after the put
    assert s.lookup(keys).num_hits == 4
    clock.advance(hours=2)                          # 73 h: expired, even before any GC
    assert s.lookup(keys).num_hits == 1             # block 0 was read 25 h ago
    assert s.get(keys[1]) is None
    clock.advance(hours=48)                         # 73 h after block 0's read
    assert s.lookup(keys).num_hits == 0


def test_access_times_survive_restart(make_store, clock):
    s = make_store()
    keys = make_keys(2)
    put_blocks(s, keys)
    clock.advance(hours=60)
    s.get(keys[0])
    s.close()
    s = make_store()
    clock.advance(hours=20)  # 80 h after put, 20 h after the read
    assert [s.get(k) is not None for k in keys] == [True, False]


def test_pins_respected_across_days(make_store, clock):
    s = make_store()
    keys = make_keys(3)
    put_blocks(s, keys)
    s.pin(keys[:1])                  # hard pin
    s.pin(keys[1:2], ttl_s=100 * HOUR)  # soft pin
    clock.advance(hours=90)
    assert s.lookup(keys).num_hits == 2 and s.get(keys[2]) is None
    rep = Collector(s).run()
    assert rep.expired == 1
    clock.advance(hours=20)          # soft pin lapsed at 100 h; last access was at 0 h
    assert s.get(keys[1]) is None
    assert s.get(keys[0]) == payload_for(keys[0])
    clock.advance(hours=1000)
    assert s.get(keys[0]) is not None
    s.unpin(keys[:1])
    clock.advance(hours=73)
    assert s.get(keys[0]) is None


def test_namespace_and_tenant_overrides(make_store, clock):
    s = make_store(retention=RetentionPolicy(namespaces={"test": RetentionRule(10 * HOUR)},
                                             tenants={"gold": RetentionRule(500 * HOUR)}))
    a, b = make_keys(1), make_keys(1, start=100)
    put_blocks(s, a)
    put_blocks(s, b, tenant="gold")
    clock.advance(hours=11)
    assert s.get(a[0]) is None and s.get(b[0]) is not None


def test_gc_deletes_expired_and_compaction_reclaims_space(make_store, clock):
    s = make_store(dram_mib=None)
    old, new = make_keys(200), make_keys(50, start=10_000)
    put_blocks(s, old, n=16384)
    clock.advance(hours=50)
    put_blocks(s, new, n=16384)
    disk_before = s.nvme.disk_bytes()
    clock.advance(hours=30)          # old: 80 h idle; new: 30 h
    rep = Collector(s, batch=64).run()
    assert rep.expired == 200 and rep.segments_removed >= 2
    assert s.index.count() == 50
    assert s.nvme.disk_bytes() < disk_before * 0.5
    assert all(s.get(k) == payload_for(k, 16384) for k in new)
    assert s.stats().persistent_counters["expired"] == 200


def test_compaction_moves_live_blocks(make_store, clock):
    s = make_store(dram_mib=None)
    keys = make_keys(120)
    put_blocks(s, keys, n=16384)        # ~2 MiB over 1 MiB segments
    s.delete(keys[::3] + keys[1::3])    # leave a third live in every segment
    before = {k: s.index.get(k).segment_id for k in keys[2::3]}
    rep = Collector(s).run()
    assert rep.segments_compacted >= 1
    after = {k: s.index.get(k).segment_id for k in keys[2::3]}
    assert any(before[k] != after[k] for k in before)
    assert all(s.get(k) == payload_for(k, 16384) for k in keys[2::3])
    assert all(s.get(k) is None for k in keys[::3])
    from kvcache.gc.fsck import check
    assert check(s).ok


def test_nvme_capacity_eviction_prefers_least_recent(make_store, clock):
    from kvcache.tiering.config import NvmeConfig
    cfg = NvmeConfig(segment_bytes=1 << 20, capacity_bytes=4 << 20, high_watermark=0.9, low_watermark=0.6)
    s = make_store(dram_mib=None, nvme_config=cfg)
    keys = make_keys(300)
    for i in range(0, 200, 20):          # 3.2 MiB: under the watermark, nothing evicted
        put_blocks(s, keys[i:i + 20], n=16384)
        clock.advance(seconds=60)
    assert s.stats().counters.get("evictions_nvme", 0) == 0
    for k in keys[:20]:                  # the oldest blocks, but recently read
        s.get(k)
    s.index.flush_touches()
    clock.advance(seconds=60)
    for i in range(200, 300, 20):        # now puts must make room
        put_blocks(s, keys[i:i + 20], n=16384)
        clock.advance(seconds=60)
    Collector(s, sample=32).step()
    assert s.stats().counters["evictions_nvme"] > 0
    live = sum(u.live_bytes for u in s.index.segments().values())
    assert live <= 0.9 * (4 << 20)
    kept = [s.index.get(k) is not None for k in keys]
    assert sum(kept[:20]) > sum(kept[20:40])   # recency beats insertion order
    assert all(kept[-20:])                     # the newest blocks are all there


def test_puts_make_room_without_a_gc_thread(make_store, clock):
    """A full NVMe tier evicts and compacts on the put path: puts never fail for space."""
    from kvcache.tiering.config import NvmeConfig
    cfg = NvmeConfig(segment_bytes=1 << 20, capacity_bytes=4 << 20, high_watermark=0.9, low_watermark=0.6)
    s = make_store(dram_mib=None, nvme_config=cfg)
    keys = make_keys(1000)
    for i in range(0, 1000, 25):
        assert put_blocks(s, keys[i:i + 25], n=16384).stored == 25
        clock.advance(seconds=10)
    assert s.nvme.disk_bytes() <= 5 << 20
    assert all(s.get(k) == payload_for(k, 16384) for k in keys[-25:])
    assert s.stats().counters["evictions_nvme"] > 0


def test_explicit_ttl_per_block(make_store, clock):
    from kvcache.kvstore.errors import BlockFormatError
    from kvcache.kvstore.types import PutItem
    s = make_store()
    short, long_, default = make_keys(1), make_keys(1, start=100), make_keys(1, start=200)
    s.put(short[0], payload_for(short[0]), NS.id, ttl_s=2 * HOUR)
    s.put_many([PutItem(long_[0], payload_for(long_[0]), NS.id, ttl_s=200 * HOUR)])
    put_blocks(s, default)
    clock.advance(hours=3)
    assert s.get(short[0]) is None and s.get(default[0]) is not None
    s.close()
    s = make_store()                       # the deadline is in the index: it survives restarts
    clock.advance(hours=100)
    assert s.get(long_[0]) == payload_for(long_[0]) and s.get(default[0]) is None
    clock.advance(hours=100)
    assert s.get(long_[0]) is None
    with pytest.raises(BlockFormatError, match="ttl_s"):
        s.put(make_keys(1, start=300)[0], b"x", NS.id, ttl_s=0)


def test_expiry_never_writes_back_a_stale_scan(make_store, clock, monkeypatch):
    """Expiry scans unlocked, then clears lapsed soft pins under the lock: a delete or a hard pin
    that lands in between is kept (the scan's old copy resurrected the deleted block, or
    wiped the pin; found by review)."""
    s = make_store()
    keys = make_keys(3)
    put_blocks(s, keys)
    s.pin(keys, ttl_s=1 * HOUR)
    clock.advance(hours=2)                          # the soft pins have lapsed; the blocks have not expired
    real_scan = s.index.scan

    def scan_then_race(cursor, n):
        chunk = real_scan(cursor, n)
        s.delete(keys[:1])                          # lands between the scan and the commit
        s.pin(keys[1:2])                            # a hard pin, likewise
        return chunk
    monkeypatch.setattr(s.index, "scan", scan_then_race)
    Collector(s).step()
    monkeypatch.undo()
    assert s.index.get(keys[0]) is None and s.get(keys[0]) is None
    assert s.index.get(keys[1]).hard_pins == 1
    assert s.index.get(keys[2]).soft_pin_until == 0.0


def test_capacity_eviction_skips_a_victim_pinned_after_sampling(make_store, clock, monkeypatch):
    import dataclasses
    from kvcache.tiering.config import NvmeConfig
    cfg = NvmeConfig(segment_bytes=1 << 20, capacity_bytes=4 << 20, high_watermark=0.9, low_watermark=0.6,
                     eviction="sampled-lru")
    s = make_store(dram_mib=None, nvme_config=cfg)
    keys = make_keys(100)
    put_blocks(s, keys, n=16384)                    # 1.6 MiB: under the watermark while putting
    s.nvme.config = dataclasses.replace(cfg, capacity_bytes=3 << 19)   # 1.5 MiB: now over it, GC evicts
    col = Collector(s, sample=200)
    real_pick = col._pick_victim
    pinned = []

    def pick_then_pin(now):
        victim = real_pick(now)
        if victim is not None and not pinned:
            s.pin([victim[0]])                      # pinned after it was sampled
            pinned.append(victim[0])
        return victim
    monkeypatch.setattr(col, "_pick_victim", pick_then_pin)
    assert col.step().evicted > 0
    meta = s.index.get(pinned[0])
    assert meta is not None and meta.hard_pins == 1


def test_dram_only_expiry_reaches_past_its_first_batch(make_store, clock):
    """Expiry of DRAM-only blocks walks all of them a batch per step: expired blocks behind a
    batch of long-lived ones were never collected (it always looked at the first batch)."""
    s = make_store(nvme=False)
    keep, short = make_keys(6), make_keys(6, start=1000)
    put_blocks(s, keep)
    s.pin(keep)                                     # never expire
    put_blocks(s, short)
    clock.advance(hours=80)                         # past the 72 h default: `short` expired
    col = Collector(s, batch=4)
    expired = sum(col.step().expired for _ in range(8))     # a few passes of 4: every block seen
    assert expired == len(short) and all(k in s._dram_meta for k in keep)


def test_access_times_stay_visible_while_they_are_flushed(make_store, clock, monkeypatch):
    import contextlib
    s = make_store()
    keys = make_keys(1)
    put_blocks(s, keys)
    clock.advance(hours=10)
    s.get(keys[0])                                  # buffered access time: now
    read_at = clock()
    assert s.index.pending_touches() == 1
    seen, real = [], s.index._write

    @contextlib.contextmanager
    def spying_write():
        seen.append(s.index.get(keys[0]).last_access)   # a reader while the flush writes
        with real() as txn:
            yield txn
    monkeypatch.setattr(s.index, "_write", spying_write)
    s.index.flush_touches()
    monkeypatch.undo()
    assert seen == [read_at] and s.index.get(keys[0]).last_access == read_at
