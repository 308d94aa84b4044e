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

The experts keep their own parameters as views into the stacked tensors (no second copy).
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
        The layout decides it: stack_experts rebuilds the stacks to change it."""
        return not self.linear

    def stale(self, experts: nn.ModuleList) -> bool:
        """Whether the experts' parameters stopped being views into the stacks (the model was moved
        or cast since, which converts each parameter on its own): then the stacks are rebuilt."""
        return any(getattr(experts[e], name[:2]).weight.data_ptr() != getattr(self, name)[e].data_ptr()
                   for e in (0, len(experts) - 1) for name in ("w1s", "w3s", "w2s"))

    def forward(self, flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(flat[t]) for every token: [N, d] (transposed stacks)."""
        N, k = ids.shape
        pair_ids = ids.reshape(-1)
        order = torch.argsort(pair_ids, stable=True)                              # pairs by expert
        x = flat[order // k]
        sorted_ids = pair_ids[order]
        offs = None
        if self.grouped:
            counts = (pair_ids[:, None] == torch.arange(self.w1s.shape[0], device=ids.device)).sum(0)
            offs = counts.cumsum(0).to(torch.int32)
        gate = self._mm(x, self.w1s, offs, sorted_ids).clamp(max=self.limit)
        up = self._mm(x, self.w3s, offs, sorted_ids).clamp(min=-self.limit, max=self.limit)
        h = self._mm(F.silu(gate) * up, self.w2s, offs, sorted_ids)
        h = h * weights.reshape(-1)[order, None].to(h.dtype)
        pairs = torch.empty_like(h)
        pairs[order] = h                                                          # back to (token, slot)
        pairs = pairs.view(N, k, -1)
        slots = torch.argsort(ids, dim=1, stable=True)                            # ascending expert id
        out = pairs[torch.arange(N, device=ids.device), slots[:, 0]]
        for j in range(1, k):
            out = out + pairs[torch.arange(N, device=ids.device), slots[:, j]]
        return out

    @staticmethod
    def _mm(x: torch.Tensor, stacked: torch.Tensor, offs, sorted_ids: torch.Tensor) -> torch.Tensor:
        if offs is not None:
            return torch._grouped_mm(x, stacked, offs=offs)
        step = max(1, GATHER_BYTES // (stacked[0].numel() * stacked.element_size()))   # pairs per chunk
        return torch.cat([torch.bmm(x[s:s + step, None, :], stacked[sorted_ids[s:s + step]])[:, 0]
                          for s in range(0, x.shape[0], step)])


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


def device_experts_pay(model: nn.Module) -> bool:
    """The engine's default: off the CPU, and only where grouped matmuls exist (the gathered
    fallback reads every pair's expert weights, too much for big batches); not under expert
    parallelism."""
    from kvcache.engine.layers.moe import MoE
    moe = next((m for m in model.modules() if isinstance(m, MoE)), None)
    if moe is None or moe.local_experts is not None:
        return False
    w = moe.experts[0].w1.weight
    return w.device.type != "cpu" and grouped_mm_works(w.dtype, w.device, w.shape[1], w.shape[0])


def stack_experts(model: nn.Module, on_device: bool = True) -> int:
    """Stack the experts of every MoE of `model` (their parameters become views: no second copy);
    `on_device`: routed sums by the stacks' tensor ops (`StackedExperts.forward`, transposed
    stacks), else by the host path, which a decode graph reaches through the
    `kvcache::routed_experts` op with the (linear) stacks as its inputs, or at one token sums in
    the graph (kernels/routed_experts.py). Returns how many MoEs. Under expert parallelism
    (a rank holds some experts only) nothing is stacked, and on_device is refused."""
    from kvcache.engine.layers.moe import MoE
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if any(m.local_experts is not None for m in moes):
        if on_device:
            raise ValueError("stacked experts do not support expert parallelism")
        return 0
    for m in moes:
        if m.stacked is None or m.stacked.stale(m.experts) or m.stacked.on_device != on_device:
            m.stacked = StackedExperts(m.experts, linear=not on_device)
    return len(moes)
