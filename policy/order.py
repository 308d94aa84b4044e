"""The eviction-order contract, and the two plain orders (LRU, FIFO).

An `EvictionOrder` knows which of the blocks a cache holds should leave first. The cache (a
tier, the engine's block pool, the simulator) owns the blocks and tells the order each change;
the order holds keys only, never payloads, and decides nothing about *when* to evict:

    cache                              order
    ─────                              ─────
    block enters        ──insert(k)──> k joins (a key it held before: a hit)
    block read          ──hit(k)────>  k counts as used
    blocks read         ──hit_many(ks)>  each k counts as used, in order (a batched read)
    block leaves        ──remove(k)──> k forgotten (evicted, deleted, expired; unknown: ignored)
    a request's lookup  ──begin(ks)──> a policy that learns from requests sees its blocks
    room needed         <─victims()──  held keys, the next to go first

`victims()` is a lazy pass. The cache evicts a yielded key by calling `remove(k)` before it
asks for the next one; a key it does not remove (pinned, being read, of the wrong size) is
*skipped*: the order treats it as just used, so one pass does not offer it again. A pass over
blocks that can all be skipped never ends by itself, so callers bound how many they take.

The orders are single-threaded: the cache calls them under its own lock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Hashable, Iterator, Sequence


class EvictionOrder:
    """The contract; subclasses keep `len()` and `in` true to what the cache holds.

    `remove(k)` of the key a pass has just offered is an eviction (a policy may remember it:
    S3-FIFO's ghosts, a duel's shadows); any other `remove` is a delete, forgotten entirely."""

    name = "?"
    _offered: Hashable = None                    # the key the running pass yielded last

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, key: Hashable) -> bool:
        raise NotImplementedError

    def insert(self, key: Hashable) -> None:
        """A block entered the cache (one already held counts as a hit)."""
        raise NotImplementedError

    def hit(self, key: Hashable) -> None:
        """A held block was read (a key not held is ignored)."""
        raise NotImplementedError

    def remove(self, key: Hashable) -> None:
        """A block left the cache; a key not held is ignored."""
        raise NotImplementedError

    def hit_many(self, keys: Sequence[Hashable]) -> None:
        """`hit` of each key in turn (keys not held ignored): the same outcome, for orders that can
        do a batch with less Python per key (a 64 KiB copy is a few microseconds; so is a hit)."""
        for key in keys:
            self.hit(key)

    def touch(self, key: Hashable) -> bool:
        """`hit(key)` if the key is held; whether it was. One call where a caller would ask `in`
        and then `hit` (a duel does it for every shadow on every read)."""
        if key in self:
            self.hit(key)
            return True
        return False

    def touch_prefix(self, keys: Sequence[Hashable]) -> int:
        """`touch` the keys in turn up to the first one not held: how many were (that one is not
        touched). A duel's shadows take a batch of reads this way."""
        for i, key in enumerate(keys):
            if not self.touch(key):
                return i
        return len(keys)

    def victims(self) -> Iterator[Hashable]:
        """Held keys, the next to evict first (see the module's contract for skipping)."""
        raise NotImplementedError

    def begin(self, keys: Sequence[Hashable], tokens: Sequence[int] | None = None) -> None:
        """A request's blocks, in prefix order, before its lookup; `tokens` per block (None:
        one each). Most orders need nothing."""

    def state(self) -> dict:
        """Sizes of what the order keeps, for stats and the memory bound."""
        return {"held": len(self)}


class LRU(EvictionOrder):
    """Least recently used: reads and re-puts refresh."""

    name = "lru"
    refresh = True

    def __init__(self) -> None:
        self._d: OrderedDict = OrderedDict()     # oldest first

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key) -> bool:
        return key in self._d

    def insert(self, key) -> None:
        self._d[key] = None
        if self.refresh:
            self._d.move_to_end(key)

    def hit(self, key) -> None:
        if self.refresh and key in self._d:
            self._d.move_to_end(key)

    def hit_many(self, keys) -> None:
        if self.refresh:       # the loop runs in C: filter, map, and a deque that keeps nothing
            d = self._d
            deque(map(d.move_to_end, filter(d.__contains__, keys)), 0)

    def remove(self, key) -> None:
        self._d.pop(key, None)

    def touch(self, key) -> bool:
        if key not in self._d:
            return False
        if self.refresh:
            self._d.move_to_end(key)
        return True

    def touch_prefix(self, keys) -> int:
        d = self._d
        n = len(keys) if all(map(d.__contains__, keys)) else next(i for i, k in enumerate(keys) if k not in d)
        if self.refresh:
            deque(map(d.move_to_end, keys[:n] if n < len(keys) else keys), 0)
        return n

    def victims(self) -> Iterator:
        d = self._d
        while d:
            key = next(iter(d))
            yield key
            if key in d:                         # skipped: it goes behind the others
                d.move_to_end(key)


class FIFO(LRU):
    """Insertion order: reads refresh nothing."""

    name = "fifo"
    refresh = False
