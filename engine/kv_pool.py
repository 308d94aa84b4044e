"""The KV pool's storage: every lane of the model's KV layout, preallocated once.

    block lanes (history, in blocks of block_size tokens; BlockPool ids address them)
      (layer, "entries")   [num_blocks, block_size // ratio, head_dim]        compressed rows
      (layer, "index")     [num_blocks, block_size // ratio, index_head_dim]  index keys
      block b of a request covers its tokens [b * block_size, (b + 1) * block_size) in every lane
    slot lanes (bounded per-request state; one slot per running request)
      (layer, "window")    [slots, window - 1, head_dim]                      sliding-window rows
      (layer, "buf_kv" | "buf_gate")   [slots, ratio - 1, c * d]             an unfinished window's rows
      (layer, "overlap_kv" | "overlap_gate")  [slots, ratio, d]              CSA: last window's Ca half
      (layer, "i_...")     the same for a V4 indexer's own compressor
      (layer, "pending")   [slots, 1, 2 * head_dim]                           V4.1 ratio-2 open pair

Every lane has one block (`scratch_block`) or slot (`scratch_slot`) past the ones handed out: a
decode step written as tensor ops (layers/decode_step.py) sends the writes that must go nowhere
there (rows that close no window) instead of branching per request.

A request's block table addresses all block lanes at once, so one block id is one content-addressed
unit: what the store saves and loads. Windows and carry are not content-addressed: they
live in the request's slot and are rebuilt (bounded replay) or snapshotted, never shared.
"""

from __future__ import annotations

import torch

from kvcache.engine.layers.history import BlockRows, SlotRows


class KVPool:
    def __init__(self, model, num_blocks: int, block_size: int, slots: int = 64, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        """Block lanes in `dtype` (default: the model's weight dtype: fp32 on CPU, bf16 on an
        accelerator) on `device` (default: the model's). Slot lanes stay fp32: windows and carries
        are small, and keeping the fp32 rows the model computed means a token sees the same keys
        whether its neighbours came in the same chunk (fresh) or an earlier one (from the slot),
        which chunked prefill and exact prefix reuse rely on."""
        weight = model.embed.weight
        dtype, device = dtype or weight.dtype, device or weight.device
        self.block_size, self.device = block_size, torch.device(device)
        self.scratch_block, self.scratch_slot = num_blocks, slots
        self.lanes: dict[tuple[int, str], torch.Tensor] = {}
        self.slot_lanes: dict[tuple[int, str], torch.Tensor] = {}
        self._free_slots = list(range(slots - 1, -1, -1))
        for i, blk in enumerate(model.layers):
            self._slot_lanes_for(i, blk.attn, slots + 1, torch.float32, device)
        for i, blk in enumerate(model.layers):
            a = blk.attn
            ratio = getattr(a, "ratio", 0)
            owns = a.compressor is not None
            if not owns or ratio <= 0:
                continue
            if block_size % ratio:
                raise ValueError(f"block_size {block_size} is not a multiple of layer {i}'s compress ratio {ratio}")
            rows = block_size // ratio
            self.lanes[(i, "entries")] = torch.zeros((num_blocks + 1, rows, a.head_dim), dtype=dtype, device=device)
            index_dim = _index_dim(a)
            if index_dim:
                self.lanes[(i, "index")] = torch.zeros((num_blocks + 1, rows, index_dim), dtype=dtype, device=device)
        # compiled decode graphs take lanes as inputs: their block / slot count is a dynamic size,
        # so that pools of other sizes (the warm-up's scratch engine) share the graphs
        for lane in (*self.lanes.values(), *self.slot_lanes.values()):
            torch._dynamo.maybe_mark_dynamic(lane, 0)

    def _slot_lanes_for(self, i: int, a, slots: int, dtype, device) -> None:
        def lane(name, rows, width):
            self.slot_lanes[(i, name)] = torch.zeros((slots, max(rows, 1), width), dtype=dtype, device=device)
        lane("window", a.window - 1, a.head_dim)
        comp = a.compressor
        if comp is None:
            return
        if hasattr(comp, "overlap"):                       # V4 compressor (+ the CSA indexer's own)
            for prefix, c in (("", comp), ("i_", getattr(getattr(a, "indexer", None), "compressor", None))):
                if c is None:
                    continue
                width = (2 if c.overlap else 1) * c.head_dim
                lane(prefix + "buf_kv", c.ratio - 1, width)
                lane(prefix + "buf_gate", c.ratio - 1, width)
                if c.overlap:
                    lane(prefix + "overlap_kv", c.ratio, c.head_dim)
                    lane(prefix + "overlap_gate", c.ratio, c.head_dim)
        elif getattr(comp, "ratio", 1) == 2:              # V4.1 ratio-2 source
            lane("pending", 1, 2 * comp.head_dim)

    def acquire_slot(self) -> int | None:
        return self._free_slots.pop() if self._free_slots else None

    def release_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def view(self, table: list[int], slot: int) -> "PoolView":
        return PoolView(self, table, slot)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy block contents in every lane (a forked request's own copy of a partial block)."""
        if src:
            s, d = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
            for lane in self.lanes.values():
                lane[d] = lane[s]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.lanes.values(), *self.slot_lanes.values()))


def _index_dim(attn) -> int:
    if getattr(attn, "indexer", None) is None:
        return 0
    wk = getattr(attn.indexer, "wk", None)          # V4.1 kv source: keys from the latent
    if wk is not None:
        return wk.out_features
    comp = getattr(attn.indexer, "compressor", None)  # V4 CSA: the indexer's own compressor
    return comp.head_dim if comp is not None else 0


class PoolView:
    """One request's window onto the pool: its block table and its slot."""

    def __init__(self, pool: KVPool, table: list[int], slot: int, layer: int | None = None):
        self.pool, self.table, self.slot, self.layer_id = pool, table, slot, layer

    def layer(self, i: int) -> "PoolView":
        return PoolView(self.pool, self.table, self.slot, i)

    def rows(self, kind: str) -> BlockRows:
        return BlockRows(self.pool.lanes[(self.layer_id, kind)], self.table)

    def attach(self, obj, name: str, lane_name: str | None = None) -> None:
        setattr(obj, name, SlotRows(self.pool.slot_lanes[(self.layer_id, lane_name or name)], self.slot))

    def attach_carry(self, state, prefix: str) -> None:
        for name in ("buf_kv", "buf_gate", "overlap_kv", "overlap_gate"):
            if (self.layer_id, prefix + name) in self.pool.slot_lanes:
                self.attach(state, name, prefix + name)

    def slot_for(self, lane: torch.Tensor) -> int:
        return self.slot
