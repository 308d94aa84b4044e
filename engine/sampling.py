"""Sampling: turn one row of logits into the next token, reproducibly.

    logits ─ logit_bias ─ repetition / presence / frequency penalties (over prompt + output)
           ─ greedy?  argmax
           ─ / temperature ─ softmax ─ top-k ─ top-p ─ min-p ─ renormalise
           ─ inverse CDF at u = uniform(seed, absolute position, stream)

The random number is a pure function of (request seed, the position the token will take,
stream = index among the request's n samples): hashing those three integers, not a shared
generator, so a seeded request gets the same tokens whatever else runs in the batch, and after
a preemption that recomputes it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass, field

import torch
import xxhash

from kvcache.engine.structured.constraint import Constraint


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0             # 0: greedy
    top_k: int = 0                       # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0      # > 1 discourages tokens already seen (prompt or output)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)     # token id -> added logit
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()           # stop strings (need a tokenizer)
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None              # None: the engine draws one per request (draw_seed)
    constraint: Constraint | None = None  # what the output must match (engine/structured): masked token by token

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"invalid sampling parameter: {what}")
        for name in ("max_tokens", "top_k", "n"):
            need(_is_int(getattr(self, name)), f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            need(_is_real(v), f"{name} must be a finite number, got {v!r}")
        need(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        need(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        need(self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p}")
        need(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        need(-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2,
             "presence_penalty and frequency_penalty must be in [-2, 2]")
        need(self.n >= 1, f"n must be >= 1, got {self.n}")
        need(self.constraint is None or isinstance(self.constraint, Constraint),
             "constraint must be an engine.structured Constraint (Constraint.json(schema), .regex(...), ...)")
        need(all(_is_int(k) for k in self.logit_bias), "logit_bias keys must be token ids (int)")
        need(all(_is_real(v) for v in self.logit_bias.values()), "logit_bias values must be finite numbers")
        # one stop string or id alone is that one, not its characters (tuple("###") is 3 stops)
        object.__setattr__(self, "stop_token_ids", (self.stop_token_ids,) if _is_int(self.stop_token_ids)
                           else tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        need(all(_is_int(t) for t in self.stop_token_ids), "stop_token_ids must be token ids (int)")
        need(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        need(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 1 << 64),
             f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        for name in ("max_tokens", "top_k", "n", "seed"):        # numpy ints -> int (seed.to_bytes)
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))

    def with_seed(self) -> "SamplingParams":
        """These parameters with a seed: their own, or a fresh one (one per request, so requests
        that share a params object without a seed do not share their draws)."""
        return self if self.seed is not None else dataclasses.replace(self, seed=draw_seed())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t in (*self.stop_token_ids, *self.logit_bias) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"invalid sampling parameter: token id {bad[0]} is outside the vocabulary "
                             f"(0..{vocab_size - 1})")


def draw_seed() -> int:
    """A fresh random seed (63 bits, from os.urandom)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def _is_int(v) -> bool:           # numpy integers too; not bools (True is not a token count)
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def uniform(seed: int, position: int, stream: int) -> float:
    """A uniform draw in [0, 1) that depends only on (seed, position, stream)."""
    if seed is None:
        raise ValueError("sampling needs a seed: give the engine the request's params.with_seed()")
    h = xxhash.xxh3_64_intdigest(seed.to_bytes(8, "little", signed=False) + position.to_bytes(8, "little")
                                 + stream.to_bytes(4, "little"))
    return (h >> 11) * (1.0 / (1 << 53))


def apply_penalties(logits: torch.Tensor, p: SamplingParams, seen: list[int], generated: list[int]) -> torch.Tensor:
    logits = logits.float().clone()
    for tok, b in p.logit_bias.items():
        logits[tok] += b
    if p.repetition_penalty != 1.0 and seen:
        ids = torch.tensor(sorted(set(seen)), device=logits.device)
        vals = logits[ids]
        logits[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and generated:
        ids, counts = torch.unique(torch.tensor(generated, device=logits.device), return_counts=True)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts.float()
    return logits


def sample(logits: torch.Tensor, p: SamplingParams, position: int, stream: int, seen: list[int],
           generated: list[int]) -> int:
    """The next token for one sequence: logits [V] for the token that will sit at `position`."""
    logits = checked(apply_penalties(logits, p, seen, generated), position)
    if p.greedy:
        return int(torch.argmax(logits))
    kept = truncated(logits, p)
    if kept is None:
        return int(torch.argmax(logits))
    order, sorted_p = kept
    cdf = torch.cumsum(sorted_p, 0) / sorted_p.sum()
    u = uniform(p.seed, position, stream)
    idx = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64, device=cdf.device), right=True)[0])
    return int(order[min(idx, len(order) - 1)])


def checked(logits: torch.Tensor, position: int) -> torch.Tensor:
    if bool(torch.isnan(logits).any()):            # argmax takes NaN for the largest: never a token
        raise FloatingPointError(f"the model produced {int(torch.isnan(logits).sum())} NaN logits at position "
                                 f"{position}: its weights or activations are broken (this request fails)")
    return logits


def truncated(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(token ids by falling probability, their kept mass in fp64: temperature, top-k, top-p and
    min-p applied, not renormalised) of penalised logits [V]; None where the temperature is so small
    that the scaled logits overflow (its limit is greedy)."""
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        return None
    order = torch.argsort(probs, descending=True, stable=True)
    sorted_p = probs[order]
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if p.top_k:
        keep[p.top_k:] = False
    if p.top_p < 1.0:
        before = torch.cumsum(sorted_p, 0) - sorted_p          # mass of the better tokens
        keep &= before < p.top_p
    if p.min_p > 0:
        keep &= sorted_p >= p.min_p * sorted_p[0]
    keep[0] = True
    return order, torch.where(keep, sorted_p, torch.zeros_like(sorted_p)).double()


def distribution(logits: torch.Tensor, p: SamplingParams, position: int, seen: list[int],
                 generated: list[int]) -> torch.Tensor:
    """The distribution `sample` draws from, as probabilities [V] (fp64, vocabulary order): one-hot
    at the argmax when greedy. What speculative verification compares drafts against."""
    logits = checked(apply_penalties(logits, p, seen, generated), position)
    out = torch.zeros(logits.shape[-1], dtype=torch.float64, device=logits.device)
    kept = None if p.greedy else truncated(logits, p)
    if kept is None:
        out[int(torch.argmax(logits))] = 1.0
        return out
    order, sorted_p = kept
    out[order] = sorted_p / sorted_p.sum()
    return out
