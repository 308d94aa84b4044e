"""Verification of one request's draft against the target's logits: lossless, token-wise.

    target forward over [x0, d1 .. dk]  (x0: the last committed token, d_i: the drafts)
        logits row i  ─ penalties (over the prompt, the output and d1 .. d_i) ─ the sampler's
                        truncation (temperature, top-k/p, min-p) ─> p_i, the distribution the
                        plain sampler would draw token i+1 from
    for i = 1 .. k:
        greedy:   accept d_i iff d_i = argmax p_{i-1};      else emit that argmax, stop
        sampled:  accept d_i iff u_i * q(d_i) < p(d_i)      (u_i ~ U[0,1), q: the drafter's
                  distribution at i; a draft without one is one-hot, q(d_i) = 1)
                  else emit a token drawn from max(p - q, 0), renormalised (p where it is ~0), stop
    all k accepted: emit the bonus, drawn from p_k by the plain sampler

The output has the distribution of plain sampling, token for token (Leviathan et al. 2023). Each
random number is a pure function of (request seed, absolute position, stream), and each use has
its own stream: the acceptance draw, the recovery draw and the drafter's own draws never share a
number, nor with the plain sampler's (a recovery that reused the number that chose the draft
would bias the output toward the drafter, visibly only in a distribution test). A request with no
draft uses only the plain sampler's number: its output is that of plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.engine.sampling import SamplingParams, distribution, sample, uniform

# stream ids: the plain sampler uses the sample's index (n > 1) alone; these kinds sit above it
ACCEPT, RECOVER, DRAFT = 1 << 28, 2 << 28, 3 << 28


@dataclass(frozen=True)
class Draft:
    """What a drafter proposes for one request: tokens d1 .. dk and, for drafts it sampled, the
    distribution q [k, V] it sampled each from (after the same truncation as the target's)."""
    tokens: tuple[int, ...]
    probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.tokens):
            raise ValueError(f"a draft of {len(self.tokens)} tokens came with {self.probs.shape[0]} distributions")


@dataclass(frozen=True)
class Verdict:
    """accepted: how many drafts survived; tokens: those, then one token of the target's own (the
    recovered token at the first rejection, or the bonus)."""
    accepted: int
    tokens: tuple[int, ...]


def verify(logits: torch.Tensor, draft: Draft, p: SamplingParams, position: int, stream: int,
           seen: list[int], generated: list[int]) -> Verdict:
    """logits [k + 1, V]: row i is the target's for the token at `position` + i (row 0 follows x0).
    `seen` / `generated`: the prompt + output and the output so far, for the penalties."""
    k = len(draft.tokens)
    if logits.shape[0] != k + 1:
        raise ValueError(f"verifying {k} drafts needs {k + 1} rows of logits, got {logits.shape[0]}")
    seen, generated = list(seen), list(generated)
    for i, tok in enumerate(draft.tokens):
        pos = position + i
        probs = distribution(logits[i], p, pos, seen, generated)
        if not accepted(probs, draft, i, p, pos, stream):
            return Verdict(i, (*draft.tokens[:i], recovered(probs, draft, i, p, pos, stream)))
        seen.append(tok)
        generated.append(tok)
    bonus = sample(logits[k], p, position + k, stream, seen, generated)
    return Verdict(k, (*draft.tokens, bonus))


def accepted(probs: torch.Tensor, draft: Draft, i: int, p: SamplingParams, pos: int, stream: int) -> bool:
    tok = draft.tokens[i]
    if p.greedy:
        return bool(probs[tok] == 1.0)                       # one-hot at the target's argmax
    q = 1.0 if draft.probs is None else float(draft.probs[i, tok])
    if q <= 0.0:                                             # the drafter could not have drawn it
        return False
    return uniform(p.seed, pos, ACCEPT | stream) * q < float(probs[tok])


def residual(probs: torch.Tensor, draft: Draft, i: int) -> torch.Tensor:
    """max(p - q, 0): where the target wants more mass than the drafter gave (unnormalised)."""
    q = torch.zeros_like(probs)
    if draft.probs is None:
        q[draft.tokens[i]] = 1.0
    else:
        q = draft.probs[i].to(probs)
    return torch.clamp(probs - q, min=0.0)


def recovered(probs: torch.Tensor, draft: Draft, i: int, p: SamplingParams, pos: int, stream: int) -> int:
    """The target's token at a rejection: its argmax when greedy, else a draw from the residual."""
    if p.greedy:
        return int(torch.argmax(probs))
    r = residual(probs, draft, i)
    total = float(r.sum())
    if total <= 1e-12:                   # p <= q everywhere but a rejection happened: rounding; draw from p
        r, total = probs, float(probs.sum())
    cdf = torch.cumsum(r, 0) / total
    u = torch.tensor([uniform(p.seed, pos, RECOVER | stream)], dtype=torch.float64, device=cdf.device)
    idx = int(torch.searchsorted(cdf, u, right=True)[0])
    idx = min(idx, len(cdf) - 1)
    while float(r[idx]) <= 0.0 and idx > 0:      # a zero-mass token at the CDF's flat edge: never drawn
        idx -= 1
    return idx


def draft_token(logits: torch.Tensor, p: SamplingParams, pos: int, stream: int, seen: list[int],
                generated: list[int]) -> tuple[int, torch.Tensor]:
    """A drafter's token at `pos` from its logits [V], and the distribution q it came from (the
    target's truncation; one-hot when greedy), on the drafter's own stream."""
    q = distribution(logits, p, pos, seen, generated)
    if p.greedy:
        return int(torch.argmax(q)), q
    cdf = torch.cumsum(q, 0)
    u = torch.tensor([uniform(p.seed, pos, DRAFT | stream)], dtype=torch.float64, device=cdf.device)
    idx = min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)[0]), len(cdf) - 1)
    while float(q[idx]) <= 0.0 and idx > 0:
        idx -= 1
    return idx, q
