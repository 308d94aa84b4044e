"""The KV block pool: fixed-size token blocks with ref counts and content keys (nano-vllm style).

    used    ref_count > 0: held by one or more running requests (n > 1 children share prompt blocks)
    cached  ref_count == 0 but still holding the content of a full block (it has a key): reusable
            by a request with the same prefix until reallocated; it sits in the free queue
    free    ref_count == 0, no content

    free queue (eviction order):  head = reallocated first ... tail = freed last
    a request frees its blocks in reverse order, so a prefix's tail blocks go before its head

Invariant, checked by `check()`: free + cached + used == total, every free-queue block has
ref_count 0, and every key maps to the block that holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvcache.kvstore.hashing import hash_blocks


class PoolExhausted(RuntimeError):
    """Not enough blocks: the scheduler preempts or waits."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one token")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_key: dict[bytes, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def num_free(self) -> int:
        """Blocks that can be handed out now (free or cached)."""
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """n blocks from the head of the free queue (cached content there is dropped)."""
        if n > len(self._free):
            raise PoolExhausted(f"need {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            blk = self.blocks[bid]
            if blk.key is not None:
                del self._by_key[blk.key]
                blk.key = None
            blk.ref_count = 1
            out.append(bid)
        return out

    def share(self, block_ids: list[int]) -> None:
        """Another holder for these blocks (a forked sample, or a prefix hit)."""
        for bid in block_ids:
            blk = self.blocks[bid]
            if blk.ref_count == 0:
                self._free.pop(bid)
            blk.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one hold on each block, last block first (the tail of a prefix is evicted first)."""
        for bid in reversed(block_ids):
            blk = self.blocks[bid]
            if blk.ref_count <= 0:
                raise RuntimeError(f"block {bid} released more often than held")
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self._free[bid] = None

    def set_key(self, block_id: int, key: bytes) -> None:
        """Record the content key of a full block (kept after release until reallocated)."""
        blk = self.blocks[block_id]
        old = self._by_key.get(key)
        if old is not None and old != block_id:
            return                     # the same content already has a block; keep the first
        if blk.key is not None and blk.key != key:
            self._by_key.pop(blk.key, None)
        blk.key = key
        self._by_key[key] = block_id

    def lookup(self, key: bytes) -> int | None:
        return self._by_key.get(key)

    def forget_cached(self) -> int:
        """Drop the content key of every block no request holds: cached blocks become free, so
        no later lookup finds them; held blocks keep their keys. Returns how many were dropped."""
        dropped = 0
        for blk in self.blocks:
            if blk.ref_count == 0 and blk.key is not None:
                self._by_key.pop(blk.key, None)
                blk.key = None
                dropped += 1
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
            if self.blocks[bid].ref_count != 0:
                raise AssertionError(f"block {bid} is in the free queue with ref_count {self.blocks[bid].ref_count}")
        if len(self._free) != c["free"] + c["cached"]:
            raise AssertionError(f"free queue holds {len(self._free)} blocks, expected {c['free'] + c['cached']}")
        for key, bid in self._by_key.items():
            if self.blocks[bid].key != key:
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
