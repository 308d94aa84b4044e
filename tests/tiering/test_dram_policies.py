"""The DRAM tier under each eviction order of kvcache/policy (dram.eviction): the tier's rules
(pins, leases, capacity) hold under all of them, and each order's own behaviour shows."""

import itertools

import pytest

from kvcache.kvstore.errors import TierFullError
from kvcache.policy import NAMES, make_order
from tests.tiering.test_dram import _k, _tier, _w


@pytest.mark.parametrize("name", NAMES)
def test_pins_leases_and_capacity_hold_under_every_order(name):
    t, evicted = _tier(high_watermark=1.0, low_watermark=1.0, eviction=name)
    t.put([_w(i) for i in range(16)])                    # exactly full
    t.set_pin(_k(0), 1, 0.0)
    with t.view(_k(1)):
        t.put([_w(i) for i in range(16, 40)])
    gone = {e[0] for e in evicted}
    assert _k(0) not in gone and _k(1) not in gone and t.contains(_k(0)) and t.contains(_k(1))
    assert len(gone) == 24 and all(t.contains(_k(i)) != (_k(i) in gone) for i in range(40))
    assert t.policy_state()["held"] == 16 == t.usage().blocks
    for i in range(40):
        t.set_pin(_k(i), 1, 0.0)
    with pytest.raises(TierFullError, match="pinned"):
        t.put([_w(99)])
    t.delete(_k(0))
    assert t.policy_state()["held"] == 15
    t.close()


def _scan_workload(t, rounds=6):
    """Four blocks read over and over, between floods of blocks nobody reads again; the hot
    blocks still held at the end."""
    hot = [_k(i) for i in range(4)]
    t.put([_w(i) for i in range(4)])
    nxt = 100
    for _ in range(rounds):
        for k in hot:
            t.begin([k])                                 # a lookup, as the store makes
            if t.contains(k):
                t.get(k)
            else:
                t.put([_w(int.from_bytes(k, "little"))])
        t.put([_w(nxt + j) for j in range(14)])          # a flood of one-off blocks
        nxt += 14
    return sum(t.contains(k) for k in hot)


def test_s3fifo_keeps_reused_blocks_through_a_flood_that_lru_lets_wash_them_out():
    lru, _ = _tier(high_watermark=1.0, low_watermark=1.0, eviction="lru")
    s3, _ = _tier(high_watermark=1.0, low_watermark=1.0, eviction="s3fifo")
    assert _scan_workload(lru) < 4
    assert _scan_workload(s3) == 4
    assert s3.policy_state()["ghost"] <= 16                 # ghosts: as many keys as the tier held


def test_the_duel_follows_the_order_that_would_hit_and_its_state_is_bounded():
    t, _ = _tier(high_watermark=1.0, low_watermark=1.0, eviction="duel")
    lru, _ = _tier(high_watermark=1.0, low_watermark=1.0, eviction="lru")
    # when the leader holds all the tier holds, the duel evicts the oldest: it may lose a hot block
    # that S3-FIFO alone would keep, never all of them as LRU does
    assert _scan_workload(t, rounds=30) >= 3 > _scan_workload(lru, rounds=30)
    state = t.policy_state()
    assert state["policy"] == "duel" and state["leader"] in (1, 2)  # an S3-FIFO shadow led
    for i in range(5000):
        t.put([_w(1000 + i)])
    state = t.policy_state()
    assert state["held"] == 16 and state["doomed"] <= 2 * 16 + 64
    # a shadow holds one key over its size between an insert and its eviction; its ghosts are
    # ghost_factor times that at most (1 and 4 in the duel's S3-FIFOs)
    assert len(state["shadows"]) == 3 and all(sh["held"] <= 16 for sh in state["shadows"])
    assert [sh.get("ghost", 0) <= bound for sh, bound in zip(state["shadows"], (0, 17, 68))] == [True] * 3
    t.close()


def test_begin_costs_nothing_for_orders_that_do_not_learn():
    t, _ = _tier(eviction="lru")
    assert not t._learns
    t.begin([_k(1)])                                      # a no-op, no lock taken
    d, _ = _tier(eviction="duel")
    assert d._learns


@pytest.mark.parametrize("name", NAMES)
def test_touch_is_a_hit_of_a_held_key_and_nothing_else(name):
    """touch(k) == (k in order) then hit(k): two orders fed the same stream, one through each,
    offer the same victims."""
    via_touch, via_hit = make_order(name), make_order(name)
    for k in range(40):
        via_touch.insert(k)
        via_hit.insert(k)
    for k in [3, 7, 3, 50, 11, 3, 60, 20]:
        assert via_touch.touch(k) == (k in via_hit)
        via_hit.hit(k)
        assert 50 not in via_touch and 60 not in via_touch
    assert list(itertools.islice(via_touch.victims(), 10)) == list(itertools.islice(via_hit.victims(), 10))
