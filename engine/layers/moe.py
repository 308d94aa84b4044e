"""DeepSeekMoE: routed experts chosen per token, one always-on shared expert.

    scores  = score_fn(x @ gate.weight^T)                       (fp32; sqrtsoftplus = sqrt(softplus))
    experts = top-k of (scores + gate.bias)                     bias: selection only (noaux_tc)
            | gate.tid2eid[token id]                            hash layers: a frozen table
    weights = scores[experts] / sum(...)  * routed_scaling_factor
    expert(x) = w2( silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit) )
    out = sum_k weights_k expert_k(x) + shared(x)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.engine.config import ModelConfig


class Expert(nn.Module):
    """A clamped SwiGLU: w1 gate, w3 up, w2 down (official names)."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


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

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.gate(flat, token_ids)
        out = torch.zeros_like(flat)
        # group tokens by expert: one matmul per active expert, not per (token, expert)
        for e in torch.unique(ids).tolist():
            if self.local_experts is not None and e not in self.local_experts:
                continue
            tok, slot = torch.where(ids == e)
            y = self.experts[e](flat[tok]) * weights[tok, slot, None].to(flat.dtype)
            out.index_add_(0, tok, y)
        if self.shared_on_this_rank:
            out = out + self.shared_experts(flat)
        if self.reduce is not None:
            out = self.reduce(out)
        return out.reshape(shape)
