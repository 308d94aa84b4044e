"""Routed experts summed on the device, with no host round trip (accelerators).

The host path (MoE.routed) reads the chosen expert ids back (`ids.tolist()`: a device sync per
layer) and runs one matmul per active expert from Python. On a GPU at small batches that is
launch- and sync-bound. Here the experts' weights sit in three stacked tensors and the whole
routed sum is a handful of tensor ops that a compiled block fuses:

    pairs (token t, slot j) = N * k, sorted by expert id        argsort, counts per expert (no sync)
    h = x[pair's token] @ W1s[e], W3s[e] -> clamped SwiGLU -> @ W2s[e]
          one grouped matmul per projection (torch._grouped_mm), or where the device has none,
          batched matmuls over the pairs' gathered weights, GATHER_BYTES at a time
    y[t] = sum over t's slots in ascending expert id of weight * h   (the host path's order)

`stacked_sum` is the fast path, `stacked_sum_reference` the same sum one pair at a time
(tests/kernels/test_grouped_matmul.py compares them). `StackedExperts` holds the stacks for a
MoE (engine/layers/moe.py:stack_experts builds them); the experts keep their own parameters as
views into the stacked tensors (no second copy). The linear layout is what the host kernels of
routed_experts.py read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GATHER_BYTES = 256 << 20      # without grouped matmuls: weights gathered per chunk of pairs, at most this much


class StackedExperts(nn.Module):
    """The routed experts' weights in three stacked tensors, in one of two layouts:

        transposed (device sums)  w1s, w3s [E, d, inter], w2s [E, inter, d]   x @ W, grouped matmuls
        linear     (host sums)    w1s, w3s [E, inter, d], w2s [E, d, inter]   nn.Linear's, rows contiguous

    The host path's matmuls and a one-token decode graph's gathered sums (kernels/routed_experts.py)
    read rows along the contiguous input dim: a compiled batch-1 sum over the transposed stacks
    ran at ~60% of the speed it reaches on these (v4-small, 2 CPU cores)."""

    def __init__(self, experts: nn.ModuleList, linear: bool = False):
        super().__init__()
        w = experts[0].w1.weight
        inter, d = w.shape
        self.limit = experts[0].limit
        self.linear = linear
        for name in ("w1s", "w3s", "w2s"):
            lin0 = getattr(experts[0], name[:2]).weight
            shape = tuple(lin0.shape) if linear else tuple(lin0.shape[::-1])
            stacked = torch.empty((len(experts),) + shape, dtype=w.dtype, device=w.device)
            for e, ex in enumerate(experts):
                lin = getattr(ex, name[:2])
                stacked[e].copy_(lin.weight.detach() if linear else lin.weight.detach().t())
                view = stacked[e] if linear else stacked[e].t()
                lin.weight = nn.Parameter(view, requires_grad=False)    # a view: one copy in memory
            self.register_buffer(name, stacked, persistent=False)
        self.grouped = grouped_mm_works(w.dtype, w.device, d, inter)

    @property
    def on_device(self) -> bool:
        """Routed sums by forward() (transposed stacks); False: by the host path (linear stacks).
        The layout decides it: stack_experts (engine/layers/moe.py) rebuilds the stacks to change it."""
        return not self.linear

    def stale(self, experts: nn.ModuleList) -> bool:
        """Whether the experts' parameters stopped being views into the stacks (the model was moved
        or cast since, which converts each parameter on its own): then the stacks are rebuilt."""
        return any(getattr(experts[e], name[:2]).weight.data_ptr() != getattr(self, name)[e].data_ptr()
                   for e in (0, len(experts) - 1) for name in ("w1s", "w3s", "w2s"))

    def forward(self, flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(flat[t]) for every token: [N, d] (transposed stacks)."""
        return stacked_sum(flat, weights, ids, self.w1s, self.w3s, self.w2s, self.limit, self.grouped)


def stacked_sum(flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1s: torch.Tensor,
                w3s: torch.Tensor, w2s: torch.Tensor, limit: float, grouped: bool) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(flat[t]) [N, d] over transposed stacks (w1s, w3s
    [E, d, inter], w2s [E, inter, d]), N >= 1: tensor ops only, no read-back of the ids.
    `grouped`: one torch._grouped_mm per projection (see grouped_mm_works), else batched matmuls
    over the pairs' gathered weights. `stacked_sum_reference` is what it computes."""
    N, k = ids.shape
    pair_ids = ids.reshape(-1)
    order = torch.argsort(pair_ids, stable=True)                              # pairs by expert
    x = flat[order // k]
    sorted_ids = pair_ids[order]
    offs = None
    if grouped:
        counts = (pair_ids[:, None] == torch.arange(w1s.shape[0], device=ids.device)).sum(0)
        offs = counts.cumsum(0).to(torch.int32)
    gate = _mm(x, w1s, offs, sorted_ids).clamp(max=limit)
    up = _mm(x, w3s, offs, sorted_ids).clamp(min=-limit, max=limit)
    h = _mm(F.silu(gate) * up, w2s, offs, sorted_ids)
    h = h * weights.reshape(-1)[order, None].to(h.dtype)
    pairs = torch.empty_like(h)
    pairs[order] = h                                                          # back to (token, slot)
    pairs = pairs.view(N, k, -1)
    slots = torch.argsort(ids, dim=1, stable=True)                            # ascending expert id
    out = pairs[torch.arange(N, device=ids.device), slots[:, 0]]
    for j in range(1, k):
        out = out + pairs[torch.arange(N, device=ids.device), slots[:, j]]
    return out


def _mm(x: torch.Tensor, stacked: torch.Tensor, offs, sorted_ids: torch.Tensor) -> torch.Tensor:
    """x's rows (pairs sorted by expert) times their experts' matrices: grouped by `offs` (the
    experts' end rows), else gathered GATHER_BYTES of weights at a time."""
    if offs is not None:
        return torch._grouped_mm(x, stacked, offs=offs)
    step = max(1, GATHER_BYTES // (stacked[0].numel() * stacked.element_size()))   # pairs per chunk
    return torch.cat([torch.bmm(x[s:s + step, None, :], stacked[sorted_ids[s:s + step]])[:, 0]
                      for s in range(0, x.shape[0], step)])


def stacked_sum_reference(flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1s: torch.Tensor,
                          w3s: torch.Tensor, w2s: torch.Tensor, limit: float) -> torch.Tensor:
    """What stacked_sum computes, one (token, slot) pair at a time (slow, for tests): each
    token's terms in ascending expert id."""
    out = torch.zeros_like(flat)
    for t in range(ids.shape[0]):
        for j in sorted(range(ids.shape[1]), key=lambda j: int(ids[t, j])):
            e, x = int(ids[t, j]), flat[t]
            h = F.silu((x @ w1s[e]).clamp(max=limit)) * (x @ w3s[e]).clamp(min=-limit, max=limit)
            out[t] += (h @ w2s[e]) * weights[t, j].to(flat.dtype)
    return out


def grouped_mm_works(dtype: torch.dtype, device, dim: int, inter: int) -> bool:
    """Whether torch._grouped_mm runs for this device, dtype and shape (and agrees with plain
    matmuls): recent PyTorch has it for bf16 (its shape function, which torch.compile traces with,
    refuses other dtypes) on CPU and Hopper-class GPUs, not everywhere."""
    if not hasattr(torch, "_grouped_mm") or dtype != torch.bfloat16:
        return False
    try:
        w = torch.linspace(-1, 1, 2 * dim * inter, device=device).view(2, dim, inter).to(dtype)
        x = torch.ones((3, dim), dtype=dtype, device=device)
        got = torch._grouped_mm(x, w, offs=torch.tensor([1, 3], dtype=torch.int32, device=device))
        want = torch.cat([x[:1] @ w[0], x[1:] @ w[1]])
        return bool(torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
