"""DeepSeekMoE: routed experts chosen per token, one always-on shared expert.

    scores  = score_fn(x @ gate.weight^T)                       (fp32; sqrtsoftplus = sqrt(softplus))
    experts = top-k of (scores + gate.bias)                     bias: selection only (noaux_tc)
            | gate.tid2eid[token id]                            hash layers: a frozen table
    weights = scores[experts] / sum(...)  * routed_scaling_factor
    expert(x) = w2( silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit) )
    out = sum_k weights_k expert_k(x) + shared(x)

The routed sums are kernels (kvcache.kernels: routed_experts on the host, grouped_matmul on
the device); `stack_experts` gives a model's MoEs the stacked weights those read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.engine.model_config import ModelConfig
from kvcache.kernels.grouped_matmul import StackedExperts, grouped_mm_works
from kvcache.kernels.routed_experts import gathered_sum, grouped_sum, swiglu

SMALL_TOKENS = 1          # up to this many tokens: experts summed pair by pair (see MoE.routed)


@dataclass
class Routed:
    """Routed experts of a batch: their output [N, d], or (pairs mode) each token's slots in
    ascending expert order [N, k] and the pairs' (w1, w3, w2) weights, token-major, or
    (stacked experts) the expert ids [N, k], summed on the device by `sum_pairs`."""
    out: torch.Tensor | None
    order: torch.Tensor | None
    weights: list[torch.Tensor]
    ids: torch.Tensor | None = None


class Expert(nn.Module):
    """A clamped SwiGLU: w1 gate, w3 up, w2 down (official names)."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.w1.weight, self.w3.weight, self.w2.weight, self.limit)


def _score(logits: torch.Tensor, fn: str) -> torch.Tensor:
    if fn == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if fn == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


class Gate(nn.Module):
    """`ffn.gate.{weight, bias | tid2eid}`; V4.1 adds `bias_vl`, the selection bias of image tokens."""

    def __init__(self, config: ModelConfig, hashed: bool, n_experts: int, top_k: int):
        super().__init__()
        self.top_k, self.score_fn = top_k, config.scoring_func
        self.scale, self.normalise = config.routed_scaling_factor, config.norm_topk_prob
        self.hashed = hashed
        self.image_token = config.image_token_id if config.is_v41 else None
        self.weight = nn.Parameter(torch.zeros(n_experts, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.zeros(n_experts))
            if config.is_v41:
                self.bias_vl = nn.Parameter(torch.zeros(n_experts))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> (weights [N, k] fp32, expert ids [N, k])."""
        scores = _score(F.linear(x.float(), self.weight.float()), self.score_fn)
        if self.hashed:
            if token_ids is None:
                raise ValueError("hash-routed MoE layers need the token ids")
            ids = self.tid2eid[token_ids.reshape(-1)].long()
        else:
            bias = self.bias.float()
            if self.image_token is not None and token_ids is not None:
                is_image = (token_ids.reshape(-1) == self.image_token)[:, None]
                bias = torch.where(is_image, self.bias_vl.float(), bias)
            ids = torch.topk(scores + bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.normalise:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, hashed: bool, n_experts: int | None = None, top_k: int | None = None):
        super().__init__()
        n = n_experts or config.n_routed_experts
        dim, inter, limit = config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        self.gate = Gate(config, hashed, n, top_k or config.num_experts_per_tok)
        self.experts = nn.ModuleList(Expert(dim, inter, limit) for _ in range(n))
        self.shared_experts = Expert(dim, inter * config.n_shared_experts, limit)
        self.local_experts: set[int] | None = None   # expert parallelism: the experts on this rank
        self.shared_on_this_rank = True
        self.reduce = None                           # sums the ranks' partial outputs (engine/parallel.py)
        self.stacked = None                          # StackedExperts (kernels/grouped_matmul.py)
        self.limit = limit

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(flat, token_ids)
        routed = self.sum_pairs(flat, weights, self.routed(flat, weights, ids))
        return self.combine(routed, self.shared(flat)).reshape(x.shape)

    def shared(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The always-on expert's output [N, d] (None on EP ranks that do not hold it)."""
        return self.shared_experts(flat) if self.shared_on_this_rank else None

    def routed(self, flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> Routed:
        """What sum_k weights_k expert_k(x) needs. One token (a batch-1 decode step): its experts'
        weights, summed later by `sum_pairs` (pure, so a compiled layer fuses it; one token so
        that no weight is passed twice, which a compiled graph would have to guard on). More:
        computed here, tokens grouped by expert, one matmul per active expert (not per token).
        Either way each token adds its terms in ascending expert order, whatever else is in the
        batch. Data-dependent: this part stays eager. With stacked experts: nothing here, the
        device sums them (no host round trip)."""
        if self.stacked is not None and self.stacked.on_device:
            return Routed(None, None, [], ids)
        rows = ids.tolist()
        if self.local_experts is None and len(rows) <= SMALL_TOKENS:
            order = [sorted(range(len(row)), key=row.__getitem__) for row in rows]
            ws = [w for row, o in zip(rows, order) for k in o
                  for w in (self.experts[row[k]].w1.weight, self.experts[row[k]].w3.weight,
                            self.experts[row[k]].w2.weight)]
            return Routed(None, torch.tensor(order, device=flat.device), ws)
        out = grouped_sum(flat, weights, ids, lambda e: (self.experts[e].w1.weight, self.experts[e].w3.weight,
                                                         self.experts[e].w2.weight), self.limit,
                          self.local_experts)
        return Routed(out, None, [])

    def sum_pairs(self, flat: torch.Tensor, weights: torch.Tensor, routed: Routed) -> torch.Tensor:
        """The routed sum [N, d] of `routed` (its output, or its pairs' experts summed here)."""
        if routed.out is not None:
            return routed.out
        if routed.ids is not None:
            return self.stacked(flat, weights, routed.ids)
        weights = weights.gather(1, routed.order).to(flat.dtype)
        k, ws, limit = weights.shape[1], routed.weights, self.limit
        rows = []
        for t in range(len(ws) // (3 * k)):
            acc = torch.zeros_like(flat[t:t + 1])
            for j in range(k):
                w1, w3, w2 = ws[3 * (t * k + j): 3 * (t * k + j) + 3]
                acc = acc + swiglu(flat[t:t + 1], w1, w3, w2, limit) * weights[t, j]
            rows.append(acc)
        return torch.cat(rows)

    def routed_sum(self, flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_k weights_k expert_k(x) [N, d] with no Python between the gate and the sum (a decode
        graph): the stacks' tensor ops, or the host path as one opaque op (needs stack_experts)."""
        s = self.stacked
        if s.on_device:
            return s(flat, weights, ids)
        if flat.shape[0] == 1 and torch.compiler.is_compiling():        # a batch-1 decode graph
            return gathered_sum(flat, weights, ids, s.w1s, s.w3s, s.w2s, s.limit)
        return torch.ops.kvcache.routed_experts(flat, weights, ids, s.w1s, s.w3s, s.w2s, s.limit)

    def combine(self, routed: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        """routed + shared, summed over the ranks under expert/tensor parallelism."""
        out = routed if shared is None else routed + shared
        return out if self.reduce is None else self.reduce(out)


def device_experts_pay(model: nn.Module) -> bool:
    """The engine's default: off the CPU, and only where grouped matmuls exist (the gathered
    fallback reads every pair's expert weights, too much for big batches); not under expert
    parallelism."""
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
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if any(m.local_experts is not None for m in moes):
        if on_device:
            raise ValueError("stacked experts do not support expert parallelism")
        return 0
    for m in moes:
        if m.stacked is None or m.stacked.stale(m.experts) or m.stacked.on_device != on_device:
            m.stacked = StackedExperts(m.experts, linear=not on_device)
    return len(moes)
