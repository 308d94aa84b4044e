"""Speculative decoding in the engine (tiny V4 with MTP, tiny V4.1 with DSpark): greedy output
equals plain decoding token for token, with the checkpoint's random drafters (which accept
almost nothing) and with an oracle drafter that knows the plain answer but lies at some
positions (which accepts a lot and rejects often): batch 1 and a batch, preemption, n > 1."""

import dataclasses

import pytest
import torch

from kvcache.engine.config import EngineConfig
from kvcache.engine.layers.engram import compressed_token_map
from kvcache.engine.llm import LLM
from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from kvcache.engine.models.deepseek_v41 import DeepseekV41ForCausalLM
from kvcache.engine.sampling import SamplingParams
from kvcache.engine.speculative.drafters import Drafter, Proposal
from kvcache.engine.speculative.verify import Draft
from kvcache.engine.tokenizer import build_demo_tokenizer
from tests.engine.tiny import randomize, v4_config, v41_config

CFG = EngineConfig(block_size=16, num_blocks=64, max_tokens_per_step=64, max_running=8)
GREEDY = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["mtp", "dspark"])
def case(request):
    if request.param == "mtp":
        return randomize(DeepseekV4ForCausalLM(v4_config()), seed=1).eval(), "mtp"
    tm = compressed_token_map(build_demo_tokenizer(512))
    m = randomize(DeepseekV41ForCausalLM(v41_config(int(tm.max()) + 1)), seed=1)
    m.set_token_map(tm)
    return m.eval(), "dspark"


def prompts(k=4):
    g = torch.Generator().manual_seed(9)
    return [torch.randint(3, 380, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (k,), generator=g)]


def outputs(llm, ps, params=GREEDY):
    return [[c.token_ids for c in group] for group in llm.generate(ps, params)]


def spec_config(method, **over):
    return dataclasses.replace(CFG, speculative=method, **over)


class Oracle(Drafter):
    """A drafter that proposes the plain run's next tokens, wrong at every `lie`-th position."""

    def __init__(self, real, full: dict, lie: int = 3):
        self.real, self.full, self.lie, self.current = real, full, lie, []
        self.collect, self.max_draft, self.name = real.collect, real.max_draft, "oracle"

    def context_many(self, items):
        self.real.context_many(items)

    def propose(self, state, anchor, start, k, sample, greedy):
        toks = []
        for pos in range(start + 1, start + 1 + k):
            true = self.current[pos] if pos < len(self.current) else 5
            toks.append((true + 1) % 300 + 3 if pos % self.lie == 0 else true)
        return Proposal(Draft(tuple(toks)), tuple(0.9 for _ in toks))


def _with_oracle(llm, ps, plain, lie: int = 3):
    """The engine's drafter swapped for an Oracle that knows each prompt's plain answer."""
    spec = llm.engine.spec
    oracle = Oracle(spec.drafter, {tuple(p): p + o[0] for p, o in zip(ps, plain)}, lie)
    propose_all = spec.propose_all

    def knowing(reqs):
        for req in reqs:                       # one at a time: the oracle answers for one prompt
            oracle.current = oracle.full[tuple(req.prompt)]
            propose_all([req])

    spec.drafter, spec.propose_all = oracle, knowing


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculation_equals_plain_decoding(case, batch):
    model, method = case
    ps = prompts(batch)
    plain = outputs(LLM(model=model, config=CFG), ps)
    llm = LLM(model=model, config=spec_config(method))
    assert outputs(llm, ps) == plain
    assert llm.engine.spec.stats.steps > 0
    llm.engine.check_idle()


def test_an_oracle_drafter_is_accepted_and_rejected_and_the_output_stays_plain(case):
    model, method = case
    ps = prompts(4)
    plain = outputs(LLM(model=model, config=CFG), ps)
    llm = LLM(model=model, config=spec_config(method, num_draft=4))
    _with_oracle(llm, ps, plain)
    assert outputs(llm, ps) == plain
    stats = llm.engine.spec.stats
    rates = stats.rates()
    assert stats.mean_accepted_tokens > 1.5 and 0 < rates[0] < 1, (stats.mean_accepted_tokens, rates)
    llm.engine.check_idle()


def test_speculation_survives_preemption_and_forks(case):
    model, method = case
    ps = prompts(6)
    tight = dataclasses.replace(CFG, num_blocks=6, max_tokens_per_step=32, max_running=6)
    plain = outputs(LLM(model=model, config=tight), ps)
    llm = LLM(model=model, config=dataclasses.replace(tight, speculative=method, num_draft=4))
    _with_oracle(llm, ps, plain)
    assert outputs(llm, ps) == plain
    assert sum(r.metrics.preemptions for r in llm.engine.requests.values()) > 0
    llm.engine.check_idle()
    two = dataclasses.replace(GREEDY, n=2)
    assert outputs(LLM(model=model, config=spec_config(method)), ps[:2], two) == \
        outputs(LLM(model=model, config=CFG), ps[:2], two)


def test_overlapped_steps_with_speculation_equal_plain_decoding(case):
    """Async scheduling plans each step with placeholders; drafts join when it settles."""
    model, method = case
    ps = prompts(6)
    tight = dataclasses.replace(CFG, num_blocks=8, max_tokens_per_step=32, max_running=6)
    plain = outputs(LLM(model=model, config=tight), ps)
    llm = LLM(model=model, config=dataclasses.replace(tight, speculative=method, num_draft=4, async_scheduling=True))
    _with_oracle(llm, ps, plain)
    assert outputs(llm, ps) == plain
    rates = llm.engine.spec.stats.rates()
    assert llm.engine.spec.stats.mean_accepted_tokens > 1.5 and 0 < rates[0] < 1
    assert sum(r.metrics.preemptions for r in llm.engine.requests.values()) > 0
    llm.engine.check_idle()


def test_max_tokens_and_stop_tokens_cut_a_verified_draft(case):
    model, method = case
    ps = prompts(3)
    for params in (dataclasses.replace(GREEDY, max_tokens=5),
                   dataclasses.replace(GREEDY, max_tokens=20, stop_token_ids=(7, 9, 11, 13, 17, 19, 23))):
        plain = outputs(LLM(model=model, config=CFG), ps, params)
        llm = LLM(model=model, config=spec_config(method, num_draft=4))
        _with_oracle(llm, ps, plain)
        assert outputs(llm, ps, params) == plain
        llm.engine.check_idle()


def test_abort_during_speculation_frees_everything(case):
    model, method = case
    llm = LLM(model=model, config=spec_config(method))
    reqs = [llm.engine.add_request(p, dataclasses.replace(GREEDY, max_tokens=40)) for p in prompts(3)]
    for _ in range(4):
        llm.engine.step()
    assert any(r.proposal is not None for r in reqs)
    for r in reqs:
        llm.engine.abort(r.request_id)
    assert not llm.engine.has_work()
    llm.engine.check_idle()


def test_drafts_take_only_what_the_step_leaves(case):
    model, method = case
    ps = prompts(6)
    tight = dataclasses.replace(CFG, max_tokens_per_step=8)
    plain = outputs(LLM(model=model, config=tight), ps)
    llm = LLM(model=model, config=dataclasses.replace(tight, speculative=method, num_draft=4))
    _with_oracle(llm, ps, plain)
    engine, schedule = llm.engine, llm.engine.scheduler.schedule
    seen = []

    def watched():
        out = schedule()
        decoding = [r for r in engine.scheduler.running if not r.is_prefill]
        seen.append((len(decoding), sum(1 for c in out.chunks if not c.request.is_prefill), out.num_tokens
                     + sum(len(c.drafts) for c in out.chunks)))
        return out
    engine.scheduler.schedule = watched
    assert outputs(llm, ps) == plain
    assert all(got == want for want, got, _ in seen if want <= 8)    # every decode advances, drafts or not
    assert all(total <= 8 for _, _, total in seen)


def test_n_samples_keep_verified_drafts(case):
    model, method = case
    ps, two = prompts(2), dataclasses.replace(GREEDY, n=2)
    plain = outputs(LLM(model=model, config=CFG), ps, two)
    llm = LLM(model=model, config=spec_config(method, num_draft=4))
    _with_oracle(llm, ps, plain)
    assert outputs(llm, ps, two) == plain
    assert llm.engine.spec.stats.mean_accepted_tokens > 1.5
    llm.engine.check_idle()


def test_a_failing_drafter_leaves_requests_decoding_without_drafts(case, caplog):
    model, method = case
    ps = prompts(3)
    plain = outputs(LLM(model=model, config=CFG), ps)
    llm = LLM(model=model, config=spec_config(method))

    def broken(items):
        raise FloatingPointError("the drafter produced NaN logits")
    llm.engine.spec.drafter.propose_many = broken
    assert outputs(llm, ps) == plain
    assert "decodes without drafts" in caplog.text
    llm.engine.check_idle()
