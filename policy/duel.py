"""A duel: follow whichever of several policies would have hit most lately.

    lookup(keys) ──> each shadow scores the prefix it would have hit (decayed: ~1/(1-decay)
                     requests); the highest score leads (ties: the first listed)
    insert / hit ──> every shadow sees it (keys only, each a BoundedCache at the cache's size);
                     the cache holds the block
    victims()    ──> first what the leader has dropped (in the order it dropped them: after a
                     switch of leader, oldest first), then the oldest of all

                   held by the cache      ┌ shadow 0 (LRU)                    ┐ scores
    insert(k) ──>  ─────────────────  ──> ┤ shadow 1 (S3-FIFO, 50 % small)    ├ ──────> leader
                   evict: leader's drops  └ shadow 2 (S3-FIFO, 4x the ghosts) ┘
                                            (the contenders of make_order("duel"))

Where one policy wins at a cache's size and workload the duel behaves as that one; measured on
the Mooncake conversation trace it is never below LRU, at any capacity (benchmarks/README). The
shadows' size is the most blocks the cache has held at once (a tier's capacity is in bytes).
State: the held keys and every shadow's keys (S3-FIFO's ghosts too): with the three
contenders, about nine keys a block (1 + 1 + 2 + 5).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Iterator, Sequence

from kvcache.policy.bounded import BoundedCache
from kvcache.policy.order import EvictionOrder


class Duel(EvictionOrder):
    name = "duel"

    def __init__(self, contenders: Sequence[Callable[[], EvictionOrder]], decay: float = 0.999,
                 capacity: int | None = None):
        if not 0 < decay < 1:
            raise ValueError(f"duel decay must be in (0, 1), got {decay}")
        if len(contenders) < 2:
            raise ValueError("a duel needs at least two policies")
        self.fixed = capacity                        # None: the shadows grow with the cache
        self.shadows = [BoundedCache(capacity or 1, make()) for make in contenders]
        self.scores = [0.0] * len(self.shadows)
        self.decay, self.leader = decay, 0
        self._held: OrderedDict = OrderedDict()      # oldest first
        self._doomed: deque = deque()                # held keys the leader dropped (maybe stale)
        for s in self.shadows:
            s.on_evict = self._shadow_dropped

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key) -> bool:
        return key in self._held

    def _shadow_dropped(self, shadow: BoundedCache, key) -> None:
        if shadow is self.shadows[self.leader] and key in self._held:
            self._doomed.append(key)
            if len(self._doomed) > 2 * len(self._held) + 64:     # stale entries bounded
                lead = self.shadows[self.leader]
                self._doomed = deque(k for k in self._doomed if k in self._held and not lead.contains(k))

    def begin(self, keys: Sequence, tokens: Sequence[int] | None = None) -> None:
        for i, s in enumerate(self.shadows):
            n = 0
            while n < len(keys) and s.contains(keys[n]):
                n += 1
            self.scores[i] = self.scores[i] * self.decay + (sum(tokens[:n]) if tokens is not None else n)
        leader = max(range(len(self.scores)), key=lambda i: (self.scores[i], -i))    # ties: the first
        if leader != self.leader:                    # what the new leader does not hold, oldest first
            self.leader = leader
            lead = self.shadows[leader]
            self._doomed = deque(k for k in self._held if not lead.contains(k))

    def insert(self, key) -> None:
        if key in self._held:
            self.hit(key)
            return
        if key == self._offered:
            self._offered = None
        held, shadows = self._held, self.shadows
        held[key] = None
        if self.fixed is None and len(held) > shadows[0].capacity:
            for s in shadows:
                s.capacity = len(held)
        for s in shadows:                            # BoundedCache.access, inlined (every put)
            s.order.insert(key)
            if len(s.order) > s.capacity:
                s.shrink()

    def hit(self, key) -> None:
        # every read of a cached block comes here: a shadow that holds the key only counts the
        # use (`touch`, no size check: nothing grew); one that dropped it takes it back
        held = self._held
        if key not in held:
            return
        if key == self._offered:
            self._offered = None
        held.move_to_end(key)
        for s in self.shadows:
            if not s.order.touch(key):
                s.access(key)

    def hit_many(self, keys) -> None:
        # `hit` of each key, batched: the held ones refreshed in C, then each shadow touches the
        # run it holds at once and, from the first key it lacks on, takes the rest one by one (a
        # key it lacks is put, which may drop a later key of the batch: the steps stay those of
        # the unbatched hits, and the cost never exceeds theirs)
        held = self._held
        keys = list(filter(held.__contains__, keys))
        if not keys:
            return
        if self._offered is not None and self._offered in keys:
            self._offered = None
        deque(map(held.move_to_end, keys), 0)
        for s in self.shadows:
            order = s.order
            n = order.touch_prefix(keys)
            for key in keys[n:] if n < len(keys) else ():
                if not order.touch(key):
                    s.access(key)

    def remove(self, key) -> None:
        evicted, self._offered = key == self._offered, None
        held = key in self._held
        self._held.pop(key, None)
        if held and not evicted:                     # a delete: no policy could hit it now
            for s in self.shadows:
                s.order.remove(key)

    def victims(self) -> Iterator:
        held = self._held
        while held:
            lead = self.shadows[self.leader]
            key = None
            # every held key the leader lacks is in _doomed: a switch of leader lists them all,
            # and the leader's shadow reports each drop after; so no scan of `held` is needed
            while self._doomed and key is None:
                k = self._doomed.popleft()
                if k in held and not lead.contains(k):
                    key = k
            if key is None:                          # the leader holds them all: the oldest
                key = next(iter(held))
            self._offered = key
            yield key
            if key == self._offered:                 # skipped: counts as used, by the shadows too
                self._offered = None                 # (else the leader's lack of it offers it again)
                if key in held:
                    self.insert(key)

    def state(self) -> dict:
        return {"held": len(self._held), "doomed": len(self._doomed), "leader": self.leader,
                "scores": [round(x, 6) for x in self.scores],
                "shadows": [s.order.state() for s in self.shadows]}
