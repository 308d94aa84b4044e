"""Manifold-constrained hyper-connections (mHC): the residual is `hc_mult` parallel streams.

    streams R [.., n, d] ─ flatten, unweighted RMS, @ fn^T ─> mixes (2n + n*n)
        pre  = sigmoid(mixes[:n]   * scale[0] + base[:n])   + hc_eps      collapse weights
        post = 2 * sigmoid(mixes[n:2n] * scale[1] + base[n:2n])          expand weights
        comb = softmax_rows(mixes[2n:] * scale[2] + base[2n:]) + hc_eps  then Sinkhorn:
               columns once, then (iters - 1) x (rows, columns)          ~doubly stochastic
    sublayer input x = sum_k pre_k R_k
    new streams  R'_k = post_k * out + sum_j comb[j, k] R_j              (comb^T @ R: first index summed)

Parameters per site (official names): `hc_{attn,ffn}_fn` [(2+n)n, n*d], `_base` [(2+n)n], `_scale` [3].
The head (`hc_head_fn/base/scale`, V4 only) has pre weights only: no post, no comb.
"""

from __future__ import annotations

import torch
from torch import nn

from kvcache.engine.layers.norm import rms


def hc_params(module: nn.Module, prefix: str, n: int, dim: int) -> None:
    """Register one site's parameters on `module` under their official names (`{prefix}_fn` ...)."""
    k = (2 + n) * n
    module.register_parameter(f"{prefix}_fn", nn.Parameter(torch.zeros(k, n * dim)))
    module.register_parameter(f"{prefix}_base", nn.Parameter(torch.zeros(k)))
    module.register_parameter(f"{prefix}_scale", nn.Parameter(torch.ones(3)))


def hc_head_params(module: nn.Module, n: int, dim: int) -> None:
    """Register V4's learned head (`hc_head_fn/base/scale`) on `module`: pre weights only."""
    module.hc_head_fn = nn.Parameter(torch.zeros(n, n * dim))
    module.hc_head_base = nn.Parameter(torch.zeros(n))
    module.hc_head_scale = nn.Parameter(torch.ones(1))


def hc_mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
           hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [.., n], post [.., n], comb [.., n, n]) of one site, fp32."""
    n = streams.shape[-2]
    mixes = rms(streams.flatten(-2), norm_eps) @ fn.float().t()       # [.., (2+n)n]
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb = mixes[..., 2 * n:].unflatten(-1, (n, n)) * scale[2] + base[2 * n:].view(n, n)
    comb = torch.softmax(comb, dim=-1) + hc_eps
    return pre, post, sinkhorn(comb, iters, hc_eps)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Columns once, then (iters - 1) x (rows, columns) over comb [.., n, n]. A compiled graph
    makes each normalisation a kernel of its own (~40 per site on a GPU). Traced elementwise
    (the n * n entries as separate tensors) inductor fuses all of them into one, bit-identical,
    but the graph grows ~16x and compiling a site takes ~18 s longer on 2 cores: not worth it
    until the whole decode step is one graph."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_k pre_k R_k: [.., n, d] x [.., n] -> [.., d]."""
    return (pre.unsqueeze(-1) * streams.float()).sum(-2).to(streams.dtype)


def expand(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """R'_k = post_k * out + sum_j comb[j, k] R_j."""
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), streams)


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            hc_eps: float, norm_eps: float) -> torch.Tensor:
    """V4's final collapse of the streams (before `norm`): pre weights only, no Sinkhorn."""
    mixes = rms(streams.flatten(-2), norm_eps) @ fn.float().t()
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return collapse(streams, pre)
