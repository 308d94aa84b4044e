"""Tenant shares of the DRAM arena ([dram.tenants], tiering/dram_shares.py): a tenant keeps its
share against the others' puts, may use more while they are idle, and evicts in its own order."""

import dataclasses

import pytest

from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.errors import TierFullError
from kvcache.tiering.config import DramConfig
from tests.tiering.test_dram import _k, _tier, _w


def _put(t, tenant, ids):
    t.put([dataclasses.replace(_w(i), tenant=tenant) for i in ids])


def _held(t, ids):
    return sum(t.contains(_k(i)) for i in ids)


FULL = dict(high_watermark=1.0, low_watermark=1.0)       # 16 blocks of 64 KiB, evict only when full


def test_a_flooding_tenant_evicts_its_own_blocks_not_a_neighbours_share():
    shared, _ = _tier(**FULL, tenants={"acme": {"share": 0.5}})
    plain, _ = _tier(**FULL)
    for t in (shared, plain):
        _put(t, "acme", range(8))                        # acme's reused prefixes: half the arena
        _put(t, "noisy", range(100, 140))                # a flood of one-off prompts
    assert _held(plain, range(8)) == 0                   # LRU alone washes acme out
    assert _held(shared, range(8)) == 8                  # the share keeps all of it
    assert _held(shared, range(100, 140)) == 8           # the flood churns its own half
    state = shared.policy_state()
    assert state["policy"] == "tenant-shares" and state["held"] == 16
    assert state["partitions"]["acme"]["held_bytes"] == 8 * 64 * 1024


def test_shares_are_floors_an_idle_arena_is_anyones_and_the_excess_goes_first():
    t, evicted = _tier(**FULL, tenants={"acme": {"share": 0.25}})
    _put(t, "noisy", range(100, 116))                    # acme is idle: noisy fills the arena
    assert _held(t, range(100, 116)) == 16
    _put(t, "acme", range(4))                            # acme takes its 4 blocks back from noisy
    assert _held(t, range(4)) == 4 and len(evicted) == 4
    _put(t, "acme", range(4, 8))                         # beyond its share acme competes, and loses
    assert _held(t, range(8)) == 4                       # its own oldest went, not noisy's
    assert {e[0] for e in evicted[4:]} == {_k(i) for i in range(4)}


def test_each_partition_evicts_in_its_own_order():
    t, _ = _tier(**FULL, eviction="lru", tenants={"acme": {"share": 0.5, "eviction": "fifo"}})
    _put(t, "acme", range(8))
    _put(t, "other", range(100, 108))
    t.get(_k(0))                                         # fifo: a read does not save it
    t.get(_k(100))                                       # lru: a read does
    _put(t, "acme", [8])
    _put(t, "other", [108])
    assert not t.contains(_k(0)) and t.contains(_k(1))
    assert t.contains(_k(100)) and not t.contains(_k(101))
    parts = t.policy_state()["partitions"]
    assert parts["acme"]["policy"] == "fifo" and parts["(rest)"]["policy"] == "lru"


def test_pinned_blocks_above_a_share_pass_the_eviction_to_the_next_partition():
    t, _ = _tier(**FULL, tenants={"acme": {"share": 0.25}})
    _put(t, "acme", range(12))                           # acme over its share of 4 ...
    for i in range(12):
        t.set_pin(_k(i), 1, 0.0)                         # ... but every block of it pinned
    _put(t, "other", range(100, 104))
    _put(t, "other", [104])                              # room comes from other's own blocks
    assert _held(t, range(12)) == 12 and not t.contains(_k(100)) and t.contains(_k(104))
    for i in range(100, 105):
        if t.contains(_k(i)):
            t.set_pin(_k(i), 1, 0.0)
    with pytest.raises(TierFullError, match="pinned"):
        _put(t, "other", [200])


def test_a_lookup_teaches_only_its_tenants_order():
    t, _ = _tier(**FULL, tenants={"acme": {"share": 0.5, "eviction": "duel"}}, eviction="duel")
    _put(t, "acme", range(4))
    before = t.policy_state()["partitions"]
    t.begin([_k(0), _k(1)], tenant="acme")
    after = t.policy_state()["partitions"]
    assert after["(rest)"] == before["(rest)"]
    assert after["acme"] != before["acme"]               # its shadows scored the lookup


@pytest.mark.parametrize("tenants, match", [
    ({"acme": {"share": 0.7}, "beta": {"share": 0.5}}, "add up to 1.2"),
    ({"acme": {"share": 0}}, "share must be a fraction"),
    ({"acme": {"share": "half"}}, "share must be a fraction"),
    ({"acme": {"share": 0.5, "eviction": "mru"}}, "eviction must be one of"),
    ({"acme": {"share": 0.5, "weight": 2}}, "unknown settings"),
    ({"acme": 0.5}, "must be a table"),
])
def test_bad_tenant_shares_are_refused_with_what_to_write(tenants, match):
    with pytest.raises(ValueError, match=match):
        DramConfig(tenants=tenants)


def test_tenant_shares_come_from_the_store_toml(tmp_path):
    acme = {"share": 0.3, "eviction": "s3fifo"}
    cfg = StoreConfig.from_dict({"store": {"data_dir": str(tmp_path)},
                                 "dram": {"capacity_mib": 1, "tenants": {"acme": acme}}})
    assert cfg.dram.tenant_shares() == {"acme": (0.3, "s3fifo")}
