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

    lru         least recently used
    belady      the offline optimum's rule (MIN): evict the block whose next use is farthest in
                the future, and do not admit a block used later than everything held (bypass).
                An upper bound for any online policy that evicts blocks one by one (prefix hits
                make it a bound in practice, not a theorem: a block's value depends on its prefix)
    s3fifo      S3-FIFO (Yang et al., SOSP'23): a small FIFO (10 %) that new blocks pass
                through, a main FIFO that blocks seen twice enter (reinserted while their
                2-bit frequency lasts), and a ghost list of keys evicted from the small one
    arc         ARC (Megiddo & Modha, FAST'03): recency and frequency lists whose split adapts
                to hits in either list's ghost
    duel        follow the leader between LRU and S3-FIFO with a 50 % small queue: both run as
                shadows (keys only) at the full capacity, each scored on every request's prefix
                hit (decayed: the last ~1,000 requests); the cache admits what the leader admits
                and evicts what the leader no longer holds, oldest first. Where one policy wins
                at a capacity it follows that one; the shadows cost 2 keys a block of capacity
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

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


class LRU(Policy):
    pass


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


class S3FIFO(Policy):
    def __init__(self, capacity: int, small_fraction: float = 0.1):
        super().__init__(capacity)
        self.small_cap = max(1, int(capacity * small_fraction))
        self.small: OrderedDict = OrderedDict()          # key -> frequency
        self.main: OrderedDict = OrderedDict()
        self.ghost: OrderedDict = OrderedDict()

    @property
    def size(self) -> int:
        return len(self.small) + len(self.main)

    def contains(self, key) -> bool:
        return key in self.small or key in self.main

    def access(self, key, at: int) -> None:
        for q in (self.small, self.main):
            if key in q:
                q[key] = min(q[key] + 1, 3)
                return
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = 0
        else:
            self.small[key] = 0
        while self.size > self.capacity:
            if len(self.small) > self.small_cap or not self.main:
                self._evict_small()
            else:
                self._evict_main()

    def _evict_small(self) -> None:
        key, freq = self.small.popitem(last=False)
        if freq > 0:                                     # seen again while young: it earned main
            self.main[key] = 0
        else:
            self.ghost[key] = None
            self._dropped(key)
            if len(self.ghost) > self.capacity:
                self.ghost.popitem(last=False)

    def _evict_main(self) -> None:
        while True:
            key, freq = self.main.popitem(last=False)
            if freq == 0:
                self._dropped(key)
                return
            self.main[key] = freq - 1                    # reinserted at the tail, one use spent


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


class Duel(Policy):
    def __init__(self, capacity: int, a: Callable[[int], Policy], b: Callable[[int], Policy], decay: float = 0.999):
        super().__init__(capacity)
        self.shadows = [a(capacity), b(capacity)]
        self.scores = [0.0, 0.0]
        self.decay, self.leader = decay, 0
        self._held: OrderedDict = OrderedDict()          # oldest first
        self._doomed: deque = deque()                    # held keys the leader dropped (maybe stale)
        for s in self.shadows:
            s.on_evict = self._shadow_dropped

    def _shadow_dropped(self, shadow: Policy, key) -> None:
        if shadow is self.shadows[self.leader] and key in self._held:
            self._doomed.append(key)

    @property
    def size(self) -> int:
        return len(self._held)

    def contains(self, key) -> bool:
        return key in self._held

    def begin(self, keys: Sequence, tokens: Sequence[int]) -> None:
        for i, s in enumerate(self.shadows):
            n = 0
            while n < len(keys) and s.contains(keys[n]):
                n += 1
            self.scores[i] = self.scores[i] * self.decay + sum(tokens[:n])
        leader = 0 if self.scores[0] >= self.scores[1] else 1
        if leader != self.leader:                        # what the new leader does not hold, oldest first
            self.leader = leader
            lead = self.shadows[leader]
            self._doomed = deque(k for k in self._held if not lead.contains(k))

    def access(self, key, at: int) -> None:
        for s in self.shadows:
            s.access(key, at)
        lead = self.shadows[self.leader]
        if key in self._held:
            self._held.move_to_end(key)
        elif lead.contains(key):
            self._held[key] = None
        while len(self._held) > self.capacity:           # what the leader dropped goes first
            while self._doomed:
                k = self._doomed.popleft()
                if k in self._held and not lead.contains(k):
                    del self._held[k]
                    break
            else:                                        # none known (the leader changed): the oldest
                old = next(iter(self._held))             # it does not hold (it holds <= capacity)
                if lead.contains(old):
                    self._held.move_to_end(old)
                else:
                    del self._held[old]


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
    "s3fifo": lambda c, s: S3FIFO(c),
    "arc": lambda c, s: ARC(c),
    "duel": lambda c, s: Duel(c, LRU, lambda n: S3FIFO(n, 0.5)),
}
