"""Rotary position embedding, DeepSeek-V4 style.

    head dims:  [ nope ............................ | rope (last qk_rope_head_dim) ]
    rope pairs: (0,1) (2,3) ... interleaved ("GPT-J"), one frequency per pair

Two tables: "main" (rope_theta, plain) for sliding-window-only layers, and "compress"
(compress_rope_theta, YaRN when configured, no mscale) for every tensor of a compressed layer.
Attention outputs are rotated back by the query position (`inverse=True`), so that with K = V
each key's contribution depends on the relative distance only.
"""

from __future__ import annotations

import math

import torch

from kvcache.engine.model_config import ModelConfig, YarnConfig


def inv_freq(dim: int, theta: float, yarn: YarnConfig | None) -> torch.Tensor:
    """One inverse frequency per rotary pair (dim // 2 of them), in fp32."""
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    if yarn is None or yarn.factor <= 1.0 or yarn.original_max_position_embeddings <= 0:
        return base

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    # ramp 0: high frequencies kept (extrapolate); ramp 1: low frequencies divided by the factor
    return base / yarn.factor * ramp + base * (1 - ramp)


class RotaryTables:
    """cos/sin for positions, for the "main" and "compress" tables of one model."""

    def __init__(self, config: ModelConfig):
        r = config.qk_rope_head_dim
        self.dim = r
        self.freqs = {"main": inv_freq(r, config.rope_theta, None),
                      "compress": inv_freq(r, config.compress_rope_theta, config.yarn)}
        self._on: dict[tuple[str, torch.device], torch.Tensor] = {}    # the tables copied to each device once

    def cos_sin(self, positions: torch.Tensor, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., dim // 2] (fp32)."""
        f = positions.to(torch.float32)[..., None] * self._freqs(table, positions.device)
        return f.cos(), f.sin()

    def _freqs(self, table: str, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self.freqs[table]
        key = (table, device)
        if key not in self._on:
            self._on[key] = self.freqs[table].to(device)
        return self._on[key]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing rope dims of x [..., D]; cos/sin broadcast against x[..., :D_rope // 2].

    cos/sin must already be shaped to broadcast over x's leading axes (e.g. [B, T, 1, r/2] for
    x [B, T, H, D])."""
    r = cos.shape[-1] * 2
    nope, rope = x[..., :-r], x[..., -r:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    s = -sin if inverse else sin
    out = torch.stack((even * cos - odd * s, odd * cos + even * s), dim=-1).flatten(-2)
    return torch.cat([nope, out.to(x.dtype)], dim=-1)
