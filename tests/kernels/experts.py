"""Random routed-expert problems for the kernel tests: expert weights in both stack layouts and
routings that exercise the edge cases (no token, one token, experts no token chose, uneven
groups where most pairs go to a few experts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LIMIT = 2.0


@dataclass
class Experts:
    """E experts' weights in nn.Linear's (linear) layout: w1, w3 [E, inter, d], w2 [E, d, inter]."""
    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.w1[e], self.w3[e], self.w2[e]

    def transposed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The device layout: w1s, w3s [E, d, inter], w2s [E, inter, d] (contiguous)."""
        return tuple(w.transpose(1, 2).contiguous() for w in (self.w1, self.w3, self.w2))


def experts(n_experts: int, d: int, inter: int, g: torch.Generator, dtype=torch.float32) -> Experts:
    # scaled so that some gate values pass the clamp at LIMIT and some do not
    w1, w3 = (torch.randn(n_experts, inter, d, generator=g) / d ** 0.25 for _ in range(2))
    w2 = torch.randn(n_experts, d, inter, generator=g) / inter ** 0.5
    return Experts(w1.to(dtype), w3.to(dtype), w2.to(dtype))


def routing(n: int, k: int, n_experts: int, g: torch.Generator, uneven: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [n, k] fp32, ids [n, k] distinct per token, like a gate's top-k). `uneven`: the
    pairs crowd onto the low experts and the last expert is never chosen."""
    p = torch.ones(n_experts)
    if uneven:
        p = 4.0 ** -torch.arange(n_experts, dtype=torch.float64)
        p[-1] = 0
    ids = (torch.stack([torch.multinomial(p, k, generator=g) for _ in range(n)]) if n
           else torch.zeros(0, k, dtype=torch.long))
    return torch.rand(n, k, generator=g), ids


# (tokens, slots per token, uneven): one token, no token, k = 1, k = 6, crowded experts
CASES = [(1, 2, False), (1, 6, False), (0, 2, False), (9, 2, False), (5, 6, False), (3, 1, False),
         (17, 3, True), (2, 2, True), (33, 4, True)]
