"""Sampled speculation has plain sampling's distribution, across verify rounds, in the engine: the
joint distribution of a request's first three tokens over many seeds (one prompt, temperature
0.4, top-k 4, so each position has a few outcomes), speculative against plain, by a two-sample
chi-square test; the same test fails a wrong acceptance rule (sqrt(p) for p)."""

import collections
import dataclasses

import pytest

from kvcache.engine.llm import LLM
from kvcache.engine.sampling import SamplingParams, uniform
from kvcache.engine.speculative import verify as v
from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from tests.engine.speculative.test_spec_engine import CFG, _with_oracle, outputs, prompts
from tests.engine.tiny import randomize, v4_config

SEEDS, WAVE = 600, 100
# a wave's prompts all fit the first step, so that its decode steps leave budget for drafts
WIDE = dataclasses.replace(CFG, max_running=WAVE, num_blocks=4 * WAVE, max_tokens_per_step=40 * WAVE)


def _joint(llm, prompt, params_for):
    joint = collections.Counter()
    for first in range(0, SEEDS, WAVE):
        outs = llm.generate([prompt] * WAVE, [params_for(s) for s in range(first, first + WAVE)])
        joint.update(tuple(o[0].token_ids[:3]) for o in outs)
    return joint


def _chi2(a: collections.Counter, b: collections.Counter) -> tuple[float, int]:
    """Two-sample chi-square over outcomes seen at least 10 times in all (rarer ones pooled)."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    rest = (sum(a.values()) - sum(a[k] for k in keys), sum(b.values()) - sum(b[k] for k in keys))
    cells = [(a[k], b[k]) for k in keys] + ([rest] if sum(rest) else [])
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells)        # equal sample sizes
    return stat, len(cells) - 1


CRITICAL_001 = {d: c for d, c in enumerate([0, 10.8, 13.8, 16.3, 18.5, 20.5, 22.5, 24.3, 26.1, 27.9, 29.6, 31.3,
                                            32.9, 34.5, 36.1, 37.7, 39.3, 40.8, 42.3, 43.8, 45.3, 46.8, 48.3,
                                            49.7, 51.2, 52.6, 54.1, 55.5, 56.9, 58.3, 59.7])}


@pytest.fixture(scope="module")
def runs():
    # the oracle drafts (the greedy answer, one-hot): what is tested is the engine's verification
    # across rounds, the same code for both drafters, so one model suffices
    model, method = randomize(DeepseekV4ForCausalLM(v4_config()), seed=1).eval(), "mtp"
    prompt = prompts(1)[0]
    greedy = outputs(LLM(model=model, config=CFG), [prompt], SamplingParams(max_tokens=6, temperature=0,
                                                                              ignore_eos=True))

    def params(seed):
        return SamplingParams(max_tokens=6, temperature=0.4, top_k=4, seed=seed, ignore_eos=True)

    def spec_run():
        llm = LLM(model=model, config=dataclasses.replace(WIDE, speculative=method, num_draft=3))
        _with_oracle(llm, [prompt], greedy, lie=10**9)     # drafts: the greedy answer, accepted or not by chance
        joint = _joint(llm, prompt, params)
        return joint, llm.engine.spec.stats
    return _joint(LLM(model=model, config=WIDE), prompt, params), spec_run


def test_sampled_speculation_has_the_plain_distribution(runs):
    plain, spec_run = runs
    spec, stats = spec_run()
    stat, dof = _chi2(plain, spec)
    assert 0 < stats.rates()[0] < 1                   # drafts were both accepted and rejected
    assert dof >= 3 and stat < CRITICAL_001[min(dof, 30)], (stat, dof)


def test_the_test_fails_a_wrong_acceptance_rule(runs, monkeypatch):
    plain, spec_run = runs

    def too_eager(probs, draft, i, p, pos, stream):     # accept with sqrt(p(d)) instead of p(d)
        return uniform(p.seed, pos, v.ACCEPT | stream) < float(probs[draft.tokens[i]]) ** 0.5
    monkeypatch.setattr(v, "accepted", too_eager)
    spec, _ = spec_run()
    stat, dof = _chi2(plain, spec)
    assert stat > CRITICAL_001[min(dof, 30)], (stat, dof)
