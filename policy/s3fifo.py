"""S3-FIFO (Yang et al., SOSP'23) as an eviction order.

    insert ──> small FIFO ───────────── head: read since it came? ──yes──> main FIFO (tail)
       │      (small_fraction of held)                              no──> evicted, key to ghost
       └─ key in ghost ──> main FIFO ── head: read since (2-bit freq)? yes: freq-1, to the tail
                                                                    no:  evicted

One-off blocks (a prompt nobody repeats) pass through the small queue and leave without
touching the main one, where reused prefixes live; a block evicted young but asked for again
(its key still in the ghost list) goes straight to main. The ghost list holds keys only,
`ghost_factor` times as many as the cache has ever held at once: a longer memory lets a block
whose reuse comes after the small queue has turned over many times (the next turn of a
conversation, minutes later) into main on its second use.

A skipped victim (pinned, being read) is treated as used: it goes to the main queue's tail.

Batched reads (`hit_many`, `touch_prefix`) count into `_reads`, a Counter that C fills, and
each count is folded into its key's frequency when that frequency is next read (at a queue's
head, on a skip) or dropped with the key: the cap makes the order of adding irrelevant, so the
queues end as they would after one `touch` per read.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from itertools import islice
from typing import Iterator

from kvcache.policy.order import EvictionOrder

MAX_FREQ = 3


class S3FIFO(EvictionOrder):
    name = "s3fifo"

    def __init__(self, small_fraction: float = 0.1, ghost_factor: float = 1.0):
        if not 0 < small_fraction < 1:
            raise ValueError(f"s3fifo small_fraction must be in (0, 1), got {small_fraction}")
        if not 0 < ghost_factor <= 64:
            raise ValueError(f"s3fifo ghost_factor must be in (0, 64], got {ghost_factor}")
        self.small_fraction, self.ghost_factor = small_fraction, ghost_factor
        self.small: OrderedDict = OrderedDict()      # key -> reads since insert (capped), oldest first
        self.main: OrderedDict = OrderedDict()
        self.ghost: OrderedDict = OrderedDict()      # keys evicted from small, oldest first
        self._peak = 0                               # most keys held at once: the ghost list's bound
        self._reads: Counter = Counter()             # held key -> batched reads not yet in its freq

    def __len__(self) -> int:
        return len(self.small) + len(self.main)

    def __contains__(self, key) -> bool:
        return key in self.small or key in self.main

    def insert(self, key) -> None:
        small, main = self.small, self.main
        if key in small or key in main:
            self.touch(key)
            return
        if key == self._offered:
            self._offered = None
        if self.ghost.pop(key, 0) is None:           # ghosts map to None
            main[key] = 0
        else:
            small[key] = 0
        n = len(small) + len(main)
        if n > self._peak:
            self._peak = n

    def hit(self, key) -> None:
        self.touch(key)

    def touch(self, key) -> bool:
        q = self.small if key in self.small else self.main if key in self.main else None
        if q is None:
            return False
        freq = q[key]
        if freq < MAX_FREQ:
            q[key] = freq + 1
        return True

    def hit_many(self, keys) -> None:
        small, main = self.small, self.main
        self._reads.update([k for k in keys if k in small or k in main])

    def touch_prefix(self, keys) -> int:
        small, main, n = self.small, self.main, len(keys)
        for i, k in enumerate(keys):
            if k not in small and k not in main:
                n = i
                break
        self._reads.update(keys if n == len(keys) else islice(keys, n))
        return n

    def _freq(self, q: OrderedDict, key) -> int:
        """`key`'s frequency in `q` with its batched reads folded in."""
        freq = q[key]
        reads = self._reads.pop(key, 0)
        if reads:
            freq = q[key] = min(MAX_FREQ, freq + reads)
        return freq

    def remove(self, key) -> None:
        evicted, self._offered = key == self._offered, None
        if self._reads:
            self._reads.pop(key, None)
        if self.small.pop(key, None) is not None and evicted:
            self.ghost[key] = None
            while len(self.ghost) > max(1, int(self.ghost_factor * self._peak)):
                self.ghost.popitem(last=False)
        else:
            self.main.pop(key, None)

    def victims(self) -> Iterator:
        small, main = self.small, self.main
        while small or main:
            if small and (len(small) > self.small_fraction * len(self) or not main):
                key = next(iter(small))
                if (self._freq(small, key) if self._reads else small[key]) > 0:   # read while young: earned main
                    del small[key]
                    main[key] = 0
                    continue
            else:
                key = next(iter(main))
                freq = self._freq(main, key) if self._reads else main[key]
                if freq > 0:                         # reinserted, one read spent
                    main[key] = freq - 1
                    main.move_to_end(key)
                    continue
            self._offered = key
            yield key
            if key == self._offered:                 # skipped: counts as used
                self._offered = None
                if small.pop(key, None) is not None:
                    self._reads.pop(key, None)       # its reads in small do not follow it
                    main[key] = 0
                if key in main:
                    main.move_to_end(key)

    def state(self) -> dict:
        return {"held": len(self), "small": len(self.small), "main": len(self.main), "ghost": len(self.ghost)}
