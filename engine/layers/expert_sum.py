"""The routed experts' sum on the host: tokens grouped by expert, one matmul per active expert
(not per token), each token's terms added in ascending expert id whatever else is in the batch.

MoE.routed runs it between compiled phases; a decode step compiled as one graph per block calls
it as the opaque op `kvcache::routed_experts` (its inputs: the stacked weights of
layers/stacked_experts.py, linear layout), so the graph holds no data-dependent Python and the op
reads the chosen ids back on its own.

A compiled batch-1 decode graph sums its one token's experts in the graph instead
(`gathered_sum`): each projection a multiply-and-reduce over the chosen experts' rows, which
inductor fuses with the gather, so the chosen weights are read once, straight from the stacks,
with no op call, no host read of the ids and no Python (v4-small, 2 CPU cores: the 8 layers'
routed sums 0.9 ms, against 1.5 ms through the op).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    gate = F.linear(x, w1).clamp(max=limit)
    up = F.linear(x, w3).clamp(min=-limit, max=limit)
    return F.linear(F.silu(gate) * up, w2)


def grouped_sum(flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                expert: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]], limit: float,
                local: set[int] | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(flat[t]) [N, d]; `expert(e)` gives (w1, w3, w2),
    `local` the experts this rank holds (expert parallelism: the others add nothing here)."""
    rows = ids.tolist()
    if len(rows) == 1:              # one token (batch-1 decode): its pairs in ascending expert order
        acc = torch.zeros_like(flat)
        for k in sorted(range(len(rows[0])), key=rows[0].__getitem__):
            if local is None or rows[0][k] in local:
                acc = acc + swiglu(flat, *expert(rows[0][k]), limit) * weights[0, k].to(flat.dtype)
        return acc
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for t, row in enumerate(rows):
        for k, e in enumerate(row):
            tok, slot = groups.setdefault(e, ([], []))
            tok.append(t)
            slot.append(k)
    experts = [e for e in sorted(groups) if local is None or e in local]
    sizes = [len(groups[e][0]) for e in experts]
    # every expert's token and slot indices in one host-to-device copy each, then split
    toks = torch.tensor([t for e in experts for t in groups[e][0]], dtype=torch.long, device=flat.device).split(sizes)
    slots = torch.tensor([k for e in experts for k in groups[e][1]], dtype=torch.long, device=flat.device).split(sizes)
    out = torch.zeros_like(flat)
    for e, tok, slot in zip(experts, toks, slots):
        out.index_add_(0, tok, swiglu(flat[tok], *expert(e), limit) * weights[tok, slot, None].to(flat.dtype))
    return out


@torch.library.custom_op("kvcache::routed_experts", mutates_args=())
def routed_experts(flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1s: torch.Tensor,
                   w3s: torch.Tensor, w2s: torch.Tensor, limit: float) -> torch.Tensor:
    """grouped_sum over linear stacks (w1s, w3s [E, inter, d], w2s [E, d, inter])."""
    return grouped_sum(flat, weights, ids, lambda e: (w1s[e], w3s[e], w2s[e]), limit)


@routed_experts.register_fake
def _(flat, weights, ids, w1s, w3s, w2s, limit):
    return torch.empty_like(flat)


def gathered_sum(flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1s: torch.Tensor,
                 w3s: torch.Tensor, w2s: torch.Tensor, limit: float) -> torch.Tensor:
    """grouped_sum as tensor ops over linear stacks, for a compiled graph at one token (or a few:
    every (token, slot) pair reads its expert's rows, so tokens sharing an expert read it twice).
    Each token's terms in ascending expert id, like grouped_sum."""
    ids, order = ids.sort(dim=1, stable=True)
    weights = weights.gather(1, order).to(flat.dtype)
    x = flat[:, None, None, :]                                              # [N, 1, 1, d]
    gate = (x * w1s[ids]).sum(-1).clamp(max=limit)                          # [N, k, inter]
    up = (x * w3s[ids]).sum(-1).clamp(min=-limit, max=limit)
    h = (F.silu(gate) * up)[:, :, None, :]                                  # [N, k, 1, inter]
    y = (h * w2s[ids]).sum(-1)                                              # [N, k, d]
    acc = torch.zeros_like(flat)
    for j in range(ids.shape[1]):
        acc = acc + y[:, j] * weights[:, j, None]
    return acc
