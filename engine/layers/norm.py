"""RMS norms. Weighted (`RMSNorm`: attn_norm, q_norm, kv_norm, ...) and unweighted (mHC
input, V4's per-head q norm). Computed in fp32, cast back to the input dtype once."""

from __future__ import annotations

import torch
from torch import nn


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last axis, in fp32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight.float() * rms(x, self.eps)).to(x.dtype)
