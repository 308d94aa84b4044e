"""A cache of so many blocks over an eviction order: the simulator's cache and a duel's shadow.

    access(k) ──> order.insert(k) ──> over capacity? ──> the order's first victim is removed
                                                         (and told to `on_evict`)

Keys only: what a policy would hold at this capacity, without the payloads.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

from kvcache.policy.order import EvictionOrder


class BoundedCache:
    def __init__(self, capacity: int, order: EvictionOrder):
        if capacity < 1:
            raise ValueError(f"a cache holds at least one block, got capacity {capacity}")
        self.capacity = capacity
        self.order = order
        self.on_evict: Callable[["BoundedCache", Hashable], None] | None = None

    @property
    def size(self) -> int:
        return len(self.order)

    def contains(self, key) -> bool:
        return key in self.order

    def begin(self, keys: Sequence, tokens: Sequence[int] | None = None) -> None:
        self.order.begin(keys, tokens)

    def access(self, key, at: int = 0) -> None:
        """A read of `key` (a hit if held, else it is put): the simulator's and a shadow's step."""
        order = self.order
        order.insert(key)
        if len(order) > self.capacity:
            self.shrink()

    def shrink(self) -> None:
        """Evict down to capacity (after a put grew the order, or the capacity was lowered)."""
        order = self.order
        while len(order) > self.capacity:
            victim = next(order.victims())
            order.remove(victim)
            if self.on_evict is not None:
                self.on_evict(self, victim)
