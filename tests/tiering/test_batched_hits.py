"""Batched reads: `hit_many` and `touch_prefix` leave every eviction order where one `hit` per
read would, and the DRAM tier's recorded reads reach its order before any eviction."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcache.kvstore.errors import BufferTooSmallError
from kvcache.policy import NAMES, make_order
from kvcache.policy.s3fifo import MAX_FREQ
from kvcache.tiering import dram as dram_module
from kvcache.tiering.dram import DramTier
from tests.tiering.test_dram import KB, _k, _tier, _w

_op = st.one_of(st.tuples(st.just("insert"), st.integers(0, 7)),
                st.tuples(st.just("insert"), st.integers(0, 7)),
                st.tuples(st.just("hits"), st.lists(st.integers(0, 9), max_size=12)),
                st.tuples(st.just("remove"), st.integers(0, 7)),
                st.tuples(st.just("evict"), st.integers(0, 2)),          # victims skipped before one goes
                st.tuples(st.just("begin"), st.lists(st.integers(0, 7), max_size=6)))


def _snapshot(order):
    """Everything an order keeps that decides what it evicts (S3-FIFO's batched reads folded in)."""
    if hasattr(order, "shadows"):                                       # a duel
        return (list(order._held), list(order._doomed), order.scores, order.leader,
                [_snapshot(s.order) for s in order.shadows])
    if hasattr(order, "ghost"):                                         # S3-FIFO
        def fold(q):
            return [(k, min(MAX_FREQ, f + order._reads.get(k, 0))) for k, f in q.items()]
        return fold(order.small), fold(order.main), list(order.ghost), order._peak
    return list(order._d)


def _run(order, ops, batched: bool) -> list:
    """Apply `ops`; the reads of a "hits" op one `hit` each, or one `hit_many`. What evictions
    chose, and the order's state after each op."""
    chosen = []
    for op, arg in ops:
        chosen.append(_snapshot(order))
        if op == "insert":
            order.insert(arg)
        elif op == "hits":
            _hits(order, arg, batched)
        elif op == "remove":
            order.remove(arg)
        elif op == "begin":
            order.begin(arg)
        elif len(order):
            victims = order.victims()
            skipped = [next(victims) for _ in range(arg)]    # not removed: counted as used
            if skipped:                                      # read while offered
                _hits(order, skipped[:1], batched)
            k = next(victims)
            order.remove(k)
            chosen.append((skipped, k))
    chosen.append(_snapshot(order))
    chosen.append(("left", list(_drain(order))))
    return chosen


def _hits(order, keys, batched: bool) -> None:
    if batched:
        order.hit_many(keys)
    else:
        for k in keys:
            order.hit(k)


def _drain(order):
    while len(order):
        k = next(order.victims())
        order.remove(k)
        yield k


# a duel's shadows smaller than the cache (some reads miss them); S3-FIFO's main queue at the head often
@pytest.mark.parametrize("capacity, small", [(None, None), (3, 0.5)])
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_op, max_size=80))
@example(ops=[("insert", 0), ("hits", [0]), ("remove", 0), ("insert", 0)])     # reads of a block gone
def test_hit_many_leaves_each_order_as_single_hits_do(name, capacity, small, ops):
    one, many = (make_order(name, small, capacity=capacity) for _ in range(2))
    assert _run(one, ops, batched=False) == _run(many, ops, batched=True)
    assert one.state() == many.state()


@pytest.mark.parametrize("name", NAMES)
def test_touch_prefix_stops_at_the_first_key_not_held(name):
    order = make_order(name)
    for k in range(4):
        order.insert(k)
    assert order.touch_prefix([0, 1, 9, 2]) == 2
    assert order.touch_prefix([2, 3]) == 2 and order.touch_prefix([]) == 0 and order.touch_prefix([9]) == 0


@pytest.mark.parametrize("read", ["get_into", "get_many_into", "view", "touch"])
def test_reads_still_recorded_steer_the_next_eviction(read):
    """Fewer reads than a batch are held back from the order; an eviction still sees them."""
    t, evicted = _tier(high_watermark=1.0, low_watermark=1.0, eviction="lru")
    t.put([_w(i) for i in range(16)])                 # exactly full, 0 the oldest
    out = memoryview(bytearray(64 * KB))
    if read == "get_into":
        assert t.get_into(_k(0), None, out) == 64 * KB
    elif read == "get_many_into":
        assert t.get_many_into([_k(0), _k(99)], [out, out]) == [64 * KB, None]
    elif read == "view":
        with t.view(_k(0)) as mv:
            assert mv is not None
    else:
        assert t.touch([_k(0)]) == [64 * KB]
    assert 0 < len(t._hits) < DramTier.HIT_BATCH                # held back: the order has not heard yet
    t.put([_w(16)])
    assert [e[0] for e in evicted] == [_k(1)]         # 0 was read: 1 goes first
    t.close()


def test_a_full_batch_of_reads_reaches_the_order_at_once():
    t, _ = _tier(eviction="lru")
    t.put([_w(i) for i in range(4)])
    out = memoryview(bytearray(64 * KB))
    for _ in range(DramTier.HIT_BATCH // 2):
        t.get_many_into([_k(2), _k(0)], [out, out])
    assert t._hits == [] and list(t._order._d)[-2:] == [_k(2), _k(0)]
    t.close()


@pytest.mark.parametrize("under_lock", [True, False])     # small blocks copied under the lock; others leased
def test_any_writable_buffer_takes_a_block_and_a_short_one_is_refused(monkeypatch, under_lock):
    monkeypatch.setattr(dram_module, "COPY_UNDER_LOCK", 1 << 30 if under_lock else 0)
    t, _ = _tier()
    t.put([_w(7, n=4 * KB)])
    floats = np.zeros((4, 512), dtype=np.float32)          # 8 KiB, two dimensions, not bytes
    assert t.get_into(_k(7), None, floats) == 4 * KB
    assert t.get_many_into([_k(7)], [floats.reshape(-1)]) == [4 * KB]
    assert floats.view(np.uint8).reshape(-1)[: 4 * KB].tobytes() == bytes([7]) * 4 * KB
    short = bytearray(100)
    for read in (lambda: t.get_into(_k(7), None, short), lambda: t.get_many_into([_k(7)], [short])):
        with pytest.raises(BufferTooSmallError, match="holds 100 bytes"):
            read()
        assert len(short) == 100 and short == bytes(100)   # neither grown nor written
    with pytest.raises(TypeError):
        t.get_into(_k(7), None, bytes(8 * KB))              # read-only
    assert all(e.leases == 0 for e in t._entries.values())
    t.close()
