"""Tensor and expert parallelism over torch.distributed (gloo on CPU, nccl on CUDA, hccl on Ascend).

    tensor parallel (tp)   attention heads split across ranks: wq_b rows, attn_sink, the o_groups
                           of wo_a and the matching columns of wo_b; each rank attends with its heads
                           and the partial wo_b outputs are summed (all_reduce). The K = V latent,
                           compressors and indexers are one head wide: every rank computes them.
                           Shared experts (and routed experts when ep is off) split their
                           intermediate width: w1/w3 rows, w2 columns; partial outputs summed.
    expert parallel (ep)   routed experts dealt out whole (expert e on rank e % world); each rank
                           runs the tokens routed to its experts; outputs summed with the shared part.
    replicated             embeddings, head, norms, mHC, routers, Engram, drafter layers

Every rank runs the same scheduler on the same requests (SPMD): sampling draws are keyed by the
request's seed, so ranks agree on every token without talking except inside the model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kvcache.engine.layers.moe import MoE


def all_reduce_sum(group=None):
    def reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t
    return reduce


def _rows(lin: nn.Linear, lo: int, hi: int) -> None:
    lin.weight = nn.Parameter(lin.weight.data[lo:hi].clone())
    lin.out_features = hi - lo


def _cols(lin: nn.Linear, lo: int, hi: int) -> None:
    lin.weight = nn.Parameter(lin.weight.data[:, lo:hi].clone())
    lin.in_features = hi - lo


def _split_expert(expert, rank: int, world: int) -> None:
    inter = expert.w1.out_features
    if inter % world:
        raise ValueError(f"expert width {inter} does not split over {world} ranks")
    lo, hi = rank * inter // world, (rank + 1) * inter // world
    _rows(expert.w1, lo, hi)
    _rows(expert.w3, lo, hi)
    _cols(expert.w2, lo, hi)


def _shard_attention(attn, rank: int, world: int) -> None:
    H, D, G = attn.n_heads, attn.head_dim, attn.o_groups
    if H % world or G % world:
        raise ValueError(f"{H} heads in {G} output groups do not split over {world} ranks")
    h_lo, h_hi = rank * H // world, (rank + 1) * H // world
    g_lo, g_hi = rank * G // world, (rank + 1) * G // world
    o_lora = attn.wo_a.out_features // G
    _rows(attn.wq_b, h_lo * D, h_hi * D)
    attn.attn_sink = nn.Parameter(attn.attn_sink.data[h_lo:h_hi].clone())
    _rows(attn.wo_a, g_lo * o_lora, g_hi * o_lora)
    _cols(attn.wo_b, g_lo * o_lora, g_hi * o_lora)
    attn.n_heads, attn.o_groups = h_hi - h_lo, g_hi - g_lo


class _Absent(nn.Module):
    """Placeholder for a routed expert that lives on another rank (expert parallelism)."""

    def forward(self, x):   # pragma: no cover - never routed to
        raise RuntimeError("this expert lives on another rank")


def shard(model: nn.Module, rank: int, world: int, tp: bool = True, ep: bool = False, group=None) -> nn.Module:
    """Cut a fully loaded model down to this rank's part, in place; layers then all_reduce.
    Before an engine is built on it: an engine stacks the routed experts (full-width copies of
    their weights as views) and compiles for the shapes it sees; sharded after, every rank
    would sum every expert at full width and the all-reduce would multiply the MoE's output."""
    if world == 1 or not (tp or ep):
        return model
    if any(isinstance(m, MoE) and m.stacked is not None for m in model.modules()) \
            or any(blk.__dict__.get("compiled") for blk in model.layers):
        raise ValueError("shard the model before building an engine on it (LLM(model=shard(model, ...)))")
    reduce = all_reduce_sum(group)
    for blk in model.layers:
        if tp:
            _shard_attention(blk.attn, rank, world)
            blk.attn.reduce = reduce
            _split_expert(blk.ffn.shared_experts, rank, world)
        moe = blk.ffn
        if ep:
            n = len(moe.experts)
            moe.local_experts = {e for e in range(n) if e % world == rank}
            for e in range(n):
                if e not in moe.local_experts:
                    moe.experts[e] = _Absent()
            if not tp:
                moe.shared_on_this_rank = rank == 0          # replicated: count it once
        elif tp:
            for expert in moe.experts:
                _split_expert(expert, rank, world)
        moe.reduce = reduce
    return model
