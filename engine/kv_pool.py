"""The KV pool's storage: the history lanes of the model's KV layout, paged in the block pool's blocks.

    lane (layer, "entries")  [num_blocks, block_size // ratio, head_dim]        compressed rows
    lane (layer, "index")    [num_blocks, block_size // ratio, index_head_dim]  index keys
    block b of a request covers its tokens [b * block_size, (b + 1) * block_size) in every lane

A request's block table (BlockPool ids, in order) addresses all lanes at once, so one block id is
one content-addressed unit: what the store will save and load (issue 6). Sliding windows and the
compressor carry are bounded per request and stay in the request's state.
"""

from __future__ import annotations

import torch

from kvcache.engine.layers.history import PagedRows


class KVPool:
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32):
        self.block_size = block_size
        self.lanes: dict[tuple[int, str], torch.Tensor] = {}
        for i, blk in enumerate(model.layers):
            a = blk.attn
            ratio = getattr(a, "ratio", 0)
            owns = a.compressor is not None
            if not owns or ratio <= 0:
                continue
            if block_size % ratio:
                raise ValueError(f"block_size {block_size} is not a multiple of layer {i}'s compress ratio {ratio}")
            rows = block_size // ratio
            self.lanes[(i, "entries")] = torch.zeros((num_blocks, rows, a.head_dim), dtype=dtype)
            index_dim = _index_dim(a)
            if index_dim:
                self.lanes[(i, "index")] = torch.zeros((num_blocks, rows, index_dim), dtype=dtype)

    def view(self, table: list[int]) -> "PoolView":
        return PoolView(self, table)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy block contents in every lane (a forked request's own copy of a partial block)."""
        if src:
            s, d = torch.tensor(src), torch.tensor(dst)
            for lane in self.lanes.values():
                lane[d] = lane[s]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.lanes.values())


def _index_dim(attn) -> int:
    if getattr(attn, "indexer", None) is None:
        return 0
    wk = getattr(attn.indexer, "wk", None)          # V4.1 kv source: keys from the latent
    if wk is not None:
        return wk.out_features
    comp = getattr(attn.indexer, "compressor", None)  # V4 CSA: the indexer's own compressor
    return comp.head_dim if comp is not None else 0


class PoolView:
    """One request's window onto the pool: `lanes(layer)(kind)` -> PagedRows over its block table."""

    def __init__(self, pool: KVPool, table: list[int]):
        self.pool, self.table = pool, table

    def lanes(self, layer: int):
        def rows(kind: str) -> PagedRows:
            return PagedRows(self.pool.lanes[(layer, kind)], self.table)
        return rows
