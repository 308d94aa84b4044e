"""Cache policies over a trace's block accesses, simulated: what a capacity of N blocks can hit.

    per request, in arrival order:
        hit   = its longest prefix of blocks that are all cached (token-weighted, as store lookups)
        then  every block of the prompt is accessed (a hit refreshes it, a miss is offered to
              the cache: the engine saves the blocks it computed), in prompt order

A policy is one narrow interface: `contains(key)`, `access(key, at)` (at: the index of this
access in the stream, for the offline optimum's next-use table), `size`, and `begin(keys,
tokens)` before each request's lookup (a policy that learns from requests). Capacities are in
blocks; the simulator never lets a policy hold more. Every policy here is O(1) or O(log n) an
access, so a capacity of the Mooncake conversation trace (288,500 accesses) takes about a second.

LRU, S3-FIFO and the duel are the eviction orders the caches run (kvcache/policy), each in a
BoundedCache of the capacity; Belady and ARC are the simulator's own (the one is offline, the
other was tried and lost: benchmarks/README).

    lru         least recently used
    belady      the offline optimum's rule (MIN): evict the block whose next use is farthest in
                the future, and do not admit a block used later than everything held (bypass).
                An upper bound for any online policy that evicts blocks one by one (prefix hits
                make it a bound in practice, not a theorem: a block's value depends on its prefix)
    hindsight   the best fixed set, offline: the blocks used most over the whole stream, kept
                from their first use (frequency with perfect counts, no timing)
    s3fifo      S3-FIFO (Yang et al., SOSP'23): a small FIFO (10 %) that new blocks pass
                through, a main FIFO that blocks seen twice enter (reinserted while their
                2-bit frequency lasts), and a ghost list of keys evicted from the small one
    arc         ARC (Megiddo & Modha, FAST'03): recency and frequency lists whose split adapts
                to hits in either list's ghost
    duel        follow the leader among LRU, S3-FIFO with a 50 % small queue and S3-FIFO with
                a 10 % one and four times the ghosts: all run as shadows (keys only) at the
                full capacity, each scored on every request's prefix hit (decayed: the last
                ~1,000 requests); the cache admits what the leader admits and evicts what the
                leader no longer holds, oldest first. Where one policy wins at a capacity it
                follows that one; the shadows cost about 8 keys a block of capacity
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from kvcache import policy as order
from kvcache.policy.bounded import BoundedCache

NEVER = 1 << 62        # the next use of a block that is not used again


class Policy:
    """The interface (and LRU)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"a cache holds at least one block, got capacity {capacity}")
        self.capacity = capacity
        self._d: OrderedDict = OrderedDict()
        self.on_evict: Callable | None = None            # told each key the policy drops

    def _dropped(self, key) -> None:
        if self.on_evict is not None:
            self.on_evict(self, key)

    @property
    def size(self) -> int:
        return len(self._d)

    def contains(self, key) -> bool:
        return key in self._d

    def begin(self, keys: Sequence, tokens: Sequence[int]) -> None:
        """A request's blocks, before its lookup (most policies need nothing)."""

    def access(self, key, at: int) -> None:
        if key in self._d:
            self._d.move_to_end(key)
            return
        self._d[key] = None
        if len(self._d) > self.capacity:
            self._dropped(self._d.popitem(last=False)[0])


def LRU(capacity: int) -> BoundedCache:
    return BoundedCache(capacity, order.LRU())


def S3FIFO(capacity: int, small_fraction: float = 0.1) -> BoundedCache:
    return BoundedCache(capacity, order.S3FIFO(small_fraction))


def Duel(capacity: int, small_fraction: float = 0.5, decay: float = 0.999) -> BoundedCache:
    return BoundedCache(capacity, order.make_order("duel", small_fraction, decay, capacity))


class Belady(Policy):
    """MIN with bypass; needs `next_use[at]`: the stream index of the key's next access (NEVER)."""

    def __init__(self, capacity: int, next_use: Sequence[int]):
        super().__init__(capacity)
        self.next_use = next_use
        self._next: dict = {}
        self._heap: list[tuple[int, int, object]] = []     # (-next use, tiebreak, key), stale entries skipped
        self._tie = 0

    @property
    def size(self) -> int:
        return len(self._next)

    def contains(self, key) -> bool:
        return key in self._next

    def access(self, key, at: int) -> None:
        nxt = self.next_use[at]
        self._next[key] = nxt
        self._tie += 1
        heapq.heappush(self._heap, (-nxt, self._tie, key))
        while len(self._next) > self.capacity:
            neg, _, victim = heapq.heappop(self._heap)
            if self._next.get(victim) == -neg:          # not a stale entry
                del self._next[victim]
                self._dropped(victim)
        if len(self._heap) > 4 * self.capacity + 64:    # bound the lazy heap
            self._heap = [(-n, i, k) for i, (k, n) in enumerate(self._next.items())]
            heapq.heapify(self._heap)


class Hindsight(Policy):
    """The best fixed set, chosen offline: the `capacity` blocks the whole stream uses most, each
    kept from its first use on, nothing else ever admitted. What frequency alone can earn with
    perfect knowledge of each block's count (and none of when its uses come); `keys`: the stream's."""

    def __init__(self, capacity: int, keys: Sequence):
        super().__init__(capacity)
        self._top = {k for k, _ in Counter(keys).most_common(capacity)}

    def access(self, key, at: int) -> None:
        if key in self._top:
            self._d[key] = None                         # Policy's size and contains read _d


class ARC(Policy):
    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.p = 0.0
        self.t1: OrderedDict = OrderedDict()
        self.t2: OrderedDict = OrderedDict()
        self.b1: OrderedDict = OrderedDict()
        self.b2: OrderedDict = OrderedDict()

    @property
    def size(self) -> int:
        return len(self.t1) + len(self.t2)

    def contains(self, key) -> bool:
        return key in self.t1 or key in self.t2

    def access(self, key, at: int) -> None:
        c = self.capacity
        if key in self.t1 or key in self.t2:
            (self.t1 if key in self.t1 else self.t2).pop(key)
            self.t2[key] = None
            return
        if key in self.b1:
            self.p = min(c, self.p + max(1.0, len(self.b2) / len(self.b1)))
            self._replace(False)
            del self.b1[key]
            self.t2[key] = None
            return
        if key in self.b2:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
            self._replace(True)
            del self.b2[key]
            self.t2[key] = None
            return
        if len(self.t1) + len(self.b1) >= c:
            if len(self.t1) < c:
                self.b1.popitem(last=False)
                self._replace(False)
            else:
                self._dropped(self.t1.popitem(last=False)[0])
        elif self.size + len(self.b1) + len(self.b2) >= c:
            if self.size + len(self.b1) + len(self.b2) >= 2 * c:
                self.b2.popitem(last=False)
            self._replace(False)
        self.t1[key] = None

    def _replace(self, in_b2: bool) -> None:
        if self.size < self.capacity:
            return
        if self.t1 and (len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p)):
            key, _ = self.t1.popitem(last=False)
            self.b1[key] = None
        elif self.t2:
            key, _ = self.t2.popitem(last=False)
            self.b2[key] = None
        else:
            key, _ = self.t1.popitem(last=False)
            self.b1[key] = None
        self._dropped(key)


@dataclass(frozen=True)
class Stream:
    """A trace as one access stream: keys in order, tokens per access, request boundaries."""
    keys: list
    tokens: list[int]
    starts: list[int]                   # stream index of each request's first block (and the end)
    next_use: list[int] = field(default_factory=list)

    @staticmethod
    def of(requests: Iterable[tuple[Sequence, Sequence[int]]]) -> "Stream":
        """From (block keys, tokens per block) per request, in arrival order."""
        keys, tokens, starts = [], [], []
        for ks, ts in requests:
            starts.append(len(keys))
            keys += list(ks)
            tokens += list(ts)
        starts.append(len(keys))
        nxt, last = [NEVER] * len(keys), {}
        for i in range(len(keys) - 1, -1, -1):
            nxt[i] = last.get(keys[i], NEVER)
            last[keys[i]] = i
        return Stream(keys, tokens, starts, nxt)


def simulate(stream: Stream, policy: Policy) -> dict:
    """Token-weighted prefix hit rate of `policy` over the stream."""
    keys, tokens, hit, total = stream.keys, stream.tokens, 0, 0
    for r in range(len(stream.starts) - 1):
        a, b = stream.starts[r], stream.starts[r + 1]
        policy.begin(keys[a:b], tokens[a:b])
        i = a
        while i < b and policy.contains(keys[i]):
            i += 1
        hit += sum(tokens[a:i])
        total += sum(tokens[a:b])
        for j in range(a, b):
            policy.access(keys[j], j)
        if policy.size > policy.capacity:
            raise AssertionError(f"{type(policy).__name__} holds {policy.size} blocks over its {policy.capacity}")
    return {"token_hit_rate": hit / total if total else 0.0, "hit_tokens": hit, "tokens": total}


POLICIES: dict[str, Callable[[int, Stream], Policy]] = {
    "lru": lambda c, s: LRU(c),
    "belady": lambda c, s: Belady(c, s.next_use),
    "hindsight": lambda c, s: Hindsight(c, s.keys),
    "s3fifo": lambda c, s: S3FIFO(c),
    "arc": lambda c, s: ARC(c),
    "duel": lambda c, s: Duel(c),
}
