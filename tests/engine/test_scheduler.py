"""Scheduler and block pool on tiny pools: exact admission, chunking, preemption and eviction order."""

import pytest

from kvcache.engine.block_pool import BlockPool, PoolExhausted
from kvcache.engine.request import FinishReason, Request, Status
from kvcache.engine.sampling import SamplingParams
from kvcache.engine.scheduler import Scheduler


def req(n_prompt, max_tokens=4, priority=0, rid=""):
    return Request(list(range(3, 3 + n_prompt)), SamplingParams(max_tokens=max_tokens, temperature=0), priority, rid)


def run_step(s: Scheduler, token=7):
    out = s.schedule()
    sampled = {c.request.request_id: token for c in out.chunks if c.samples}
    s.update(out, sampled)
    return out


def test_pool_eviction_order_keys_and_invariant():
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free() == 1
    pool.set_key(0, b"k0")
    pool.set_key(1, b"k1")
    pool.release(a)                       # last block first: 2 (no content) is free, 1 then 0 cached
    assert list(pool._free) == [3, 2]
    assert pool.counts() == {"used": 0, "cached": 2, "free": 2, "total": 4}
    assert pool.lookup(b"k1") == 1
    pool.share([1])                       # a prefix hit takes a cached block back
    assert pool.blocks[1].ref_count == 1 and pool.num_free() == 3
    pool.check()
    b = pool.allocate(3)                  # empty blocks first, then a cached one: its key dropped
    assert b == [3, 2, 0] and pool.lookup(b"k0") is None
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    pool.release(b + [1])
    pool.check()
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([1])


def test_pool_lru_evicts_a_prefix_tail_first_and_skips_held_blocks():
    pool = BlockPool(6, 16)
    a = pool.allocate(3)
    for i, bid in enumerate(a):
        pool.set_key(bid, b"a%d" % i)
    b = pool.allocate(3)
    for i, bid in enumerate(b):
        pool.set_key(bid, b"b%d" % i)
    pool.release(a)
    pool.share([a[0]])                    # a's head is hit again, and held
    pool.release(b)
    got = pool.allocate(3)
    assert got == [a[2], a[1], b[2]]      # a's tail, then b's tail; the held head is skipped
    assert pool.lookup(b"a0") == a[0] and pool.lookup(b"b0") == b[0]
    pool.check()


@pytest.mark.parametrize("eviction", ["lru", "fifo", "s3fifo", "duel"])
def test_pool_bookkeeping_holds_under_every_order(eviction):
    import random
    rng, pool, held = random.Random(0), BlockPool(32, 16, eviction), []
    for step in range(2000):
        if held and (rng.random() < 0.45 or pool.num_free() < 4):
            pool.release(held.pop(rng.randrange(len(held))))
            continue
        keys = [b"p%d-%d" % (rng.randrange(6), j) for j in range(rng.randrange(1, 4))]
        pool.begin(keys)
        hit = []
        for k in keys:
            bid = pool.lookup(k)
            if bid is None:
                break
            hit.append(bid)
        pool.share(hit)
        new = pool.allocate(len(keys) - len(hit))
        for k, bid in zip(keys[len(hit):], new):
            pool.set_key(bid, k)
        held.append(hit + new)
    pool.check()
    assert pool.counts()["used"] + pool.num_free() == 32


def test_an_unknown_pool_eviction_is_a_clear_error():
    from kvcache.engine.config import EngineConfig
    with pytest.raises(ValueError, match="pool_eviction must be one of lru"):
        EngineConfig(pool_eviction="mru")


def test_admission_fcfs_chunked_prefill_and_mixed_steps():
    s = Scheduler(BlockPool(16, 4), max_tokens_per_step=8, max_running=2)
    r1, r2, r3 = req(10, rid="a"), req(3, rid="b"), req(2, rid="c")
    for r in (r1, r2, r3):
        s.add(r)
    out = run_step(s)
    assert [(c.request.request_id, c.start, len(c.tokens), c.samples) for c in out.chunks] == [("a", 0, 8, False)]
    out = run_step(s)                     # a: 2 prompt tokens (and samples) + b's whole prompt
    assert [(c.request.request_id, c.start, len(c.tokens)) for c in out.chunks] == [("a", 8, 2), ("b", 0, 3)]
    out = run_step(s)                     # max_running = 2: c waits; a and b decode
    assert [(c.request.request_id, len(c.tokens)) for c in out.chunks] == [("a", 1), ("b", 1)]
    assert r3.status is Status.WAITING
    for _ in range(3):
        run_step(s)
    assert r1.finished and r1.finish_reason is FinishReason.LENGTH and r1.output == [7] * 4
    out = run_step(s)
    assert [c.request.request_id for c in out.chunks] == ["c"]


def test_preemption_takes_the_newest_lowest_priority_and_nothing_starves():
    s = Scheduler(BlockPool(4, 4), max_tokens_per_step=16, max_running=4)
    old, new = req(6, max_tokens=6, rid="old"), req(6, max_tokens=6, rid="new")
    s.add(old)
    s.add(new)
    run_step(s)                           # both prefilled: 2 blocks each, the pool is full
    assert old.num_computed == 6 and new.num_computed == 6 and s.pool.num_free() == 0
    run_step(s)
    run_step(s)                           # tokens 7 and 8 fit the 2 blocks each holds
    assert new.status is Status.RUNNING and old.num_computed == 8
    out = run_step(s)                     # old needs a third block for token 9: new (newer) is preempted
    assert out.preempted == [new] and [c.request for c in out.chunks] == [old]
    assert new.status is Status.WAITING and new.block_ids == [] and new.metrics.preemptions == 1
    assert new.state is None and new.num_computed == 0 and len(new.output) == 3
    while not old.finished:
        run_step(s)
    while not new.finished:               # it recomputes prompt + its 2 tokens, then continues
        run_step(s)
    assert new.output == [7] * 6 and new.metrics.tokens_computed > 6 + 6
    s.pool.check()
    assert s.pool.counts()["used"] == 0


def test_priority_orders_admission():
    s = Scheduler(BlockPool(16, 4), max_tokens_per_step=4, max_running=1)
    low, high = req(2, priority=5, rid="low"), req(2, priority=0, rid="high")
    s.add(low)
    s.add(high)
    out = run_step(s)
    assert [c.request.request_id for c in out.chunks] == ["high"]


def test_requests_larger_than_the_pool_are_refused_and_abort_frees():
    s = Scheduler(BlockPool(2, 4), max_tokens_per_step=8)
    with pytest.raises(ValueError, match="more KV blocks than the whole pool"):
        s.add(req(8, max_tokens=4))
    r = req(3)
    s.add(r)
    run_step(s)
    assert r.block_ids
    s.abort(r)
    assert r.finished and r.finish_reason is FinishReason.ABORT and s.pool.counts()["used"] == 0


def test_forget_cached_drops_only_unheld_keys():
    pool = BlockPool(4, 16)
    a = pool.allocate(2)
    pool.set_key(a[0], b"held")
    pool.set_key(a[1], b"cached")
    pool.release([a[1]])
    assert pool.forget_cached() == 1
    assert pool.lookup(b"cached") is None and pool.lookup(b"held") == a[0]
    pool.check()


def test_fork_shares_prompt_blocks_or_queues_the_sample():
    pool = BlockPool(8, 16)
    s = Scheduler(pool, max_tokens_per_step=64, max_running=2)
    parent = req(20)                       # one full prompt block and a partial one
    s.add(parent)
    run_step(s)
    kid = Request(parent.prompt, parent.params, stream=1, parent=parent, arrival_seq=parent.arrival_seq)
    own = s.fork(kid, parent, slot_free=True)
    assert own is not None and len(own) == len(parent.block_ids) - 1
    assert kid.block_ids == parent.block_ids[:1] + own and pool.blocks[parent.block_ids[0]].ref_count == 2
    assert kid.status is Status.RUNNING and kid in s.running and kid.num_computed == 20
    late = Request(parent.prompt, parent.params, stream=2, parent=parent, arrival_seq=parent.arrival_seq)
    assert s.fork(late, parent, slot_free=True) is None          # max_running: it waits and recomputes
    assert late in s.waiting and not late.block_ids
    assert s.has_runnable()


def test_has_runnable_ignores_requests_still_loading():
    s = Scheduler(BlockPool(4, 16))
    r = req(4)
    s.add(r)
    r.status = Status.WAITING_FOR_KV
    assert s.has_work() and not s.has_runnable()
