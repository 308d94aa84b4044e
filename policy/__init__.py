"""Eviction policies: which block a cache lets go first.

One contract (`order.EvictionOrder`: insert, hit, remove, victims, begin) and its orders, used
alike by the DRAM tier (`dram.eviction`), the engine's block pool and the trace simulator
(`kvstore/policy_sim.py`), so a policy measured on a trace is the one that runs:

    lru     least recently used                                  order.py
    fifo    insertion order                                      order.py
    s3fifo  small + main FIFO queues, ghost keys (SOSP'23)       s3fifo.py
    duel    follows whichever of LRU and two S3-FIFOs hits most  duel.py

A leaf package: it imports nothing of kvcache's but itself, and no third-party code.
"""

from __future__ import annotations

from kvcache.policy.duel import Duel
from kvcache.policy.order import FIFO, LRU, EvictionOrder
from kvcache.policy.s3fifo import S3FIFO

NAMES = ("lru", "fifo", "s3fifo", "duel")
DEFAULT_SMALL = {"s3fifo": 0.1, "duel": 0.5}   # S3-FIFO's small queue: alone, and as the duel's B


def make_order(name: str, small_fraction: float | None = None, decay: float = 0.999,
               capacity: int | None = None) -> EvictionOrder:
    """The order called `name`, tuned: `small_fraction` (S3-FIFO's small queue, alone or in the
    duel), `decay` (the duel's memory: ~1/(1-decay) requests), `capacity` (the duel's shadows,
    in blocks; None: the most the cache has held)."""
    if name not in NAMES:
        raise ValueError(f"unknown eviction policy {name!r}: choose one of {', '.join(NAMES)}")
    small = DEFAULT_SMALL.get(name, 0.1) if small_fraction is None else small_fraction
    if name == "lru":
        return LRU()
    if name == "fifo":
        return FIFO()
    if name == "s3fifo":
        return S3FIFO(small)
    return Duel(duel_contenders(small), decay, capacity)


def duel_contenders(small: float) -> list:
    """The duel's policies: LRU; S3-FIFO with a `small` small queue; S3-FIFO with a 10 % small
    queue and four times the ghost keys (second uses minutes apart still reach main)."""
    return [LRU, lambda: S3FIFO(small), lambda: S3FIFO(0.1, ghost_factor=4)]


__all__ = ["EvictionOrder", "LRU", "FIFO", "S3FIFO", "Duel", "NAMES", "make_order"]
