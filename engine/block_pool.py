"""The KV block pool: fixed-size token blocks with ref counts and content keys (nano-vllm style).

    used    ref_count > 0: held by one or more running requests (n > 1 children share prompt blocks)
    cached  ref_count == 0 but still holding the content of a full block (it has a key): reusable
            by a request with the same prefix until reallocated
    free    ref_count == 0, no content

    allocate ──> a free block (the oldest freed first) ──none──> the eviction order's first
                 victim that no request holds (its key dropped)

The eviction order is one of kvcache/policy's (`eviction`, LRU by default) over the content keys
of every keyed block: keyed blocks are inserted, a prefix hit (`share`) and each release count as
uses, blocks in use are skipped (the order counts that as a use too). A request releases its
blocks last first, so under LRU a prefix's tail goes before its head. Content is never dropped
while a block without any is free.

Invariant, checked by `check()`: free + cached + used == total, the free list holds exactly the
blocks with neither holders nor content, the order exactly the keyed blocks, and every key maps
to the block that holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvcache.kvstore.hashing import hash_blocks
from kvcache.policy import make_order


class PoolExhausted(RuntimeError):
    """Not enough blocks: the scheduler preempts or waits."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, eviction: str = "lru"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one token")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._order = make_order(eviction, capacity=num_blocks)
        self._cached = 0                     # blocks with a key and no holder
        self._by_key: dict[bytes, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def num_free(self) -> int:
        """Blocks that can be handed out now (free or cached)."""
        return len(self._free) + self._cached

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """n blocks: free ones first, then the eviction order's victims (their content dropped)."""
        if n > self.num_free():
            raise PoolExhausted(f"need {n} blocks, {self.num_free()} free")
        out = []
        for _ in range(n):
            bid = self._free.popitem(last=False)[0] if self._free else self._evict()
            self.blocks[bid].ref_count = 1
            out.append(bid)
        return out

    def _evict(self) -> int:
        """The first victim no request holds; a cached block exists (num_free), so the pass ends."""
        for key in self._order.victims():
            blk = self.blocks[self._by_key[key]]
            if blk.ref_count == 0:
                self._drop_key(blk)
                self._cached -= 1
                return blk.block_id
        raise AssertionError("the eviction order holds no cached block although the pool counts one")

    def _drop_key(self, blk: Block) -> None:
        self._order.remove(blk.key)
        del self._by_key[blk.key]
        blk.key = None

    def share(self, block_ids: list[int]) -> None:
        """Another holder for these blocks (a forked sample, or a prefix hit)."""
        for bid in block_ids:
            blk = self.blocks[bid]
            if blk.ref_count == 0:
                if blk.key is None:
                    self._free.pop(bid)
                else:
                    self._cached -= 1
            if blk.key is not None:
                self._order.hit(blk.key)
            blk.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one hold on each block, last block first (the tail of a prefix is evicted first)."""
        for bid in reversed(block_ids):
            blk = self.blocks[bid]
            if blk.ref_count <= 0:
                raise RuntimeError(f"block {bid} released more often than held")
            blk.ref_count -= 1
            if blk.ref_count == 0:
                if blk.key is None:
                    self._free[bid] = None
                else:
                    self._cached += 1
                    self._order.hit(blk.key)

    def set_key(self, block_id: int, key: bytes) -> None:
        """Record the content key of a full block (kept after release until reallocated)."""
        blk = self.blocks[block_id]
        old = self._by_key.get(key)
        if old is not None and old != block_id:
            return                     # the same content already has a block; keep the first
        if blk.key == key:
            return
        if blk.key is not None:
            self._drop_key(blk)
        elif blk.ref_count == 0:       # a free block gains content: it is cached now
            self._free.pop(block_id)
            self._cached += 1
        blk.key = key
        self._by_key[key] = block_id
        self._order.insert(key)

    def begin(self, keys: list[bytes]) -> None:
        """A request's prompt block keys before its prefix is matched (the duel scores its two
        orders' prefix hits on it; the others ignore it)."""
        self._order.begin(keys)

    def lookup(self, key: bytes) -> int | None:
        return self._by_key.get(key)

    def forget_cached(self) -> int:
        """Drop the content key of every block no request holds: cached blocks become free, so
        no later lookup finds them; held blocks keep their keys. Returns how many were dropped."""
        dropped = 0
        for blk in self.blocks:
            if blk.ref_count == 0 and blk.key is not None:
                self._drop_key(blk)
                self._free[blk.block_id] = None
                dropped += 1
        self._cached -= dropped
        return dropped

    def counts(self) -> dict[str, int]:
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        cached = sum(1 for b in self.blocks if b.ref_count == 0 and b.key is not None)
        return {"used": used, "cached": cached, "free": len(self.blocks) - used - cached, "total": len(self.blocks)}

    def check(self) -> None:
        """Raise if the bookkeeping is inconsistent (run when idle, and in tests)."""
        c = self.counts()
        if c["free"] + c["cached"] + c["used"] != c["total"]:
            raise AssertionError(f"block pool counts do not add up: {c}")
        for bid in self._free:
            b = self.blocks[bid]
            if b.ref_count != 0 or b.key is not None:
                raise AssertionError(f"block {bid} is on the free list with ref_count {b.ref_count}, key {b.key}")
        if len(self._free) != c["free"] or self._cached != c["cached"]:
            raise AssertionError(f"free list {len(self._free)} / cached {self._cached}, expected {c}")
        keyed = sum(1 for b in self.blocks if b.key is not None)
        if len(self._order) != keyed or len(self._by_key) != keyed:
            raise AssertionError(f"eviction order holds {len(self._order)} keys, {keyed} blocks have one")
        for key, bid in self._by_key.items():
            if self.blocks[bid].key != key or key not in self._order:
                raise AssertionError(f"key index points at block {bid}, which holds another key")


def key_blocks(pool: BlockPool, namespace, req, computed: int, coming: list[int] = ()) -> None:
    """Content keys (kvstore.hashing chain) for every block of `req` whose tokens are all computed
    (`computed`: how many are): they stay findable in the pool after the request ends, until the
    block is reallocated. `coming`: computed tokens the step is about to append (verified drafts),
    so that a request that ends with this step has its last blocks keyed (and saved) too."""
    tokens = req.tokens + list(coming)
    full = min(computed, len(tokens)) // pool.block_size
    if full <= len(req.block_keys) or req.finished:
        return
    bs, have = pool.block_size, len(req.block_keys)
    new = req.prompt_keys[have:full]                 # the prompt's keys were hashed when it was added
    start = have + len(new)
    if full > start:                                 # blocks of generated tokens
        parent = (req.block_keys + new)[-1] if start else req.chain_root
        new = new + hash_blocks(namespace, tokens[start * bs: full * bs], parent=parent)
    for i, key in enumerate(new, start=have):
        pool.set_key(req.block_ids[i], key)
    req.block_keys += new
