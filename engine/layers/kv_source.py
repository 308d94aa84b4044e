"""V4.1 kv-source layers (2, 8, 14: ratio 2; 20: ratio 1): the compressed KV and index keys that
every later layer of the group reads.

    ratio 2:  rows p-1, p (p odd) ─ per channel softmax over the pair's wgate logits ─ sum of wkv rows
    ratio 1:  wkv row of every token (no gate, no pooling)
    latent = norm(pooled)                       (fp32; written when the group closes)
    entry  = RoPE(latent) at (p // r) * r       the main cache row (compress table)
    index key = RoPE(k_norm(indexer.wk(latent)))  from the *un-rotated* latent, then rotated

A ratio-2 pair split across two forward calls waits in the state's one-row buffer.
"""

from __future__ import annotations

import torch
from torch import nn

from kvcache.engine.layers.history import DenseRows, SlotField, clone_field, record
from kvcache.engine.layers.norm import RMSNorm
from kvcache.engine.layers.rope import RotaryTables, apply_rope


class SourceState:
    """A kv source's entries and index keys (pool blocks or dense), and a ratio-2 open pair's
    raw rows (a pool slot or a tensor)."""
    pending = SlotField()          # ratio 2: [B, p < 2, 2D] raw (kv | gate) rows of an open pair

    def __init__(self, rows=None, keys=None, pending=None, count=0):
        self.rows, self.keys, self.pending, self.count = rows, keys, pending, count
        self.floor = 0            # entries below this index are already stored (bounded replay: not rewritten)
        self.journal: list | None = None          # a speculative step's new rows (history.record)

    @property
    def entries(self) -> torch.Tensor | None:
        return None if self.rows is None else self.rows.view()

    @property
    def index_keys(self) -> torch.Tensor | None:
        return None if self.keys is None else self.keys.view()

    def clone(self, view=None) -> "SourceState":
        table = None if view is None else view.table
        st = SourceState(None if self.rows is None else self.rows.clone(table),
                         None if self.keys is None else self.keys.clone(table), count=self.count)
        st.floor = self.floor
        st.pending = clone_field(self, "pending", None if view is None else view.slot_for)
        return st


class SourceCompressor(nn.Module):
    """`attn.compressor.{wkv, wgate (ratio 2), norm}` of a kv-source layer."""

    def __init__(self, dim: int, head_dim: int, ratio: int, eps: float):
        super().__init__()
        if ratio not in (1, 2):
            raise ValueError(f"V4.1 kv sources compress at ratio 1 or 2, not {ratio}")
        self.ratio, self.head_dim = ratio, head_dim
        self.wkv = nn.Linear(dim, head_dim, bias=False)
        if ratio == 2:
            self.wgate = nn.Linear(dim, head_dim, bias=False)
        self.norm = RMSNorm(head_dim, eps)

    def latents(self, x: torch.Tensor, state: SourceState) -> torch.Tensor:
        """Feed tokens [B, T, dim]; the latents of the groups they close [B, n, D] (un-rotated)."""
        return self.latents_from(self.project(x), state)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Token-wise: wkv rows, and for ratio 2 the gate logits beside them [B, T, (1|2) D]."""
        rows = self.wkv(x).float()
        return rows if self.ratio == 1 else torch.cat([rows, self.wgate(x).float()], -1)

    def latents_from(self, rows: torch.Tensor, state: SourceState) -> torch.Tensor:
        record(state, rows)
        if self.ratio == 1:
            return self.norm(rows)
        if state.pending is not None:
            rows = torch.cat([state.pending, rows], 1)
        usable = rows.shape[1] // 2 * 2
        state.pending = rows[:, usable:]
        pairs = rows[:, :usable].unflatten(1, (usable // 2, 2))                 # [B, n, 2, 2D]
        kv, gate = pairs[..., : self.head_dim], pairs[..., self.head_dim:]
        return self.norm((kv * torch.softmax(gate, dim=2)).sum(2))


class IndexKeys(nn.Module):
    """`attn.indexer.{wk, k_norm}` of a kv source: index keys from the pre-RoPE latent."""

    def __init__(self, head_dim: int, index_head_dim: int, eps: float):
        super().__init__()
        self.wk = nn.Linear(head_dim, index_head_dim, bias=False)
        self.k_norm = RMSNorm(index_head_dim, eps)

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return self.k_norm(self.wk(latent))


def emit(state: SourceState, latents: torch.Tensor, keys: torch.Tensor | None, ratio: int,
         rope: RotaryTables) -> None:
    """Rotate new latents and index keys at their group's first position and append them."""
    n = latents.shape[1]
    if state.rows is None:
        state.rows = DenseRows(latents.shape[-1], device=latents.device)
    if keys is not None and state.keys is None:
        state.keys = DenseRows(keys.shape[-1], device=keys.device)
    if n == 0:
        return
    pos = (torch.arange(n, device=latents.device) + state.count) * ratio
    cos, sin = rope.cos_sin(pos, "compress")
    skip = min(n, max(0, state.floor - state.count))       # loaded from the cache: keep those
    if skip < n:
        state.rows.append(apply_rope(latents, cos, sin)[:, skip:])
        if keys is not None:
            state.keys.append(apply_rope(keys, cos, sin)[:, skip:])
    state.count += n
