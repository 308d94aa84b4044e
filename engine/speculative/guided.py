"""Drafts under a constraint (engine/structured): drawn from the grammar's allowed tokens and
verified against the target's masked rows, the matcher rolled back past rejected drafts.

    propose   at each draft position: the grammar's mask on the drafter's logits, then the draw
              (so q is the masked, renormalised distribution: every draft is valid and the
              verification stays lossless); the draft is committed to the guide tentatively,
              and all of them are taken back once the proposal is made
    verify    row 0: the guide as it is; row i: after committing d1 .. di tentatively (the same
              masks the plain sampler would apply at those positions); the grammar complete at
              d_i: the drafts stop there (what follows is cut, never verified)
    after     guide.rollback(rejected drafts), then the target's own token committed

Cutting drafts *after* a drafted prefix is a stopping rule and lossless; dropping a drafted
token because of its own value would not be (its position would then draw from p, not the
residual), which is why the drafter's distribution is masked instead.
"""

from __future__ import annotations

import torch

from kvcache.engine.structured import masks


def masked(guide, logits: torch.Tensor) -> torch.Tensor:
    """`logits` with what the guide's grammar forbids now at -inf (a copy; as is while thinking)."""
    if not guide.active:
        return logits
    mask = masks.allocate(1, logits.shape[-1])
    guide.matcher.fill(mask, 0)
    return masks.apply(logits.clone(), mask[0])


def row_masks(guide, rows: torch.Tensor, drafts: list[int]) -> tuple[torch.Tensor, int]:
    """(rows [k+1, V] masked as the plain sampler would mask them after each draft prefix, how
    many drafts stay: fewer when the grammar completes or refuses within them). The kept drafts
    stay committed to the guide: the caller rolls back those it rejects."""
    out = rows.clone()
    kept = 0
    for i in range(len(drafts) + 1):
        out[i] = masked(guide, out[i])
        if i == len(drafts) or guide.done:
            break
        if not guide.accepts(drafts[i]):              # (a failed matcher): keep the drafts before it
            break
        guide.commit(drafts[i])
        kept += 1
    return out[: kept + 1], kept


def valid_prefix(guide, drafts: list[int]) -> int:
    """How many leading drafts the grammar takes before it completes or refuses (guide unchanged)."""
    n = 0
    for tok in drafts:
        if guide.done or not guide.accepts(tok):
            break
        guide.commit(tok)
        n += 1
    guide.rollback(n)
    return n
