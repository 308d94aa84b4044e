"""How fast decode could possibly be on this machine: the memory-bandwidth ceiling.

A decode step reads every weight it uses at least once from memory (the models are far larger
than the CPU caches), so

    step time >= weight bytes a step touches / memory read bandwidth
    decode tokens/s <= batch / that time

Weight bytes a step touches: every parameter outside the routed experts, the embedding and the
drafter (attention, norms, hyper-connections, the shared expert, gates, the output head), the embedding
rows of the batch's tokens, and the routed experts the batch selects. With `batch` tokens each
choosing k of E experts per MoE layer, about E * (1 - (1 - k/E)^batch) distinct experts run
(uniform routing; random-weight models route close to uniformly).

Bandwidth is measured in the same run (a sum over a tensor 4x larger than the last-level cache
could be). The ceiling ignores compute and every op's overhead, so real engines stay below it;
`kvcache bench engine` reports it next to the measured rates, so a target above the ceiling
reads as impossible on this machine rather than as an engine that is slow.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from kvcache.engine.layers.moe import MoE


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 3, device: str = "cpu") -> float:
    """Bytes per second of a streaming read of `device`'s memory (best of `repeats`; on an
    accelerator 4 GiB, far past its L2 cache)."""
    if device != "cpu":
        nbytes = max(nbytes, 4 << 30)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    float(x.sum())                                  # first touch, kernel load
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        float(x.sum())                              # float(): waits for the device
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def step_weight_bytes(model: nn.Module, batch: int) -> int:
    """Estimated weight bytes one decode step of `batch` tokens reads (see the module docstring).
    The drafter (`model.mtp`: MTP / DSpark stages) is not part of a plain decode step."""
    drafter = getattr(model, "mtp", None)
    off = {id(p) for p in drafter.parameters()} if drafter is not None else set()
    moes = [m for m in model.modules() if isinstance(m, MoE) and not any(id(p) in off for p in m.parameters())]
    routed = {id(p) for m in moes for p in m.experts.parameters()}
    embed = getattr(model, "embed", None)
    skip = routed | off | ({id(p) for p in embed.parameters()} if embed is not None else set())
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    if embed is not None:
        dense += min(batch, embed.weight.shape[0]) * embed.weight.shape[1] * embed.weight.element_size()
    experts = 0.0
    for m in moes:
        e, k = len(m.experts), m.gate.top_k
        per_expert = sum(p.numel() * p.element_size() for p in m.experts[0].parameters())
        experts += e * (1 - (1 - k / e) ** batch) * per_expert
    return int(dense + experts)


def ceiling(model: nn.Module, batch: int, bandwidth: float) -> dict:
    """The decode ceiling of `model` at `batch` on a machine reading `bandwidth` bytes/s."""
    nbytes = step_weight_bytes(model, batch)
    return {"weight_bytes_per_step": nbytes, "read_bandwidth_gb_s": bandwidth / 1e9,
            "min_step_ms": nbytes / bandwidth * 1e3, "max_decode_tokens_per_s": batch * bandwidth / nbytes}
