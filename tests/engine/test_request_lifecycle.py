"""A request's life at the edges: its seed, its parameters' checks, n > 1 samples under abort and
fault recovery, stop tokens in the text, atomic batches, and the async engine's streams."""

import asyncio

import pytest
import torch

from kvcache.engine.async_engine import AsyncEngine
from kvcache.engine.llm import LLM
from kvcache.engine.config import EngineConfig
from kvcache.engine.llm_engine import LLMEngine
from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from kvcache.engine.sampling import SamplingParams
from kvcache.engine.tokenizer import build_demo_tokenizer
from tests.engine.tiny import randomize, v4_config

CFG = EngineConfig(block_size=16, num_blocks=64, max_tokens_per_step=48, max_running=8)
SAMPLED = dict(temperature=1.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return randomize(DeepseekV4ForCausalLM(v4_config(num_nextn_predict_layers=0, vocab_size=512)), seed=1).eval()


def prompts(k):
    g = torch.Generator().manual_seed(9)
    return [torch.randint(3, 380, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (k,), generator=g)]


def test_requests_sharing_unseeded_params_draw_their_own_seeds(model):
    p, params = prompts(1)[0], SamplingParams(max_tokens=8, **SAMPLED)
    assert params.seed is None
    llm = LLM(model=model, config=CFG)
    twice = llm.generate([p, p], params)
    assert twice[0][0].token_ids != twice[1][0].token_ids
    assert llm.generate([p])[0][0].token_ids != llm.generate([p])[0][0].token_ids   # the default params too


@pytest.mark.parametrize("bad", [dict(seed=-1), dict(seed=2**64), dict(seed=1.5), dict(top_k=2.5),
                                 dict(max_tokens=True), dict(temperature=float("nan")), dict(n="2"),
                                 dict(logit_bias={5: float("inf")}), dict(stop=("",)), dict(stop_token_ids=("a",))])
def test_bad_parameters_are_refused_when_made(bad):
    with pytest.raises(ValueError, match="invalid sampling parameter"):
        SamplingParams(**bad)


def test_one_stop_string_or_id_is_one_stop_and_numpy_ints_are_ints():
    import numpy as np
    p = SamplingParams(stop="###", stop_token_ids=7, seed=np.uint64(5), top_k=np.int64(3))
    assert p.stop == ("###",) and p.stop_token_ids == (7,)
    assert type(p.seed) is int and type(p.top_k) is int


def test_a_bad_prompt_in_a_batch_queues_none_of_it(model):
    llm = LLM(model=model, config=CFG)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([prompts(1)[0], [5, 10_000]], SamplingParams(max_tokens=2, temperature=0))
    assert not llm.engine.has_work() and not llm.engine.requests
    with pytest.raises(ValueError, match="has a '/'"):
        llm.engine.add_request([5, 6], SamplingParams(), request_id="a/1")


def _forked(model, cfg=CFG, **kw):
    engine = LLMEngine(model, None, cfg)
    prompt = (prompts(1)[0] * 3)[:40]                  # 2 full blocks of 16, then 8 tokens
    parent = engine.add_request(prompt, SamplingParams(max_tokens=8, n=3, seed=3, **SAMPLED, **kw))
    while parent.metrics.first_token is None:
        engine.step()
    return engine, parent


def test_aborting_a_parent_aborts_its_samples(model):
    engine, parent = _forked(model)
    kids = engine.family(parent.request_id)[1:]
    assert len(kids) == 2 and all(k.status.value == "running" for k in kids)
    engine.abort(parent.request_id)
    assert all(r.finish_reason.value == "abort" for r in [parent, *kids]) and not engine.has_work()
    engine.check_idle()


def test_samples_keep_their_parents_place_in_the_queue(model):
    engine = LLMEngine(model, None, CFG)
    a = engine.add_request(prompts(1)[0], SamplingParams(max_tokens=3, n=2, seed=1, **SAMPLED))
    b = engine.add_request(prompts(2)[1], SamplingParams(max_tokens=3, temperature=0))
    while a.metrics.first_token is None:
        engine.step()
    child = engine.requests[a.request_id + "/1"]
    assert a.sort_key() < child.sort_key() < b.sort_key()
    assert child.metrics.ttft_s == a.metrics.ttft_s >= 0


def test_a_failed_step_with_shared_blocks_recovers_in_a_full_pool(model, monkeypatch):
    tight = EngineConfig(block_size=16, num_blocks=5, max_tokens_per_step=48, max_running=8)
    engine, parent = _forked(model, tight)
    assert engine.pool.num_free() < len(parent.block_ids)   # no room for a private copy of the shared blocks
    real, calls = model.step, []

    def flaky(tokens, states):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("transient fault")
        return real(tokens, states)
    monkeypatch.setattr(model, "step", flaky)
    engine.step()
    monkeypatch.undo()
    while engine.has_work():
        engine.step()
    engine.check_idle()
    family = engine.family(parent.request_id)
    assert [r.finish_reason.value for r in family] == ["length"] * 3 and all(len(r.output) == 8 for r in family)
    roomy, twin = _forked(model)                        # the same seed in a roomy pool: the same tokens
    while roomy.has_work():
        roomy.step()
    assert [r.output for r in roomy.family(twin.request_id)] == [r.output for r in family]


def test_a_stop_token_is_never_in_the_text():
    tok = build_demo_tokenizer(512)
    m = randomize(DeepseekV4ForCausalLM(v4_config(num_nextn_predict_layers=0, vocab_size=512)), seed=1).eval()
    greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
    base = LLM(model=m, tokenizer=tok, config=CFG).generate(["hello world"], SamplingParams(**greedy))[0][0]
    stop = base.token_ids[4]
    first = base.token_ids.index(stop)
    texts = [LLM(model=m, tokenizer=tok, config=CFG).generate(["hello world"], SamplingParams(
        **greedy, stop_token_ids=(stop,), stop=extra))[0][0] for extra in ((), ("zzzqqq",))]
    assert [c.token_ids for c in texts] == [base.token_ids[: first + 1]] * 2
    assert [c.text for c in texts] == [tok.decode(base.token_ids[:first], skip_special=True)] * 2


async def test_async_n_samples_stream_to_one_consumer_and_abort_ends_the_stream(model):
    engine = LLMEngine(model, None, CFG)
    async with AsyncEngine(engine) as aeng:
        got: dict[int, list[int]] = {}
        async for out in aeng.generate(prompts(1)[0], SamplingParams(max_tokens=4, n=3, seed=1, **SAMPLED)):
            got.setdefault(out.request.stream, []).extend(out.new_tokens)
        assert sorted(got) == [0, 1, 2] and all(len(t) == 4 for t in got.values())
        want = LLM(model=model, config=CFG).generate([prompts(1)[0]], SamplingParams(max_tokens=4, n=3, seed=1,
                                                                                      **SAMPLED))[0]
        assert [got[i] for i in range(3)] == [c.token_ids for c in want]

        stream = aeng.generate(prompts(2)[1], SamplingParams(max_tokens=500, n=2, seed=2, **SAMPLED),
                               request_id="long")
        while not (await stream.__anext__()).request.stream:     # until a sample has forked
            pass
        aeng.abort("long")                                         # from elsewhere (an admin, a timeout)
        rest = [out async for out in stream]
        assert rest and rest[-1].finished and {o.request.finish_reason.value for o in rest if o.finished} == {"abort"}
    assert not engine.requests                           # finished requests are not kept
    engine.check_idle()


async def test_async_engine_survives_a_step_that_raises(model, monkeypatch):
    engine = LLMEngine(model, None, CFG)
    async with AsyncEngine(engine) as aeng:
        def broken(*a, **k):
            raise RuntimeError("scheduler bug")
        monkeypatch.setattr(engine.scheduler, "update", broken)
        outs = [o async for o in aeng.generate(prompts(1)[0], SamplingParams(max_tokens=3, temperature=0))]
        assert outs[-1].finished and "scheduler bug" in outs[-1].request.error
        monkeypatch.undo()
        outs = await asyncio.wait_for(_collect(aeng, prompts(1)[0]), timeout=60)
        assert len(outs) == 3
    engine.check_idle()


async def _collect(aeng, prompt):
    return [t async for out in aeng.generate(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
            for t in out.new_tokens]


def test_a_vanishing_temperature_samples_greedily():
    from kvcache.engine.sampling import sample
    logits = torch.randn(512, generator=torch.Generator().manual_seed(0))
    assert sample(logits, SamplingParams(temperature=1e-300, seed=1), 5, 0, [], []) == int(torch.argmax(logits))


def test_prompts_as_arrays_and_tensors(model):
    import numpy as np
    llm = LLM(model=model, config=CFG)
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    p = prompts(2)
    want = [o[0].token_ids for o in llm.generate(p, greedy)]
    assert [o[0].token_ids for o in llm.generate(np.array(p[0]), greedy)] == want[:1]
    assert [o[0].token_ids for o in llm.generate([torch.tensor(p[0]), np.array(p[1], dtype=np.int64)], greedy)] == want


def test_samples_never_run_more_requests_than_max_running(model):
    import dataclasses
    engine = LLMEngine(model, None, dataclasses.replace(CFG, max_running=2))
    parent = engine.add_request(prompts(1)[0], SamplingParams(max_tokens=6, n=4, seed=5, **SAMPLED))
    most = 0
    while engine.has_work():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most == 2 and all(len(r.output) == 6 for r in engine.family(parent.request_id))
    engine.check_idle()


def test_nan_logits_fail_their_request_alone(model, monkeypatch):
    """argmax takes NaN for the largest logit: a NaN would have been chosen as the token. It is
    an error of that request (the model is broken for it); the other requests run on."""
    from kvcache.engine import llm_engine, sampling
    logits = torch.tensor([5.0, 4.0, float("nan"), -3.0])
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1)):
        with pytest.raises(FloatingPointError, match="NaN logits"):
            sampling.sample(logits, params, 0, 0, [], [])
    engine = LLMEngine(model, None, CFG)
    bad, good = (engine.add_request(p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
                 for p in prompts(2))
    real = llm_engine.sample

    def poisoned(logits, params, pos, stream, seen, generated):
        if seen[: len(bad.prompt)] == bad.prompt:
            logits = logits.clone()
            logits[7] = float("nan")
        return real(logits, params, pos, stream, seen, generated)
    monkeypatch.setattr(llm_engine, "sample", poisoned)
    while engine.has_work():
        engine.step()
    assert bad.finish_reason.value == "error" and "NaN logits" in bad.error
    assert good.finish_reason.value == "length" and len(good.output) == 4
    engine.check_idle()
