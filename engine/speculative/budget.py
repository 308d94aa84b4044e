"""Confidence-scheduled verification (DSpark): how many drafts each request verifies this step.

A DSpark drafter gives each draft position a confidence c_{r,j}, its estimate that token j
survives given that the ones before it did; a_{r,j} = c_{r,1} ... c_{r,j} is the chance that
position j is accepted. Verifying more tokens makes the step slower (the cost model: seconds a
step at B tokens, measured when the engine starts) and yields a_{r,j} more tokens in expectation:

    B = the step's other tokens + one anchor per verifying request     expected tokens t = R
    best = t / seconds(B)
    for (r, j) by falling a_{r,j} (a request's positions in order):
        B += 1;  t += a_{r,j}
        if t / seconds(B) <= best or B > the step's token budget: stop
        admit (r, j); best = t / seconds(B)

Stopping at the first admission that does not pay keeps the choice non-anticipating: whether
position j is verified never depends on a draw that a later position's admission would reveal
(a search over the whole jagged cost curve can pick more positions, and is not lossless here).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    """Seconds a forward step takes at a number of batch tokens: measured points, interpolated
    linearly between them and extended flat below the first and along the last slope above."""
    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.seconds) or list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError("a step cost needs increasing token counts, one time each")
        if any(s <= 0 for s in self.seconds):
            raise ValueError("a step takes a positive time")

    def at(self, tokens: int) -> float:
        ts, ss = self.tokens, self.seconds
        if tokens <= ts[0] or len(ts) == 1:
            return ss[0] if tokens <= ts[0] else ss[0] * tokens / ts[0]
        i = min(bisect.bisect_left(ts, tokens), len(ts) - 1)
        lo, hi = i - 1, i
        slope = (ss[hi] - ss[lo]) / (ts[hi] - ts[lo])
        return max(ss[lo] + slope * (tokens - ts[lo]), 1e-12)


def survival(confidences: list[float]) -> list[float]:
    """a_j = c_1 ... c_j, each clipped to [0, 1]."""
    out, a = [], 1.0
    for c in confidences:
        a *= min(max(float(c), 0.0), 1.0)
        out.append(a)
    return out


def draft_lengths(confidences: dict, cost: StepCost, other_tokens: int, token_budget: int) -> dict:
    """{request: drafts to verify} from each verifying request's confidences (Algorithm above).
    `other_tokens`: the step's prefill and plain decode tokens; a request in `confidences` counts
    its anchor even at length 0."""
    lengths = {r: 0 for r in confidences}
    batch = other_tokens + len(confidences)
    expected = float(len(confidences))
    best = expected / cost.at(batch)
    order = sorted(((a, j, r) for r, cs in confidences.items() for j, a in enumerate(survival(cs))),
                   key=lambda x: (-x[0], x[1]))
    for a, j, r in order:
        if batch + 1 > token_budget or j != lengths[r]:
            break
        rate = (expected + a) / cost.at(batch + 1)
        if rate <= best:
            break
        batch, expected, best = batch + 1, expected + a, rate
        lengths[r] = j + 1
    return lengths
