"""Speculation under constraints: drafts drawn through the grammar's masks, verified against the
target's masked rows, the matcher rolled back past rejected drafts. Greedy constrained output
equals plain constrained output (JSON schema, regex, choice), with the real MTP drafter and with
an oracle that proposes tokens the grammar refuses; sampled output validates."""

import dataclasses
import json
import re

import pytest

from kvcache.engine.llm import LLM
from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from kvcache.engine.request import prompt_ids
from kvcache.engine.sampling import SamplingParams
from kvcache.engine.structured.constraint import Constraint
from kvcache.engine.tokenizer import build_demo_tokenizer
from tests.engine.speculative.test_spec_engine import CFG, _with_oracle
from tests.engine.tiny import randomize, v4_config

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
SPEC = dataclasses.replace(CFG, speculative="mtp", num_draft=4)


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer(384)


@pytest.fixture(scope="module")
def model():
    return randomize(DeepseekV4ForCausalLM(v4_config(vocab_size=512)), seed=3).eval()


def params(**kw):
    return [SamplingParams(max_tokens=120, constraint=Constraint.json(SCHEMA), **kw),
            SamplingParams(max_tokens=16, constraint=Constraint.regex(r"[a-z]{2,6}-[0-9]{2}"), **kw),
            SamplingParams(max_tokens=8, constraint=Constraint.choice(["yes", "no", "maybe"]), **kw)]


def run(llm, ps):
    prompts = [f"prompt {i}" for i in range(len(ps))]
    return [o[0] if isinstance(o, list) else o for o in llm.generate(prompts, ps)]


def check(outs):
    obj = json.loads(outs[0].text)
    assert set(obj) >= {"name", "age"} and isinstance(obj["age"], int), outs[0].text
    assert re.fullmatch(r"[a-z]{2,6}-[0-9]{2}", outs[1].text) and outs[2].text in ("yes", "no", "maybe")
    assert all(o.finish_reason == "stop" for o in outs), [o.finish_reason for o in outs]


def test_greedy_constrained_speculation_equals_plain(model, tok):
    ps = params(temperature=0)
    plain = run(LLM(model=model, tokenizer=tok, config=CFG), ps)
    check(plain)
    llm = LLM(model=model, tokenizer=tok, config=SPEC)
    spec = run(llm, ps)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.spec.stats.steps > 0
    llm.engine.check_idle()


def test_drafts_the_grammar_refuses_are_cut_and_the_output_stays_plain(model, tok):
    ps = params(temperature=0)
    prompts = [prompt_ids(f"prompt {i}", tok) for i in range(len(ps))]
    plain = [o[0] for o in LLM(model=model, tokenizer=tok, config=CFG).generate(prompts, ps)]
    llm = LLM(model=model, tokenizer=tok, config=SPEC)
    _with_oracle(llm, prompts, [[o.token_ids] for o in plain])     # right drafts, and every 3rd one wrong
    spec = [o[0] for o in llm.generate(prompts, ps)]
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = llm.engine.spec.stats
    assert stats.mean_accepted_tokens > 1.5, stats.rates()
    llm.engine.check_idle()


def test_sampled_constrained_speculation_validates(model, tok):
    llm = LLM(model=model, tokenizer=tok, config=SPEC)
    for seed in range(4):
        check(run(llm, params(temperature=1.0, seed=seed)))
    llm.engine.check_idle()


def test_a_stop_string_inside_verified_drafts_ends_the_output_there(model, tok):
    free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [prompt_ids(f"prompt {i}", tok) for i in range(3)]
    texts = [o[0].text for o in LLM(model=model, tokenizer=tok, config=CFG).generate(prompts, free)]
    middles = [t[len(t) // 2: len(t) // 2 + 2] for t in texts if len(t) > 8]
    stop = next(m for m in middles if m.strip())           # a piece of a plain answer's middle
    params = dataclasses.replace(free, stop=(stop,))
    plain = [o[0] for o in LLM(model=model, tokenizer=tok, config=CFG).generate(prompts, params)]
    llm = LLM(model=model, tokenizer=tok, config=SPEC)
    _with_oracle(llm, prompts, [[o.token_ids] for o in plain])
    spec = [o[0] for o in llm.generate(prompts, params)]
    assert [(o.token_ids, o.text, o.finish_reason) for o in spec] == [(o.token_ids, o.text, o.finish_reason)
                                                                      for o in plain]
    assert any(stop not in o.text and o.finish_reason == "stop" for o in spec)
    llm.engine.check_idle()
