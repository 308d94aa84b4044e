"""Tenant shares of the DRAM arena: each listed tenant's blocks in an eviction order of their own,
and room taken first from whoever holds most beyond their share.

    [dram.tenants.acme]  share = 0.5, eviction = "duel"      ─┐
    [dram.tenants.beta]  share = 0.2                          ├─> one order per partition
    every other tenant   share = 1 - 0.5 - 0.2 = 0.3         ─┘   (the rest: dram.eviction)

    victims():  the partition furthest above its share (held bytes - share x capacity)
                offers its order's next victim; after each eviction the shares are
                compared again, so a pass drains the worst offender down to the others

Shares are floors, not caps: a tenant alone may fill the arena, and loses the excess as soon
as others need room; below its share its blocks go only after every partition above its own
has given up what it can (pinned and leased blocks cannot go, so a partition whose whole pass
was skipped is passed over for the rest of that pass). A tenant that floods DRAM with one-off
prompts then evicts its own blocks, not a neighbour's reused prefix.

`SharedOrder` keeps the `EvictionOrder` contract (kvcache/policy/order.py) for the tier: it
learns each new key's tenant and size from the tier's entries (`entries[key].tenant`,
`.nbytes`, read at insert, when the entry exists) and remembers both until the key leaves.
"""

from __future__ import annotations

from typing import Hashable, Iterator, Mapping, Sequence

from kvcache.policy import EvictionOrder

REST = ""          # the partition of every tenant without a share of its own


class SharedOrder(EvictionOrder):
    name = "tenant-shares"

    def __init__(self, orders: Mapping[str, EvictionOrder], shares: Mapping[str, float], capacity: int,
                 entries: Mapping):
        """`orders` and `shares` by partition (tenant name, or REST for the others; each share a
        fraction of `capacity` bytes); `entries`: the tier's key -> entry map."""
        if REST not in orders or set(orders) != set(shares):
            raise ValueError("SharedOrder needs an order and a share for each partition, the rest included")
        self.orders = dict(orders)
        self.floor = {p: s * capacity for p, s in shares.items()}
        self.held_bytes = dict.fromkeys(orders, 0)
        self._entries = entries
        self._where: dict[Hashable, tuple[str, int]] = {}    # key -> (partition, bytes)
        self._incoming: tuple[str, int] = (REST, 0)            # the put making room: its partition, bytes

    def partition_of(self, tenant: str) -> str:
        return tenant if tenant in self.orders else REST

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key) -> bool:
        return key in self._where

    def expect(self, tenant: str, nbytes: int) -> None:
        """The tier is about to make room for `tenant`'s block of `nbytes`: it counts as held
        (between partitions at their shares, the one putting gives up the room)."""
        self._incoming = (self.partition_of(tenant), nbytes)

    def insert(self, key) -> None:
        self._incoming = (REST, 0)
        where = self._where.get(key)
        if where is not None:
            self.orders[where[0]].insert(key)
            return
        e = self._entries[key]
        p = self.partition_of(e.tenant)
        self._where[key] = (p, e.nbytes)
        self.held_bytes[p] += e.nbytes
        self.orders[p].insert(key)

    def hit(self, key) -> None:
        where = self._where.get(key)
        if where is not None:
            self.orders[where[0]].hit(key)

    def hit_many(self, keys) -> None:
        parts: dict[str, list] = {}
        for key in keys:
            where = self._where.get(key)
            if where is not None:
                parts.setdefault(where[0], []).append(key)
        for p, part in parts.items():
            self.orders[p].hit_many(part)

    def remove(self, key) -> None:
        where = self._where.pop(key, None)
        if where is not None:
            self.held_bytes[where[0]] -= where[1]
            self.orders[where[0]].remove(key)

    def begin_for(self, tenant: str, keys: Sequence, tokens: Sequence[int] | None = None) -> None:
        """A lookup by `tenant`: its partition's order learns from it (others never see it)."""
        self.orders[self.partition_of(tenant)].begin(keys, tokens)

    def begin(self, keys: Sequence, tokens: Sequence[int] | None = None) -> None:
        self.begin_for(REST, keys, tokens)

    def victims(self) -> Iterator:
        passes: dict[str, Iterator] = {}
        offered: dict[str, object] = {}
        skipped = dict.fromkeys(self.orders, 0)
        done: set[str] = set()
        while True:
            p = self._worst(done)
            if p is None:
                return
            order = self.orders[p]
            last = offered.get(p)
            skipped[p] = skipped[p] + 1 if last is not None and last in order else 0
            if skipped[p] > len(order):               # a whole pass of it skipped: none can go
                done.add(p)
                continue
            it = passes.get(p)
            if it is None:
                it = passes[p] = order.victims()
            key = next(it, None)
            if key is None:
                done.add(p)
                continue
            offered[p] = key
            yield key

    def _worst(self, done: set[str]) -> str | None:
        """The partition holding most bytes beyond its share, among those with blocks to offer."""
        best, over = None, None
        coming, nbytes = self._incoming
        for p, order in self.orders.items():
            if p in done or not len(order):
                continue
            o = self.held_bytes[p] + (nbytes if p == coming else 0) - self.floor[p]
            if over is None or o > over:
                best, over = p, o
        return best

    def state(self) -> dict:
        return {"held": len(self), "partitions": {
            p or "(rest)": {"policy": o.name, "held_bytes": self.held_bytes[p], "share_bytes": int(self.floor[p]),
                            **o.state()} for p, o in self.orders.items()}}
