"""Deterministic random weights for demo checkpoints and tests (`kvcache model init`).

Same seed, same config -> the same bytes on every machine: one torch.Generator walks the
parameters in name order. Scales keep every path alive at small widths: linears ~ 1/sqrt(fan-in),
norm weights near 1, small mHC projections, spread-out sinks and biases, hash tables that are a
random choice of distinct experts per token.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def random_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        elif name.endswith("_scale"):
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        elif name.endswith("_fn"):
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
        elif p.dim() == 2 and name.endswith("weight"):
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
        else:
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
    n_experts = getattr(getattr(model, "config", None), "n_routed_experts", 0)
    for name, b in sorted(model.named_buffers()):
        if name.endswith("tid2eid"):
            b.copy_(torch.stack([torch.randperm(n_experts, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]))
    return model
