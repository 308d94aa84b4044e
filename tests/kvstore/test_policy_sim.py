"""The cache-policy simulator: LRU and Belady on hand-made traces with known answers, every
policy within its capacity and below the offline optimum's rule, and the Mooncake trace's
known LRU rate."""

import os
import random

import pytest

from kvcache.kvstore.policy_sim import ARC, LRU, NEVER, POLICIES, S3FIFO, Belady, Stream, simulate

TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "traces",
                     "mooncake_conversation_trace.jsonl")


def stream(*requests, tokens=512):
    return Stream.of((r, [tokens] * len(r)) for r in requests)


def test_next_use_table():
    s = stream([1, 2], [1, 3], [2])
    assert s.keys == [1, 2, 1, 3, 2] and s.starts == [0, 2, 4, 5]
    assert s.next_use == [2, 4, NEVER, NEVER, NEVER]


def test_lru_and_belady_by_hand():
    # single-block requests: the classic a b c a b d a b with 2 slots
    s = stream([1], [2], [3], [1], [2], [4], [1], [2])
    # LRU: every access misses (each key is evicted two accesses before it comes back)
    assert simulate(s, LRU(2))["hit_tokens"] == 0
    # MIN keeps 1 and 2 and bypasses 3 and 4: hits at accesses 4, 5, 7, 8
    assert simulate(s, Belady(2, s.next_use))["hit_tokens"] == 4 * 512
    # prefix hits: a request hits only up to its first missing block
    p = Stream.of([([1, 2, 3], [512, 512, 100]), ([1, 9, 3], [512] * 3), ([1, 2, 3], [512, 512, 100])])
    r = simulate(p, LRU(10))
    assert r["hit_tokens"] == 512 + 1124 and r["tokens"] == 1124 * 2 + 1536


def test_hindsight_keeps_the_most_used_blocks_from_their_first_use():
    from kvcache.kvstore.policy_sim import Hindsight
    s = stream([1], [2], [1], [3], [1], [2], [4])
    assert simulate(s, Hindsight(1, s.keys))["hit_tokens"] == 2 * 512      # block 1 only
    assert simulate(s, Hindsight(2, s.keys))["hit_tokens"] == 3 * 512      # 1 and 2
    assert simulate(s, Hindsight(9, s.keys))["hit_tokens"] == 3 * 512      # all: what reuse there is


def test_s3fifo_keeps_a_reused_block_through_a_scan():
    # block 1 comes back after every three one-off blocks: an LRU of 3 always evicts it first
    reqs = []
    for i in range(40):
        reqs += [[1], [1000 + 3 * i], [1001 + 3 * i], [1002 + 3 * i]]
    s = stream(*reqs)
    lru = simulate(s, LRU(3))["hit_tokens"]
    s3 = simulate(s, S3FIFO(3))["hit_tokens"]
    assert lru == 0 and s3 >= 37 * 512          # from its second use on, it stays in the main queue


def test_a_longer_ghost_list_catches_a_reuse_that_comes_after_many_others():
    from kvcache.policy import S3FIFO as Order
    from kvcache.policy.bounded import BoundedCache
    # block 1 comes back after 30 one-off blocks, three times: the ghosts of a 10-block cache
    # forget it after 10, four times as many remember it, and its second use earns main
    reqs, n = [], 1000
    for _ in range(4):
        reqs += [[1]] + [[k] for k in range(n, n + 30)]
        n += 30
    s = stream(*reqs)
    short, long = (simulate(s, BoundedCache(10, Order(0.1, g)))["hit_tokens"] for g in (1, 4))
    assert short == 0 and long == 2 * 512
    with pytest.raises(ValueError, match="ghost_factor"):
        Order(0.1, 0)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_stays_within_capacity_and_below_min(name):
    rng = random.Random(3)
    reqs = []
    for _ in range(400):                    # Zipf-ish prefixes: a few hot roots, long tails
        root = int(rng.paretovariate(1.2)) % 50
        reqs.append([root * 1000 + j for j in range(rng.randint(1, 6))] + [rng.randrange(10 ** 6)])
    s = stream(*reqs)
    for cap in (1, 4, 32, 256):
        r = simulate(s, POLICIES[name](cap, s))           # raises if it ever holds more than cap
        opt = simulate(s, Belady(cap, s.next_use))
        assert r["token_hit_rate"] <= opt["token_hit_rate"] + 0.02, (name, cap)
    big = simulate(s, POLICIES[name](10 ** 6, s))["token_hit_rate"]
    assert big == pytest.approx(simulate(s, LRU(10 ** 6))["token_hit_rate"])   # all fits: every policy alike


def test_arc_adapts_between_recency_and_frequency():
    s = stream(*[[k] for k in ([1, 2, 3] * 30 + list(range(100, 160))) * 3])
    assert simulate(s, ARC(4))["hit_tokens"] > simulate(s, LRU(4))["hit_tokens"]


@pytest.mark.skipif(not os.path.exists(TRACE), reason="the Mooncake trace is not in ../shared/traces")
def test_mooncake_trace_lru_matches_a_reference_lru():
    """The simulator's LRU against a plain one written here (insert the request, then trim)."""
    from collections import OrderedDict
    from kvcache.kvstore.trace_replay import bounds, load_trace
    trace = load_trace(TRACE, limit=3000)
    cache, hit, total = OrderedDict(), 0, 0
    for r in trace:
        toks, n = r.block_tokens(), 0
        while n < len(r.hash_ids) and r.hash_ids[n] in cache:
            n += 1
        hit, total = hit + sum(toks[:n]), total + sum(toks)
        for h in r.hash_ids:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > 2000:
            cache.popitem(last=False)
    row = bounds(trace, [2000 * 512], ["lru"])["capacities"][0]
    assert row["rates"]["lru"] == pytest.approx(hit / total)
    assert row["rates"]["belady"] > row["rates"]["lru"] and 0 < row["lru_vs_belady"] < 1


def test_duel_follows_whichever_policy_wins():
    from kvcache.kvstore.policy_sim import Duel
    scan = []                                   # a reused block between one-off scans: S3-FIFO's case
    for i in range(200):
        scan += [[1], [10 ** 6 + 3 * i], [10 ** 6 + 3 * i + 1], [10 ** 6 + 3 * i + 2]]
    loop = [[k % 5] for k in range(400)] + [[100 + k % 4] for k in range(400)]   # recency: LRU's case
    for reqs in (scan, loop):
        s = stream(*reqs)
        lru, s3 = (simulate(s, p)["hit_tokens"] for p in (LRU(4), S3FIFO(4, 0.5)))
        duel = Duel(4)
        got = simulate(s, duel)["hit_tokens"]
        assert got >= 0.95 * max(lru, s3) and got >= lru, (got, lru, s3)


def _sizes(state) -> list[int]:
    """Every size in an order's state() (nested for the duel's shadows)."""
    if isinstance(state, dict):
        return [n for v in state.values() for n in _sizes(v)]
    if isinstance(state, list):
        return [n for v in state for n in _sizes(v)]
    return [state]


def test_policy_state_is_bounded_by_its_capacity():
    from kvcache.kvstore.policy_sim import Duel
    s = stream(*[[i, i + 10 ** 6] for i in range(5000)])     # nothing reused: ghosts and heaps fill up
    for p in (S3FIFO(64), ARC(64), Belady(64, s.next_use), Duel(64)):
        simulate(s, p)
        parts = [len(getattr(p, a)) for a in ("b1", "b2", "_heap", "_next") if hasattr(p, a)]
        parts += _sizes(p.order.state()) if hasattr(p, "order") else []
        assert parts and max(parts) <= 4 * 64 + 64, (type(p).__name__, parts)


@pytest.mark.skipif(not os.path.exists(TRACE), reason="the Mooncake trace is not in ../shared/traces")
def test_duel_is_never_below_lru_on_the_mooncake_trace():
    from kvcache.kvstore.trace_replay import bounds, load_trace
    b = bounds(load_trace(TRACE), [300_000, 1_000_000, 3_000_000, 10_000_000, 30_000_000], ["duel"])
    assert b["worst_vs_lru"]["duel"] >= 1.0, b["worst_vs_lru"]
    best = max(r["duel_vs_lru"] for r in b["capacities"])
    assert best > 1.8                          # where capacity is scarce it keeps what LRU flushes
