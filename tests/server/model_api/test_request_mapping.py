"""Without a server: each API's sampling fields as SamplingParams (or a 400 naming the field),
max_tokens against the context, and one config file read by both the daemon and the engine."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvcache.engine.config import CacheConfig, EngineConfig
from kvcache.server.config import ServerConfig
from kvcache.server.daemon import Overrides, load_configs
from kvcache.server.model_api.errors import ApiError, error_body, from_conversion
from kvcache.server.model_api.host import engine_config
from kvcache.server.reconfigure import ENGINE_SECTIONS, read_config_file
from kvcache.server.model_api.sampling_fields import (chat_fields, completions_fields, messages_fields,
                                                      resolve_max_tokens, responses_fields)

VOCAB = 512


def recipe_options(**kw):
    """What the recipe's InferenceOptions carry, as a stand-in."""
    base = dict(max_tokens=None, temperature=1.0, top_p=1.0, seed=None, logprobs=False, top_logprobs=None)
    return SimpleNamespace(**{**base, **kw})


def test_chat_fields_map_to_sampling_params():
    body = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "logit_bias": {"17": 5, "3": -100}, "max_completion_tokens": 9,
            "ignore_eos": True}
    fields = chat_fields(body, recipe_options(temperature=0.0, top_p=0.9, seed=7), VOCAB)
    assert fields.max_tokens == 9
    p = fields.sampling_params(9)
    assert (p.temperature, p.top_p, p.seed, p.top_k, p.min_p, p.repetition_penalty) == (0.0, 0.9, 7, 5, 0.1, 1.2)
    assert (p.presence_penalty, p.frequency_penalty, p.ignore_eos) == (0.5, -0.5, True)
    assert p.logit_bias == {17: 5.0, 3: -100.0} and p.max_tokens == 9
    assert chat_fields({}, recipe_options(max_tokens=4), VOCAB).max_tokens == 4      # the recipe's max_tokens
    assert chat_fields({"top_k": -1}, recipe_options(), VOCAB).params["top_k"] == 0  # vLLM's "off"
    for past in (VOCAB, 10 ** 30):                   # keeps every token: off, never a huge slice in the sampler
        assert completions_fields({"top_k": past}, VOCAB).params["top_k"] == 0
    assert completions_fields({"top_k": VOCAB - 1}, VOCAB).params["top_k"] == VOCAB - 1


@pytest.mark.parametrize("body, field", [
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"min_p": 1}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"logit_bias": {"512": 1}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"top_k": True}, "top_k")])
def test_a_bad_field_is_a_400_naming_it(body, field):
    with pytest.raises(ApiError) as e:
        chat_fields(body, recipe_options(), VOCAB)
    assert e.value.status == 400 and e.value.param == field


def test_logprobs_and_stored_responses_are_refused():
    with pytest.raises(ApiError, match="not supported"):
        chat_fields({}, recipe_options(logprobs=True), VOCAB)
    with pytest.raises(ApiError, match="not supported"):
        responses_fields({}, recipe_options(top_logprobs=3), VOCAB)
    with pytest.raises(ApiError) as e:
        responses_fields({"previous_response_id": "resp_1"}, recipe_options(), VOCAB)
    assert e.value.param == "previous_response_id"
    assert messages_fields({"top_k": 3}, recipe_options(max_tokens=8), VOCAB).params["top_k"] == 3


def test_completions_fields():
    f = completions_fields({"temperature": 0, "stop": "##", "seed": 3}, VOCAB)
    assert f.max_tokens == 16 and f.params == {"temperature": 0.0, "seed": 3, "stop": ("##",)}
    for body, field in (({"n": 2}, "n"), ({"best_of": 3}, "best_of"), ({"logprobs": 1}, "logprobs"),
                        ({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"), ({"stop": [""]}, "stop"),
                        ({"temperature": 2.5}, "temperature"), ({"top_p": 0}, "top_p"), ({"seed": -1}, "seed")):
        with pytest.raises(ApiError) as e:
            completions_fields(body, VOCAB)
        assert e.value.param == field


def test_max_tokens_against_the_context():
    assert resolve_max_tokens(10, 100, None, 8192) == 90          # a default lowered to the context left
    assert resolve_max_tokens(10, 100, 90, 1) == 90
    for prompt, asked in ((10, 91), (100, None), (150, 1)):
        with pytest.raises(ApiError) as e:
            resolve_max_tokens(prompt, 100, asked, 8192)
        assert e.value.status == 400 and e.value.code == "context_length_exceeded"


def test_error_shapes():
    err = from_conversion(400, json.dumps({"error": {"message": "Invalid top_p", "type": "invalid_request_error",
                                                     "param": None, "code": "invalid_request_error"}}))
    assert error_body(err, "openai") == {"error": {"message": "Invalid top_p", "type": "invalid_request_error",
                                                   "param": None, "code": "invalid_request_error"}}
    assert error_body(err, "anthropic") == {"type": "error", "error": {"type": "invalid_request_error",
                                                                       "message": "Invalid top_p"}}
    assert error_body(ApiError(429, "busy"), "anthropic")["error"]["type"] == "rate_limit_error"
    assert error_body(ApiError(500, "bug"), "openai")["error"]["type"] == "server_error"
    assert from_conversion(400, "not json").message == "not json"


def test_one_config_file_for_the_daemon_and_the_engine(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text("[store]\nwrite_policy = \"write-back\"\n[server]\nport = 9000\n[dram]\ncapacity_mib = 64\n"
                    "[engine]\nnum_blocks = 32\n[cache]\nmode = \"replay\"\n")
    store, server = load_configs(Overrides(config_file=str(path), data_dir=str(tmp_path / "data")))
    assert server.port == 9000 and store.write_policy == "write-back"
    assert EngineConfig.load(str(path)) == EngineConfig(num_blocks=32, cache=CacheConfig(mode="replay"))
    sections = {k: v for k, v in read_config_file(str(path)).items() if k in ENGINE_SECTIONS}
    assert engine_config(sections).cache.mode == "replay"                   # the file's [cache]
    assert engine_config({}).cache == CacheConfig(mode="exact")             # a model server's default
    assert engine_config({}, "http://h:1", "replay").cache == CacheConfig(mode="replay", store="http://h:1")


def test_sharing_groups_salt_a_groups_tenants_with_its_first_and_are_checked(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text('[server]\ncache_sharing = [["acme", "acme-batch", "acme-eval"], ["bravo", "bravo-2"]]\n')
    _, server = load_configs(Overrides(config_file=str(path), data_dir=str(tmp_path / "data")))
    assert [server.cache_salt(t) for t in ("acme", "acme-batch", "acme-eval", "bravo-2", "carol", "")] == \
        ["acme", "acme", "acme", "bravo", "carol", ""]
    assert ServerConfig().cache_salt("acme-batch") == "acme-batch"         # no groups: every tenant its own
    for bad, says in (([["acme"]], "fewer than two"), ([["a", "b"], ["b", "c"]], "'b' is listed twice"),
                      ([["a", "a"]], "listed twice"), (["acme"], "list of groups"), ("acme", "list of groups"),
                      ([["a", ""]], "not a tenant name"), ([["a", 7]], "not a tenant name")):
        with pytest.raises(ValueError, match=says):
            ServerConfig.from_dict({"cache_sharing": bad}, env={})
