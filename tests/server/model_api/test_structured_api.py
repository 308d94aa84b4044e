"""Structured outputs through the official SDKs against `kvcache serve --model demo:v41-tiny`
(random weights: whatever the model answers is the grammar's doing): JSON schemas (chat
response_format, Responses text.format, /v1/completions), vLLM's structured_outputs (regex, choice,
Lark grammar), streamed and not; forced tool calls (chat required / named, Responses named,
Anthropic tool / any, any in thinking mode); the 400s of bad constraints; a JSON cut by max_tokens."""

from __future__ import annotations

import json
import re

import anthropic
import jsonschema
import llguidance as llg
import openai
import pytest

from tests.server.model_api.conftest import MODEL, NO_THINKING

pytestmark = pytest.mark.timeout(600)

ITEM = {"type": "object", "additionalProperties": False, "required": ["c", "n", "ok"],
        "properties": {"c": {"type": "string", "pattern": "^[a-z]{1,2}$"},      # (strict drops maxLength)
                       "n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}}}
WEATHER = {"type": "object", "required": ["city"],
           "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,3}$"}}}
PING = {"type": "object", "properties": {}}
SCHEMAS = {"get_weather": WEATHER, "ping": PING}
CHAT_TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}}
              for name, schema in SCHEMAS.items()]
RESPONSES_TOOLS = [{"type": "function", "name": name, "parameters": schema} for name, schema in SCHEMAS.items()]
ANTHROPIC_TOOLS = [{"name": name, "input_schema": schema} for name, schema in SCHEMAS.items()]
LIST_GRAMMAR = 'start: "[" word ("," word)? ("," word)? "]"\nword: "red" | "green" | "blue"\n'
LIST_LANGUAGE = r"\[(red|green|blue)(,(red|green|blue)){0,2}\]"
END_THINKING = {"7": 100}        # the demo tokenizer's </think>: the thinking block closes at once
OFF = {"type": "disabled"}


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def chat(client, text: str = "Answer in json", extra: dict | None = None, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                          **{"max_tokens": 64, "temperature": 0, "seed": 1,
                                             "extra_body": {**NO_THINKING, **(extra or {})}, **kw})


def json_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "item", "schema": schema, "strict": strict}}


def valid(text: str, schema: dict):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


# ------------------------------------------------------------------ answers that match
def test_chat_json_schema_streamed_and_not(oai):
    r = chat(oai, response_format=json_format(ITEM))
    assert r.choices[0].finish_reason == "stop"
    text = r.choices[0].message.content
    valid(text, ITEM)
    chunks = list(chat(oai, response_format=json_format(ITEM), stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text                                 # greedy: the same valid JSON, in deltas
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_responses_text_format_json_schema(oai):
    r = oai.responses.create(model=MODEL, input="Answer in json", max_output_tokens=64, temperature=0,
                             reasoning={"effort": "none"},
                             text={"format": {"type": "json_schema", "name": "item", "schema": ITEM, "strict": True}})
    assert r.status == "completed"
    valid(r.output_text, ITEM)


def test_json_after_thinking(oai):
    """Thinking on: the reasoning is free, the answer after </think> matches the schema."""
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Think, answer in json"}],
                                    max_tokens=64, seed=3, response_format=json_format(ITEM),
                                    logit_bias=END_THINKING)
    assert r.choices[0].finish_reason == "stop"
    valid(r.choices[0].message.content, ITEM)


def test_structured_outputs_regex_choice_and_grammar(oai, claude):
    r = chat(oai, "Letters", {"structured_outputs": {"regex": r"[a-c]{2,5}x"}})
    assert re.fullmatch(r"[a-c]{2,5}x", r.choices[0].message.content) and r.choices[0].finish_reason == "stop"
    colours = ["red", "green", "blue"]
    r = chat(oai, "A colour", {"structured_outputs": {"choice": colours}}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in r if c.choices) in colours
    r = chat(oai, "A list", {"structured_outputs": {"grammar": LIST_GRAMMAR}})
    text = r.choices[0].message.content
    assert re.fullmatch(LIST_LANGUAGE, text)
    assert lark_accepts(LIST_GRAMMAR, text)
    m = claude.messages.create(model=MODEL, max_tokens=16, thinking=OFF, messages=[{"role": "user", "content": "Hi"}],
                               extra_body={"temperature": 0, "structured_outputs": {"choice": colours}})
    assert m.content[0].text in colours and m.stop_reason == "end_turn"
    r = oai.responses.create(model=MODEL, input="Letters", max_output_tokens=16, temperature=0,
                             reasoning={"effort": "none"}, extra_body={"structured_outputs": {"regex": "[xyz]{3}"}})
    assert re.fullmatch("[xyz]{3}", r.output_text)


def lark_accepts(grammar: str, text: str) -> bool:
    """llguidance's own matcher over the text's bytes (a byte tokenizer: no model vocabulary)."""
    tok = llg.LLTokenizer(llg.TokenizerWrapper(ByteTokenizer()))
    m = llg.LLMatcher(tok, llg.LLMatcher.grammar_from_lark(grammar))
    return all(m.consume_token(b) for b in text.encode()) and m.is_accepting()


class ByteTokenizer:
    """One token per byte, and an EOS: enough for llguidance to parse text."""
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text, **kw):
        return list(text.encode() if isinstance(text, str) else text)


def test_completions_take_response_format_and_structured_outputs(oai):
    r = oai.completions.create(model=MODEL, prompt="An item:", max_tokens=64, temperature=0,
                               extra_body={"response_format": json_format(ITEM)})
    assert r.choices[0].finish_reason == "stop"
    valid(r.choices[0].text, ITEM)
    one = oai.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=0,
                                 extra_body={"structured_outputs": {"regex": "x"}})
    assert one.choices[0].text == "x" and one.usage.completion_tokens == 1      # its last token is no stop token
    chunks = list(oai.completions.create(model=MODEL, prompt="Letters:", max_tokens=16, temperature=0, stream=True,
                                         extra_body={"structured_outputs": {"regex": "[ab]{4}"}}))
    assert re.fullmatch("[ab]{4}", "".join(c.choices[0].text for c in chunks if c.choices))


# ------------------------------------------------------------------ forced tool calls
def check_calls(calls, names) -> None:
    assert calls, "no tool call"
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(arguments, SCHEMAS[name])


def test_chat_tool_choice_required_and_named(oai):
    r = chat(oai, "Weather?", tools=CHAT_TOOLS, tool_choice="required", max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls([(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls],
                SCHEMAS)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(oai, "Weather?", tools=CHAT_TOOLS, tool_choice=named, max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls([(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls],
                {"get_weather"})


def test_responses_named_tool(oai):
    r = oai.responses.create(model=MODEL, input="Weather?", max_output_tokens=200, temperature=0,
                             reasoning={"effort": "none"}, tools=RESPONSES_TOOLS,
                             tool_choice={"type": "function", "name": "ping"})
    calls = [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]
    check_calls(calls, {"ping"})


@pytest.mark.parametrize("choice, names", [({"type": "tool", "name": "get_weather"}, {"get_weather"}),
                                           ({"type": "any"}, SCHEMAS)])
def test_anthropic_tool_and_any(claude, choice, names):
    m = claude.messages.create(model=MODEL, max_tokens=200, thinking=OFF, tools=ANTHROPIC_TOOLS, tool_choice=choice,
                               messages=[{"role": "user", "content": "Weather?"}], extra_body={"temperature": 0})
    assert m.stop_reason == "tool_use"
    check_calls([(b.name, b.input) for b in m.content if b.type == "tool_use"], names)


def test_anthropic_any_after_thinking(claude):
    """Thinking on (the recipe leaves `any` unconstrained there): the answer after </think> is a tool call."""
    m = claude.messages.create(model=MODEL, max_tokens=200, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
                               messages=[{"role": "user", "content": "Weather?"}],
                               extra_body={"seed": 5, "logit_bias": END_THINKING})
    assert m.stop_reason == "tool_use"
    check_calls([(b.name, b.input) for b in m.content if b.type == "tool_use"], SCHEMAS)
    with pytest.raises(anthropic.BadRequestError, match="Thinking mode does not support"):
        claude.messages.create(model=MODEL, max_tokens=8, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "tool", "name": "ping"},
                               messages=[{"role": "user", "content": "Weather?"}])


# ------------------------------------------------------------------ refusals and cut answers
@pytest.mark.parametrize("extra, kw, says", [
    ({"structured_outputs": {"json": {"type": 5}}}, {}, "json constraint is invalid"),
    ({"structured_outputs": {"regex": "(("}}, {}, "regex constraint is invalid"),
    ({"structured_outputs": {"grammar": "start: ("}}, {}, "grammar constraint is invalid"),
    ({"structured_outputs": {"regex": "a"}}, {"response_format": json_format(ITEM)}, "two output constraints"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, {}, "exactly one of"),
    ({"structured_outputs": {"pattern": "a"}}, {}, "unknown key 'pattern'"),
    ({}, {"response_format": json_format({"type": 5})}, "Invalid json schema"),
])
def test_bad_constraints_are_400s(oai, server, extra, kw, says):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match=re.escape(says)) as e:
            chat(oai, extra=extra, stream=stream, **kw)
        assert e.value.status_code == 400
    assert server.call("GET", "/health")[0] == 200


def test_bad_constraints_elsewhere_and_the_server_stays_healthy(oai, claude):
    with pytest.raises(anthropic.BadRequestError, match="regex constraint is invalid"):
        claude.messages.create(model=MODEL, max_tokens=8, thinking=OFF, messages=[{"role": "user", "content": "Hi"}],
                               extra_body={"structured_outputs": {"regex": "(("}})
    with pytest.raises(openai.BadRequestError, match="json constraint is invalid") as e:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=8,
                               extra_body={"structured_outputs": {"json": {"type": 5}}})
    assert e.value.body["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError, match="two output constraints"):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={
            "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}})
    r = chat(oai, "Still there?", max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_json_cut_by_max_tokens_is_length(oai):
    r = chat(oai, response_format=json_format(ITEM), max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    text = r.choices[0].message.content
    assert text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(text)                       # an unfinished JSON
    r = oai.responses.create(model=MODEL, input="Answer in json", max_output_tokens=3, temperature=0,
                             reasoning={"effort": "none"},
                             text={"format": {"type": "json_schema", "name": "item", "schema": ITEM}})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
