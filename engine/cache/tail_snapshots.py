"""Tail snapshots, engine side (exact mode): where a hit can resume bit for bit, and the engine's
own bounded memory of the snapshots it wrote (each also saved to the store).

A snapshot sits at a block boundary (keyed by the block key there, stored under its snapshot
key) or inside a block, where an earlier request ended or had a cache point (keyed by the last
full block's key and the tokens after it, carrying the partial block's rows). Memory is looked at
first, then the store.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from kvcache.engine.cache import snapshot
from kvcache.engine.cache.connector import KVConnector
from kvcache.engine.request import Request
from kvcache.kvstore.hashing import Namespace, end_snapshot_key, snapshot_key

log = logging.getLogger(__name__)

# Where a hit resumes: (blocks to use, snapshot bytes from memory, snapshot key in the store, end);
# end > 0 when an earlier request ended inside the next block (the hit resumes there).
Boundary = tuple[int, bytes | None, bytes | None, int]


class TailSnapshots:
    def __init__(self, namespace: Namespace, connector: KVConnector | None, model, block_size: int,
                 memory_bytes: int):
        """`model` builds the fresh state a snapshot must fit; `connector` None: memory only."""
        self.namespace, self.connector, self.model = namespace, connector, model
        self.bs, self.memory_bytes = block_size, memory_bytes
        self.memory: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self._template: dict | None = None       # capture() of a fresh state: what a snapshot must fit

    # ------------------------------------------------------------ finding one
    def boundary(self, req: Request, keys: list[bytes], k: int) -> Boundary:
        """Exact mode uses a hit of k blocks only up to a point with a tail snapshot: an earlier
        request's end after (or inside) the hit's last block, else the last block boundary with
        one (engine memory first, then the store); no snapshot, no hit: the request must resume
        bit for bit."""
        found = self._end(req, keys, k)                 # an earlier request ended after the hit's blocks
        if found is not None:
            return (k, *found)
        best: Boundary = (0, None, None, 0)
        in_store = self.connector.snapshots_present(keys[:k]) if self.connector else [False] * k
        for j in range(k, 0, -1):                       # the last block boundary with a snapshot
            if keys[j - 1] in self.memory:
                self.memory.move_to_end(keys[j - 1])
                best = (j, self.memory[keys[j - 1]], None, 0)
                break
            if in_store[j - 1]:
                best = (j, None, snapshot_key(keys[j - 1]), 0)
                break
        inside = self._end(req, keys, k - 1) if k else None     # or one inside the last block
        if inside is not None and inside[2] > best[0] * self.bs:
            return (k - 1, *inside)
        return best

    def _end(self, req: Request, keys: list[bytes], k: int):
        """The longest earlier request end in (k*bs, (k+1)*bs) that this prompt continues:
        (snapshot bytes in memory, its key in the store, end) or None. One batched exists call."""
        ends = range(min((k + 1) * self.bs - 1, len(req.prompt) - 1), k * self.bs, -1)
        cands = [(L, self.end_key(req, keys[:k], req.prompt, L)) for L in ends]
        for L, key in cands:
            if key in self.memory:
                return self.memory[key], None, L
        if self.connector is None or not cands:
            return None
        there = self.connector.present([key for _, key in cands])
        return next(((None, key, L) for (L, key), ok in zip(cands, there) if ok), None)

    def end_key(self, req: Request, block_keys: list[bytes], tokens: list[int], length: int) -> bytes:
        """The key of an end snapshot of `req`'s chain at `length` tokens (inside the block after
        `block_keys`). Inside the first block there is no block key to chain from: the chain's
        root stands in, salted like the request's blocks (the namespace id for the salt "")."""
        k = length // self.bs
        prev = block_keys[k - 1] if k else (req.chain_root if req.cache_salt else self.namespace.id)
        return end_snapshot_key(prev, tokens[k * self.bs: length], self.namespace.algo.digest_size)

    def fitting(self, snap, length: int) -> dict | None:
        """The snapshot decoded, if it can resume this model at `length` tokens (else None, logged)."""
        state = _decoded(snap)
        if state is None:
            return None
        if self._template is None:
            self._template = snapshot.capture(self.model.new_state())
        why = snapshot.misfit(self._template, state, length)
        if why is not None:
            log.warning("a tail snapshot from the store does not fit (%s): recomputing instead", why)
            return None
        return state

    # ------------------------------------------------------------ keeping one
    def save_at_block(self, key: bytes, state) -> None:
        """A snapshot of `state` at the block boundary keyed `key` (once per boundary)."""
        if key not in self.memory:
            self.remember(key, snapshot.encode(snapshot.capture(state)), snapshot_key(key))

    def remember(self, key: bytes, data: bytes, store_key: bytes | None = None) -> None:
        """Keep a snapshot in engine memory (bounded, oldest out first) and save it to the store."""
        old = self.memory.pop(key, None)          # the same point again: replace, not count twice
        self._bytes += len(data) - (len(old) if old is not None else 0)
        self.memory[key] = data
        while self._bytes > self.memory_bytes and self.memory:
            self._bytes -= len(self.memory.popitem(last=False)[1])
        if self.connector is not None:
            self.connector.save_raw(store_key or key, data)

    def clear(self) -> None:
        """Forget the snapshots in engine memory (the store keeps its copies)."""
        self.memory.clear()
        self._bytes = 0


def _decoded(snap) -> dict | None:
    """A tail snapshot's contents, or None (logged) if its bytes do not decode as one."""
    try:
        return snapshot.decode(snap)
    except Exception as e:           # safetensors' own errors, bad metadata, a missing tensor...
        log.warning("a tail snapshot from the store does not decode (%s): recomputing instead", e)
        return None
