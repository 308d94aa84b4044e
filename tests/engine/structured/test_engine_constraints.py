"""Constraints in the engine: masks applied before sampling, the matcher advanced on committed
tokens only, and everything else (preemption, n > 1, prefix-cache hits, stop strings, max_tokens,
a failing matcher) keeping every output valid or ending it with a clear reason."""

import json
import re

import numpy as np
import pytest
import torch

from kvcache.engine.config import EngineConfig
from kvcache.engine.llm import LLM
from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from kvcache.engine.sampling import SamplingParams
from kvcache.engine.structured import masks
from kvcache.engine.structured.compiler import engine_compiler
from kvcache.engine.structured.constraint import Constraint
from kvcache.engine.structured.grammar import GrammarError
from kvcache.engine.structured.guide import Guide
from kvcache.engine.tokenizer import build_demo_tokenizer
from tests.engine.prefix_cache_setup import cached, open_store
from tests.engine.tiny import randomize, v4_config

CFG = EngineConfig(block_size=16, num_blocks=64, max_tokens_per_step=64, max_running=8)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer(384)


@pytest.fixture(scope="module")
def model():
    return randomize(DeepseekV4ForCausalLM(v4_config(num_nextn_predict_layers=0, vocab_size=512)), seed=3).eval()


@pytest.fixture(scope="module")
def compiler(model, tok):
    return engine_compiler(tok, model.config)


def valid(text: str) -> dict:
    obj = json.loads(text)
    assert set(obj) >= {"name", "age"} and set(obj) <= {"name", "age", "tags"}, text
    assert isinstance(obj["age"], int) and obj["age"] >= 0 and len(obj["name"]) <= 12, text
    return obj


def json_params(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 300)
    return SamplingParams(constraint=Constraint.json(SCHEMA), **kw)


def run(llm, prompts, params):
    out = llm.generate(prompts, params)
    return [c[0] if isinstance(c, list) else c for c in out]


def test_masks_unpack_llguidance_bits_exactly(compiler):
    """Our numpy unpacking against the matcher's own word-by-word answer, at a width not a
    multiple of 32 and with ids past the tokenizer."""
    m = compiler.matcher(Constraint.json(SCHEMA))
    for tok_id in compiler.tokenizer.tokenize_str('{"name":"x'):
        mask = masks.allocate(2, 500)
        m.fill(mask, 1)
        bits = [(int(mask[1, t >> 5]) >> (t & 31)) & 1 for t in range(500)]
        assert masks.allowed(mask[1], 500).tolist() == [bool(b) for b in bits]
        logits = torch.zeros(500)
        masks.apply(logits, mask[1])
        assert torch.isfinite(logits).tolist() == [bool(b) for b in bits]
        assert m.consume(tok_id)


def test_greedy_and_sampled_outputs_validate_in_one_batch(model, tok):
    llm = LLM(model=model, tokenizer=tok, config=CFG)
    params = [json_params(temperature=0)] + [json_params(temperature=1.0, seed=s) for s in range(7)]
    outs = run(llm, ["a person as JSON"] * len(params), params)
    for o in outs:
        assert o.finish_reason == "stop", (o.text, o.finish_reason)
        valid(o.text)
    llm.engine.check_idle()


def test_batches_mixing_constrained_and_free_requests_give_each_its_own_output(model, tok):
    ps = [json_params(temperature=1.0, seed=11), SamplingParams(max_tokens=20, temperature=1.0, seed=12),
          SamplingParams(max_tokens=20, seed=13, constraint=Constraint.regex(r"[a-z]{2,6}-[0-9]{2}")),
          SamplingParams(max_tokens=8, temperature=0, constraint=Constraint.choice(["yes", "no", "maybe"]))]
    prompts = ["one", "two", "three", "four"]
    together = [o.token_ids for o in run(LLM(model=model, tokenizer=tok, config=CFG), prompts, ps)]
    alone = [run(LLM(model=model, tokenizer=tok, config=CFG), [p], [q])[0].token_ids for p, q in zip(prompts, ps)]
    assert together == alone
    outs = run(LLM(model=model, tokenizer=tok, config=CFG), prompts, ps)
    assert re.fullmatch(r"[a-z]{2,6}-[0-9]{2}", outs[2].text) and outs[3].text in ("yes", "no", "maybe")


def test_preemption_mid_json_resumes_valid_and_equal(model, tok):
    p = [json_params(temperature=1.0, seed=100 + i, max_tokens=100) for i in range(6)]
    roomy = run(LLM(model=model, tokenizer=tok, config=CFG), ["x " * (5 + 3 * i) for i in range(6)], p)
    tight = EngineConfig(block_size=16, num_blocks=9, max_tokens_per_step=32, max_running=6)
    llm = LLM(model=model, tokenizer=tok, config=tight)
    squeezed = run(llm, ["x " * (5 + 3 * i) for i in range(6)], p)
    assert sum(r.metrics.preemptions for r in llm.engine.requests.values()) > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in roomy]
    for o in squeezed:
        valid(o.text)
    llm.engine.check_idle()


def test_overlapped_steps_give_the_same_constrained_outputs(model, tok):
    """Async scheduling: each step's masks come from the guides after the step before it."""
    import dataclasses
    ps = [json_params(temperature=1.0, seed=200 + i, max_tokens=100) for i in range(3)] + \
        [SamplingParams(max_tokens=20, temperature=1.0, seed=7), json_params(temperature=0, max_tokens=60),
         SamplingParams(max_tokens=30, seed=8, stop=["}"], constraint=Constraint.json(SCHEMA))]
    prompts = ["x " * (5 + 3 * i) for i in range(len(ps))]
    tight = EngineConfig(block_size=16, num_blocks=9, max_tokens_per_step=32, max_running=6)
    plain = run(LLM(model=model, tokenizer=tok, config=tight), prompts, ps)
    llm = LLM(model=model, tokenizer=tok, config=dataclasses.replace(tight, async_scheduling=True))
    overlapped = run(llm, prompts, ps)
    assert [(o.token_ids, o.text, o.finish_reason) for o in overlapped] == \
        [(o.token_ids, o.text, o.finish_reason) for o in plain]
    valid(overlapped[0].text)
    llm.engine.check_idle()


def test_n_samples_fork_their_matchers(model, tok):
    llm = LLM(model=model, tokenizer=tok, config=CFG)
    (group,) = llm.generate(["people"], json_params(temperature=1.0, seed=5, n=4))
    texts = [c.text for c in group]
    for t in texts:
        valid(t)
    assert len(set(texts)) > 1                       # each sample walked its own grammar


def test_max_tokens_cuts_json_with_finish_reason_length(model, tok, compiler):
    (o,) = run(LLM(model=model, tokenizer=tok, config=CFG), ["cut"], [json_params(temperature=1.0, seed=2,
                                                                                   max_tokens=4)])
    assert o.finish_reason == "length" and len(o.token_ids) == 4
    assert compiler.matcher(Constraint.json(SCHEMA)).validate(o.token_ids) == 4   # a valid prefix


def test_a_stop_string_inside_the_json_ends_it_there(model, tok):
    (free,) = run(LLM(model=model, tokenizer=tok, config=CFG), ["s"], [json_params(temperature=0)])
    (cut,) = run(LLM(model=model, tokenizer=tok, config=CFG), ["s"], [json_params(temperature=0, stop='"age"')])
    assert cut.finish_reason == "stop" and free.text.startswith(cut.text) and '"age"' not in cut.text


def test_prefix_cache_hits_give_the_same_constrained_output(model, tok, tmp_path):
    prompt = "a long shared system prompt " * 6
    p = json_params(temperature=1.0, seed=77)
    (cold,) = run(LLM(model=model, tokenizer=tok, config=CFG), [prompt], [p])
    store = open_store(tmp_path / "store")
    try:
        for mode in ("exact", "replay"):
            with LLM(model=model, tokenizer=tok, config=cached(mode), store=store) as llm:
                first = run(llm, [prompt], [p])[0]
                again = run(llm, [prompt], [p])[0]
                assert again.usage.total_cached > 0, mode
            assert first.token_ids == again.token_ids
            if mode == "exact":
                assert again.token_ids == cold.token_ids      # exact mode resumes bit for bit
            valid(again.text)
    finally:
        store.close()


def test_a_matcher_that_fails_fails_its_request_alone(model, tok, monkeypatch):
    llm = LLM(model=model, tokenizer=tok, config=CFG)
    real = llm.engine.builder.guide

    def sabotaged(params):
        guide = real(params)
        if guide is not None and params.seed == 666:
            guide.matcher.consume = lambda token: False          # the grammar refuses its first token
        return guide
    monkeypatch.setattr(llm.engine.builder, "guide", sabotaged)
    outs = run(llm, ["a", "b"], [json_params(seed=666), json_params(seed=1)])
    assert outs[0].finish_reason == "error" and "constraint" in outs[0].error
    assert outs[1].finish_reason == "stop" and valid(outs[1].text)
    llm.engine.check_idle()


def test_bad_constraints_are_refused_before_anything_runs(model, tok):
    llm = LLM(model=model, tokenizer=tok, config=CFG)
    for c in (Constraint.json({"type": 5}), Constraint.regex("(("), Constraint.grammar("start: nothing_here")):
        with pytest.raises(GrammarError):
            llm.engine.add_request("x", SamplingParams(constraint=c))
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(model=model, config=CFG).engine.add_request([5, 6], json_params())
    for bad in (5, None, [], "ab", [1]):                  # a clear error, never a TypeError
        with pytest.raises(ValueError, match="non-empty list of strings"):
            Constraint.choice(bad)
    assert not llm.engine.has_work()


def test_guide_thinking_gate_rollback_and_fork(compiler, tok):
    think_end = tok.token_id("</think>")
    g = Guide.for_request(compiler.matcher(Constraint.json(SCHEMA)), think_end)
    for t in tok.encode("free reasoning { not json"):
        assert g.commit(t) is None and not g.active          # thinking: anything goes
    assert g.commit(think_end) is None and g.active
    body = tok.encode('{"name":"ab","age":3}')
    for t in body[:-2]:
        assert g.commit(t) is None
    copy = g.fork()
    g.rollback(len(body) - 2 + 1)                            # back across the thinking block's end
    assert not g.active and g.seen == len(tok.encode("free reasoning { not json"))
    assert g.commit(think_end) is None and g.active
    assert g.commit(tok.encode("x")[0]) is not None          # not JSON: refused
    for t in body[-2:]:
        assert copy.commit(t) is None
    assert copy.done                                         # the fork went on alone


def test_draft_masks_for_k_positions_in_one_call(compiler, tok):
    m = compiler.matcher(Constraint.json(SCHEMA))
    draft = tok.encode('{"name":"q"') + tok.encode(":")         # the last draft token is invalid there
    mask = masks.allocate(len(draft) + 1, compiler.vocab_size)
    m.fill_drafts(draft, mask, 0)
    step = compiler.matcher(Constraint.json(SCHEMA))
    for k, t in enumerate(draft[:-1]):
        one = masks.allocate(1, compiler.vocab_size)
        step.fill(one, 0)
        assert np.array_equal(one[0], mask[k]), k                 # row k: the mask after k draft tokens
        assert masks.allowed(mask[k], compiler.vocab_size)[draft[k]]
        step.consume(t)
    assert not masks.allowed(mask[len(draft) - 1], compiler.vocab_size)[draft[-1]]
    assert m.validate(draft) == len(draft) - 1                  # state unchanged: validates from the start


def test_the_compiler_caches_per_constraint(compiler):
    c = Constraint.regex(r"cache-[0-9]{3}")
    before = compiler.compiled
    a, b = compiler.matcher(c), compiler.matcher(c)
    assert compiler.compiled == before + 1 and a is not b and a.inner is not b.inner


def test_a_spent_shared_lexer_fails_requests_loudly_and_is_rebuilt(tok, model):
    """Copies of one compiled matcher share its lexer: once its state limit is reached, a copy
    fails. That must be the request's error (never a quiet EOS-only "stop"), and the compiler
    forgets the entry, so the next request builds a fresh lexer."""
    import llguidance as llg
    from kvcache.engine.structured.compiler import GrammarCompiler
    vocab = model.config.vocab_size
    tight = GrammarCompiler(tok.backend.to_str(), vocab, 1, limits=llg.LLParserLimits(max_lexer_states=2000))
    c = Constraint.regex("([a-z]{1,5}[0-9]{1,7}|[0-9]{2,9}[a-z]{3,11}|[a-m]{4,13}[n-z]{2,9}){1,40}")
    rng, problem, requests = np.random.default_rng(0), None, 0
    while problem is None and requests < 1000:
        guide, requests = Guide.for_request(tight.matcher(c), None), requests + 1
        for _ in range(120):
            mask = masks.allocate(1, vocab)
            guide.matcher.fill(mask, 0)
            ok = np.nonzero(masks.allowed(mask[0], vocab))[0]
            ok = ok[ok != 1] if len(ok) > 1 else ok           # EOS only where nothing else is allowed
            problem = guide.commit(int(rng.choice(ok)))
            if problem is not None or guide.done:
                break
    assert problem is not None and "constraint" in problem and len(problem) < 600, requests
    before = tight.compiled
    fresh = tight.matcher(c)
    assert tight.compiled == before + 1 and not fresh.error()
