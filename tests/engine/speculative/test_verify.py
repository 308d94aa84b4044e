"""Verification: greedy is the argmax chain; sampled verification has the plain sampler's
distribution (a chi-square test over many seeds that a wrong rule fails, shown by breaking
the rule); every random number has its own stream."""

import pytest
import torch

from kvcache.engine.sampling import SamplingParams, sample
from kvcache.engine.speculative import verify as v
from kvcache.engine.speculative.verify import Draft, draft_token, verify

V = 8


def rows(*argmaxes, vocab=V):
    out = torch.zeros(len(argmaxes), vocab)
    for i, a in enumerate(argmaxes):
        out[i, a] = 5.0
    return out


GREEDY = SamplingParams(temperature=0, seed=1)


def test_greedy_accepts_the_argmax_chain_then_takes_the_bonus():
    got = verify(rows(3, 4, 5), Draft((3, 4)), GREEDY, 10, 0, [1], [])
    assert (got.accepted, got.tokens) == (2, (3, 4, 5))


def test_greedy_stops_at_the_first_mismatch_with_the_targets_token():
    got = verify(rows(3, 4, 5), Draft((3, 7)), GREEDY, 10, 0, [1], [])
    assert (got.accepted, got.tokens) == (1, (3, 4))
    got = verify(rows(3, 4, 5), Draft((6, 4)), GREEDY, 10, 0, [1], [])
    assert (got.accepted, got.tokens) == (0, (3,))


def test_no_draft_is_plain_sampling():
    p = SamplingParams(temperature=0.8, top_k=5, seed=7)
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
    for pos in range(20):
        assert verify(logits, Draft(()), p, pos, 0, [1], []).tokens == (sample(logits[0], p, pos, 0, [1], []),)


def test_penalties_see_the_drafts_before_each_position():
    p = SamplingParams(temperature=0, seed=1, presence_penalty=2.0)
    logits = torch.zeros(3, V)
    logits[:, 3] = 5.0
    logits[:, 4] = 4.0                   # 3 leads by 1 until the draft has used it: then 4 leads
    assert verify(logits, Draft((3, 3)), p, 0, 0, [], []).tokens == (3, 4)


def test_a_draft_the_drafter_gave_no_mass_or_the_target_truncated_is_rejected():
    p = SamplingParams(temperature=1.0, top_k=2, seed=3)
    logits = torch.tensor([[4.0, 3.0, 0.0, 0, 0, 0, 0, 0], [0.0] * V])
    for seed in range(50):
        ps = SamplingParams(temperature=1.0, top_k=2, seed=seed)
        got = verify(logits, Draft((2,)), ps, 0, 0, [], [])          # outside the target's top 2
        assert got.accepted == 0 and got.tokens[0] in (0, 1)
    q = torch.zeros(1, V, dtype=torch.float64)
    q[0, 1] = 1.0
    assert verify(logits, Draft((0,), q), p, 0, 0, [], []).accepted == 0   # q(d) = 0


def _emitted(target, draft_logits, p, seeds, sampled_drafts):
    """Counts of the first two emitted tokens over `seeds` (drafts drawn by draft_token)."""
    first, second = torch.zeros(V), torch.zeros(V)
    k = draft_logits.shape[0]
    for seed in range(seeds):
        ps = SamplingParams(temperature=p.temperature, top_p=p.top_p, seed=seed)
        toks, qs = [], []
        for i in range(k):
            tok, q = draft_token(draft_logits[i], ps, 100 + i, 0, [], toks)
            toks.append(tok)
            qs.append(q)
        draft = Draft(tuple(toks), torch.stack(qs) if sampled_drafts else None)
        out = verify(target, draft, ps, 100, 0, [], []).tokens
        first[out[0]] += 1
        second[out[1] if len(out) > 1 else sample(target[1], ps, 101, 0, [], [out[0]])] += 1
    return first / seeds, second / seeds


# chi-square critical values at p = 0.001 by degrees of freedom: a right rule fails 1 in 1000
# (the draws are seeded: a passing test passes every run), a wrong one fails by far
CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _chi2(freq, want, n=None):
    """(chi-square of the observed frequencies against `want`, its critical value)."""
    n = SEEDS if n is None else n
    live = want > 0
    if bool((freq[~live] > 0).any()):
        return float("inf"), 0.0
    obs, exp = freq[live] * n, want[live] * n
    return float(((obs - exp) ** 2 / exp).sum()), CRITICAL[int(live.sum()) - 1]


@pytest.fixture(scope="module")
def case():
    g = torch.Generator().manual_seed(11)
    target = torch.randn(3, V, generator=g) * 1.5
    drafts = torch.randn(2, V, generator=g) * 1.5               # a drafter that disagrees a lot
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=0)
    want = [v.distribution(target[i], p, 100 + i, [], []).float() for i in range(2)]
    return target, drafts, p, want


SEEDS = 12000


@pytest.mark.parametrize("sampled_drafts", [True, False], ids=["q", "one-hot"])
def test_sampled_verification_has_the_targets_distribution(case, sampled_drafts):
    target, drafts, p, want = case
    first, second = _emitted(target, drafts, p, SEEDS, sampled_drafts)
    for freq, dist in ((first, want[0]), (second, want[1])):
        stat, bound = _chi2(freq, dist)
        assert stat < bound, (stat, bound, freq, dist)


def test_the_bound_fails_a_recovery_drawn_from_p_instead_of_the_residual(case, monkeypatch):
    target, drafts, p, want = case
    monkeypatch.setattr(v, "residual", lambda probs, draft, i: probs)
    first, _ = _emitted(target, drafts, p, SEEDS, True)
    stat, bound = _chi2(first, want[0])
    assert stat > 3 * bound, stat


def test_the_bound_fails_a_recovery_that_reuses_the_drafters_number(case, monkeypatch):
    target, drafts, p, want = case
    monkeypatch.setattr(v, "RECOVER", v.DRAFT)
    first, _ = _emitted(target, drafts, p, SEEDS, True)
    stat, bound = _chi2(first, want[0])
    assert stat > 3 * bound, stat


def test_streams_are_distinct():
    assert len({0, v.ACCEPT, v.RECOVER, v.DRAFT}) == 4 and v.ACCEPT > 1 << 20


def test_a_draft_needs_one_distribution_per_token():
    with pytest.raises(ValueError, match="2 tokens"):
        Draft((1, 2), torch.zeros(1, V))
    with pytest.raises(ValueError, match="3 rows"):
        verify(torch.zeros(2, V), Draft((1, 2)), GREEDY, 0, 0, [], [])
