"""V4.1's indexer on index-source layers, and the hierarchical candidate stage (HSI).

    q_I[t, h] = RoPE(indexer.wq_b(qr_t))[h]              32 heads x 128 (compress table)
    w[t, h]   = indexer.weights_proj(x_t)[h] * 128^-0.5 * 32^-0.5
    I[t, s]   = sum_h w[t, h] * relu(q_I[t, h] . K_I[s])  over visible entries s < (t + 1) // ratio
    top-k     = the `index_topk` best s per query, ascending, padded with -1

Candidate source (layer 20) also groups its scores in blocks of `candidate_block_size` entries
(a block scores its best visible entry), always keeps the block holding the newest visible entry,
and keeps the top `candidate_topk_blocks` blocks. Reindex layers (24, 28, 32, 36) score with their
own q / weights against layer 20's keys, but only inside those blocks, then take their top-k.
"""

from __future__ import annotations

import torch
from torch import nn

from kvcache.engine.layers.rope import RotaryTables, apply_rope


class SparseIndexer(nn.Module):
    """`attn.indexer.{wq_b, weights_proj}`."""

    def __init__(self, dim: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(dim, n_heads, bias=False)

    def scores(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
               ratio: int, rope: RotaryTables) -> torch.Tensor:
        """[B, T, N] index scores, -inf where an entry is not visible yet."""
        return self.scores_from(*self.query(x, qr, positions, rope), positions, keys, ratio)

    def query(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rope: RotaryTables):
        """Token-wise: (queries [B, T, H, dI] RoPE'd, head weights [B, T, H] with both scales)."""
        B, T, _ = x.shape
        q = self.wq_b(qr).float().view(B, T, self.n_heads, self.head_dim)
        cos, sin = rope.cos_sin(positions, "compress")
        w = self.weights_proj(x).float() * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        return apply_rope(q, cos[:, None], sin[:, None]), w

    def scores_from(self, q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                    ratio: int) -> torch.Tensor:
        s = (torch.relu(torch.einsum("bthd,bnd->bthn", q, keys.float())) * w[..., None]).sum(2)
        hidden = torch.arange(keys.shape[1], device=s.device)[None, :] >= ((positions + 1) // ratio)[:, None]
        return s.masked_fill(hidden, float("-inf"))

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Top-k entry ids per query [B, T, k], ascending, -1 where fewer are visible."""
        return top_ascending(scores, self.topk)


def top_ascending(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k best entries per query, ascending, -1 padded. Ties (relu scores are often exactly 0)
    go to the older entry, whatever the tensor's width: a stable sort, not topk, so a query picks
    the same entries in one prefill, in chunks, or token by token."""
    B, T, N = scores.shape
    out = torch.full((B, T, k), -1, dtype=torch.long, device=scores.device)
    if N == 0:
        return out
    kk = min(k, N)
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    vals, idx = vals[..., :kk], idx[..., :kk]
    idx = torch.where(torch.isfinite(vals), idx, torch.full_like(idx, N))   # invisible picks sort last
    idx = idx.sort(dim=-1).values
    out[..., :kk] = torch.where(idx >= N, torch.full_like(idx, -1), idx)
    return out


def candidate_mask(scores: torch.Tensor, positions: torch.Tensor, ratio: int, block: int,
                   top_blocks: int) -> torch.Tensor:
    """Bool [B, T, N]: entries inside each query's candidate blocks (HSI, candidate source only)."""
    B, T, N = scores.shape
    n_blocks = -(-N // block)
    padded = scores.new_full((B, T, n_blocks * block), float("-inf"))
    padded[..., :N] = scores
    block_scores = padded.view(B, T, n_blocks, block).amax(-1)              # -inf: nothing visible
    visible = (positions + 1) // ratio
    newest = ((visible - 1).clamp(min=0) // block)                          # the block of the newest entry
    has_any = (visible > 0)[None, :].expand(B, -1)
    pin = torch.zeros_like(block_scores, dtype=torch.bool)
    pin.scatter_(-1, newest.view(1, T, 1).expand(B, -1, 1), True)
    block_scores = torch.where(pin & has_any[..., None], torch.full_like(block_scores, float("inf")), block_scores)
    kk = min(top_blocks, n_blocks)
    vals, keep = torch.sort(block_scores, dim=-1, descending=True, stable=True)
    vals, keep = vals[..., :kk], keep[..., :kk]
    chosen = torch.zeros((B, T, n_blocks), dtype=torch.bool, device=scores.device)
    chosen.scatter_(-1, keep, vals > float("-inf"))
    return chosen.repeat_interleave(block, -1)[..., :N]
