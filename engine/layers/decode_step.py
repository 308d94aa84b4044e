"""A pure decode step's state reads and writes as tensor ops: no per-request Python, no host
sync, so that a whole layer is one compiled graph (and, on a GPU, capturable as a CUDA graph).

The host works out once per step what every layer needs (engine/decode_plan.py): positions,
state slots, block tables, and per compress ratio where the new row goes. Every layer of a kind
reads the same DecodeStep; only the lanes differ. Per layer:

    window    slot rows [B, W-1] + the new row ─> keys [B, W]   rows past a request's count: -inf
              the slot is rewritten: slid by one when full, else the row appended at its count
    compress  the new row goes to the open window's buffer slot; every request pools the window
              its row would close (a [B, 2m] softmax: cheaper than a data-dependent branch), and
              only those whose row closes one write the entry into their block and the CSA carry
              into their slot; the others write into the pool's scratch block and slot
    history   every request's blocks in one gather [B, nb * rows_per_block, D], rows not visible
              yet zeroed; HCA masks them, CSA's indexer picks top-k among the visible ones

    writes that must go nowhere ─> the scratch block / slot (KVPool keeps one of each per lane)

The results equal Attention._decode_keys's (same rows, same pooling, same top-k), with the
window's keys in slot order plus -inf padding while it is not full.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RatioStep:
    """One compress ratio's per-request values for a decode step [B] (every layer of that ratio
    alike): where the new row goes, whether it closes a window and where that entry goes."""
    buf_slot: torch.Tensor      # the request's slot, or the scratch slot when its row closes the window
    buf_row: torch.Tensor       # the row's place in the buffer (pos % m; 0 where it closes)
    closes: torch.Tensor        # bool: this row completes a window
    carry: torch.Tensor         # bool (CSA): the previous window's Ca half is in the carry slot
    count: torch.Tensor         # entries before this token (the closing entry's index)
    entry_at: torch.Tensor      # flat row of the closing entry in a block lane; a scratch row if none
    carry_slot: torch.Tensor    # the slot the new carry goes to (scratch where nothing closes)
    visible: torch.Tensor       # entries this token may read, the new one included


@dataclass
class DecodeStep:
    """A pure decode step's per-request tensors [B] on the model's device."""
    pos: torch.Tensor           # the new token's position
    slots: torch.Tensor         # the request's state slot
    window_rows: torch.Tensor   # rows in the window slot before this token
    tables: torch.Tensor        # [B, nb] block ids, padded with the scratch block
    ratios: dict[int, RatioStep]

    def tensors(self) -> list[torch.Tensor]:
        """Every per-request tensor (dim 0 is the batch)."""
        return [self.pos, self.slots, self.window_rows, self.tables,
                *(getattr(r, f) for r in self.ratios.values() for f in r.__dataclass_fields__)]


def window_keys(kv: torch.Tensor, lane: torch.Tensor, step: DecodeStep) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [B, D] (the new rows, RoPE'd) -> (keys [B, W, D], bias [B, W]); the slots updated."""
    old = lane[step.slots].to(kv.dtype)                                     # [B, W-1, D]
    W = old.shape[1] + 1
    seen = torch.cat([old, kv[:, None]], 1)                                 # [B, W, D]
    j = torch.arange(W, device=kv.device)
    rows = step.window_rows[:, None]
    valid = (j[None, :] < rows) | (j[None, :] == W - 1)
    # slid by one when full; else the new row (index W-1 of seen) appended at the count
    r = j[None, : W - 1]
    src = torch.where(rows == W - 1, r + 1, torch.where(r == rows, W - 1, r))
    lane[step.slots] = seen.gather(1, src[..., None].expand(-1, -1, seen.shape[-1])).to(lane.dtype)
    keys = seen.masked_fill(~valid[..., None], 0.0)                         # stale rows never reach a product
    return keys, masked_bias(~valid)


def close_windows(comp, kv: torch.Tensor, gate: torch.Tensor, lanes: dict, prefix: str, rows_lane: torch.Tensor,
                  r: RatioStep, slots: torch.Tensor, rope) -> None:
    """A compressor's new rows kv, gate [B, c*d] into the buffers; the windows they close pooled
    and written to their blocks (what Compressor.absorb_many does, as tensor ops)."""
    m, d = comp.ratio, comp.head_dim
    buf_kv, buf_gate = lanes[prefix + "buf_kv"], lanes[prefix + "buf_gate"]
    win_kv = torch.cat([buf_kv[slots, : m - 1].to(kv.dtype), kv[:, None]], 1)          # [B, m, c*d]
    win_gate = torch.cat([buf_gate[slots, : m - 1].to(gate.dtype), gate[:, None]], 1) + comp.ape.float()
    buf_kv[r.buf_slot, r.buf_row] = kv.to(buf_kv.dtype)
    buf_gate[r.buf_slot, r.buf_row] = gate.to(buf_gate.dtype)
    if comp.overlap:            # 2m slots: the previous window's Ca (the carry), this window's Cb
        ok, og = lanes[prefix + "overlap_kv"], lanes[prefix + "overlap_gate"]
        have = r.carry[:, None, None]
        prev_kv = torch.where(have, ok[slots, :m].to(kv.dtype), 0.0)
        prev_gate = torch.where(have, og[slots, :m].to(gate.dtype), float("-inf"))
        ok[r.carry_slot, :m] = win_kv[..., :d].to(ok.dtype)
        og[r.carry_slot, :m] = win_gate[..., :d].to(og.dtype)
        win_kv = torch.cat([prev_kv, win_kv[..., d:]], 1)
        win_gate = torch.cat([prev_gate, win_gate[..., d:]], 1)
    cos, sin = rope.cos_sin(r.count * m, "compress")
    new = comp._pool(win_kv[:, None], win_gate[:, None], cos[:, None], sin[:, None])[:, 0]     # [B, d]
    rows_lane.view(-1, rows_lane.shape[-1])[r.entry_at] = new.to(rows_lane.dtype)


def decode_keys(attn, kv: torch.Tensor, pre: dict, step: DecodeStep, lanes: dict, rope):
    """Attention._decode_keys as tensor ops for an Attention `attn` whose requests are all in the
    pool: (keys [B, S, D], bias [B, S]) the new tokens attend over, every state write made.
    kv [1, B, D] and `pre` (the history inputs) are what attn.inputs returned."""
    keys, bias = window_keys(kv[0], lanes["window"], step)
    if attn.compressor is None:
        return keys, bias
    r = step.ratios[attn.ratio]
    close_windows(attn.compressor, pre["kv"][0], pre["gate"][0], lanes, "", lanes["entries"], r, step.slots, rope)
    entries, hidden = table_rows(lanes["entries"], step.tables, r.visible)
    if attn.indexer is None:                                          # HCA: every closed window
        return torch.cat([keys, entries], 1), torch.cat([bias, masked_bias(hidden)], 1)
    close_windows(attn.indexer.compressor, pre["ikv"][0], pre["igate"][0], lanes, "i_", lanes["index"], r,
                  step.slots, rope)
    index_keys, _ = table_rows(lanes["index"], step.tables, r.visible)
    ids = attn.indexer.select_visible(pre["iq"][0], pre["iw"][0], r.visible, index_keys)     # [B, k], -1 none
    picked = entries.gather(1, ids.clamp(min=0)[..., None].expand(-1, -1, entries.shape[-1]))
    return torch.cat([keys, picked], 1), torch.cat([bias, masked_bias(ids < 0)], 1)


def table_rows(lane: torch.Tensor, tables: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's rows in one gather [B, nb * rows_per_block, dim] (fp32), rows at or past
    `visible` zeroed (padding, rows of the scratch block, stale rows), and that mask [B, N]."""
    B = tables.shape[0]
    rows = lane[tables].reshape(B, -1, lane.shape[-1]).float()
    hidden = torch.arange(rows.shape[1], device=rows.device)[None, :] >= visible[:, None]
    return rows.masked_fill(hidden[..., None], 0.0), hidden


def masked_bias(hidden: torch.Tensor) -> torch.Tensor:
    """An attention bias: 0 where a key is seen, -inf where `hidden`."""
    return torch.zeros(hidden.shape, device=hidden.device).masked_fill(hidden, float("-inf"))
