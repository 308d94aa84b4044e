"""Overlapped steps (EngineConfig.async_scheduling): the next step is planned while the forward
runs, and nothing a user or the cache sees may differ from steps in series."""

import dataclasses

import pytest
import torch

from kvcache.engine.config import EngineConfig
from kvcache.engine.layers.engram import compressed_token_map
from kvcache.engine.llm import LLM
from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from kvcache.engine.models.deepseek_v41 import DeepseekV41ForCausalLM
from kvcache.engine.sampling import SamplingParams
from kvcache.engine.scheduler import PLACEHOLDER
from kvcache.engine.tokenizer import build_demo_tokenizer
from kvcache.kvstore.hashing import hash_blocks
from tests.engine.tiny import randomize, v4_config, v41_config

CFG = EngineConfig(block_size=16, num_blocks=64, max_tokens_per_step=64, max_running=8)


@pytest.fixture(scope="module", params=["v4", "v41"])
def model(request):
    if request.param == "v4":
        return randomize(DeepseekV4ForCausalLM(v4_config()), seed=3).eval()
    tm = compressed_token_map(build_demo_tokenizer(512))
    m = randomize(DeepseekV41ForCausalLM(v41_config(int(tm.max()) + 1)), seed=3)
    m.set_token_map(tm)
    return m.eval()


def prompts(k=6, seed=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 380, (int(n),), generator=g).tolist() for n in torch.randint(5, 70, (k,), generator=g)]


def mixed_params(k):
    """Greedy and sampled, short and long, with stop tokens and n > 1."""
    out = []
    for i in range(k):
        p = SamplingParams(max_tokens=6 + 3 * i, temperature=0 if i % 2 else 0.9, seed=i, ignore_eos=True,
                           n=2 if i == 2 else 1, stop_token_ids=[7, 11, 13] if i == 3 else [])
        out.append(p)
    return out


def run(model, cfg, ps, params):
    llm = LLM(model=model, config=cfg)
    groups = llm.generate(ps, params)
    llm.engine.check_idle()
    return llm, [[(c.token_ids, c.finish_reason) for c in g] for g in groups]


@pytest.mark.parametrize("shape", ["roomy", "chunked", "tight"])
def test_overlapped_steps_give_the_same_outputs(model, shape):
    cfg = {"roomy": CFG, "chunked": dataclasses.replace(CFG, max_tokens_per_step=24),
           "tight": dataclasses.replace(CFG, num_blocks=9, max_tokens_per_step=32)}[shape]
    ps, params = prompts(), mixed_params(6)
    _, plain = run(model, cfg, ps, params)
    llm, overlapped = run(model, dataclasses.replace(cfg, async_scheduling=True), ps, params)
    assert llm.engine.ahead is not None
    assert overlapped == plain
    if shape == "tight":
        assert sum(r.metrics.preemptions for r in llm.engine.requests.values()) > 0


def test_the_plan_made_ahead_has_placeholders_and_a_late_stop_costs_no_compute(model):
    ps = prompts(4, seed=8)
    plain_llm, plain = run(model, CFG, ps, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    stops = [g[0][0][4] for g in plain]                      # each stops at its fifth token
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[s]) for s in stops]
    _, plain = run(model, CFG, ps, params)
    llm = LLM(model=model, config=dataclasses.replace(CFG, async_scheduling=True))
    plans = []
    take = llm.engine.ahead.take

    def watched():
        plan = take()
        if plan is not None:
            plans.append([(ch.request.request_id, ch.placeholder, list(ch.tokens)) for ch in plan.chunks])
        return plan
    llm.engine.ahead.take = watched
    groups = llm.generate(ps, params)
    assert [[(c.token_ids, c.finish_reason) for c in g] for g in groups] == plain
    assert any(p and all(ph and toks == [PLACEHOLDER] for _, ph, toks in p) for p in plans)
    for req, (toks, _) in zip(sorted(llm.engine.requests.values(), key=lambda r: r.arrival_seq), (g[0] for g in plain)):
        # planned once more after its stop token, never run: prompt + outputs but the last
        assert req.metrics.tokens_computed == len(req.prompt) + len(toks) - 1
    llm.engine.check_idle()


def test_only_computed_tokens_get_block_keys(model):
    ps = prompts(4, seed=5)
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=2, ignore_eos=True)
    cfg = dataclasses.replace(CFG, async_scheduling=True)
    llm = LLM(model=model, config=cfg)
    eng = llm.engine
    reqs = [eng.add_request(p, params) for p in ps]
    while eng.has_work():
        eng.step()
        for r in reqs:                                   # keys only for full blocks of verified tokens
            full = len(r.block_keys)
            assert full * CFG.block_size <= r.num_computed or r.finished
            if full:
                assert r.block_keys == hash_blocks(eng.namespace, r.tokens[: full * CFG.block_size],
                                                   parent=r.chain_root)
    keyed = sorted(b.key for b in eng.pool.blocks if b.key is not None)
    plain = LLM(model=model, config=CFG)
    for p in ps:
        plain.engine.add_request(p, params)
    while plain.engine.has_work():
        plain.engine.step()
    assert keyed == sorted(b.key for b in plain.engine.pool.blocks if b.key is not None) and keyed


def test_abort_between_overlapped_steps_frees_everything(model):
    llm = LLM(model=model, config=dataclasses.replace(CFG, async_scheduling=True))
    eng = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    reqs = [eng.add_request(p, params) for p in prompts(3, seed=6)]
    for _ in range(4):
        eng.step()
    assert eng.ahead.pending                             # the next step is planned, placeholders and all
    held = list(reqs[1].output)
    eng.abort(reqs[1].request_id)
    while eng.has_work():
        assert all(o.request is not reqs[1] for o in eng.step())
    assert reqs[1].output == held and reqs[1].finish_reason.value == "abort"
    assert all(len(r.output) == 30 for r in (reqs[0], reqs[2]))
    eng.check_idle()
    eng.add_request(prompts(1, seed=7)[0], params)       # aborted with a plan pending: nothing held
    eng.step()
    for r in list(eng.requests.values()):
        eng.abort(r.request_id)
    assert not eng.has_work()
    eng.check_idle()


def test_fail_all_gives_back_the_plan(model):
    llm = LLM(model=model, config=dataclasses.replace(CFG, async_scheduling=True))
    eng = llm.engine
    reqs = [eng.add_request(p, SamplingParams(max_tokens=20, temperature=0)) for p in prompts(3, seed=9)]
    eng.step()
    eng.step()
    outs = eng.fail_all("boom")
    assert {o.request.request_id for o in outs} == {r.request_id for r in reqs}
    assert all(r.error == "boom" for r in reqs) and not eng.has_work()
    eng.check_idle()


def test_async_scheduling_is_off_on_the_cpu_unless_asked(model):
    assert LLM(model=model, config=CFG).engine.ahead is None
    assert EngineConfig.from_dict({"engine": {"async_scheduling": True}}).async_scheduling is True


@pytest.mark.parametrize("mode", ["exact", "replay"])
def test_overlapped_steps_with_prefix_hits_in_both_cache_modes(model, mode):
    from tests.engine.prefix_cache_setup import GREEDY, cached
    from tests.engine.prefix_cache_setup import prompts as documents
    P, Qs = documents(11, n_questions=4)
    ps = [P + q for q in Qs]
    seen = {}
    for overlap in (False, True):
        llm = LLM(model=model, config=dataclasses.replace(cached(mode), async_scheduling=overlap))
        first = llm.generate(ps[:1], GREEDY)
        rest = llm.generate(ps[1:], GREEDY)
        usage = [llm.engine.requests[g[0].request_id].usage.total_cached for g in rest]
        seen[overlap] = ([g[0].token_ids for g in first + rest], usage)
        llm.engine.check_idle()
    assert seen[True] == seen[False]
    assert all(u >= 80 for u in seen[True][1]), seen[True][1]       # the document's blocks from the pool


def test_a_planner_error_raises_and_gives_its_blocks_back(model, monkeypatch):
    llm = LLM(model=model, config=dataclasses.replace(CFG, async_scheduling=True))
    eng = llm.engine
    eng.add_request(prompts(1, seed=10)[0], SamplingParams(max_tokens=20, temperature=0))
    eng.step()
    real = eng.scheduler._running_chunk

    def broken(req, flight, *a):
        real(req, flight, *a)                        # takes its blocks, then fails
        raise RuntimeError("planner bug")
    monkeypatch.setattr(eng.scheduler, "_running_chunk", broken)
    with pytest.raises(RuntimeError, match="planner bug"):
        eng.step()
    monkeypatch.undo()
    assert not eng.ahead.pending
    eng.fail_all("planner bug")
    eng.check_idle()


def test_samples_forked_while_a_plan_was_made_join_the_next_step(model):
    llm = LLM(model=model, config=dataclasses.replace(CFG, async_scheduling=True))
    eng = llm.engine
    parent = eng.add_request(prompts(1, seed=11)[0], SamplingParams(max_tokens=6, temperature=0.8, n=3, seed=1))
    eng.step()                                          # prefill: the samples fork after the plan was made
    kids = [r for r in eng.requests.values() if r.parent is parent]
    assert len(kids) == 2 and all(len(k.output) == 1 for k in kids)
    eng.step()
    assert all(len(r.output) == 2 for r in [parent, *kids])   # every sample decoded in this step
