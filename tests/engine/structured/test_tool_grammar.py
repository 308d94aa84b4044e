"""The DSML tool-call grammar against deepseek-recipe 0.2.0 itself, in both dialects: the recipe's
own rendering of calls is derived token by token, random sampling under the grammar's masks always
parses back (through the recipe's StreamProcessor) into calls whose arguments validate against
their tools' schemas, and what breaks the format or a schema is refused."""

import json
import re

import deepseek_recipe as dr
import jsonschema
import llguidance as llg
import llguidance.numpy as llg_np
import numpy as np
import pytest

from kvcache.engine.structured.compiler import GrammarCompiler, default_limits
from kvcache.engine.structured.constraint import Constraint
from kvcache.engine.structured.grammar import GrammarError
from kvcache.engine.structured.tool_grammar import DIALECTS, MARKER, tool_call_lark
from kvcache.engine.tokenizer import build_demo_tokenizer

N_VOCAB, EOS = 512, 1
MODELS = {"v4": ("DeepSeek-V4-Pro", dr.DeepseekV4Encoding), "v41": ("DeepSeek-V4.1-Flash", dr.DeepseekV41Encoding)}
POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"], "additionalProperties": False}


def fn(name, parameters=None):
    f = {"name": name, "description": f"the {name} tool"}
    if parameters is not None:
        f["parameters"] = parameters
    return {"type": "function", "function": f}


TOOLS = [
    fn("get_weather", {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "a city"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "opts": {"type": "object", "properties": {"hourly": {"type": "boolean"}, "tags": {
            "type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}}}}}),
    fn("search", {"type": "object", "required": ["query", "limit"], "additionalProperties": False, "properties": {
        "query": {"type": "string", "pattern": "^[a-z][a-z ]{0,11}$"},
        "limit": {"type": "number", "minimum": 0, "maximum": 50},
        "code": {"type": "string", "pattern": "[0-9]{3}", "maxLength": 8},
        "when": {"type": "string", "format": "date"}}}),
    fn("ping"),
    fn("plot", {"type": "object", "$defs": {"point": POINT}, "properties": {
        "at": {"$ref": "#/$defs/point"}, "label": {"type": ["string", "null"], "maxLength": 5},
        "kind": {"const": "dot"}, "id": {"type": "string", "format": "uuid"},
        "host": {"type": "string", "format": "ipv4"}, "stamp": {"type": "string", "format": "date-time"},
        "clock": {"type": "string", "format": "time"}}}),
]
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in TOOLS}


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer(384)


@pytest.fixture(scope="module")
def recipe_tok(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path))
    return dr.Tokenizer.from_file(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def ll_tok(tok):
    return llg.LLTokenizer(tok.backend.to_str(), n_vocab=N_VOCAB, eos_token=EOS)


@pytest.fixture(scope="module")
def special(tok):
    return {m: tok.token_id(m) for m in (MARKER, "</" + MARKER)}


def matcher(ll_tok, special, dialect, opened, tools=TOOLS):
    text = llg.LLMatcher.grammar_from_lark(tool_call_lark(tools, dialect, opened, special))
    m = llg.LLMatcher(ll_tok, text, log_level=0, limits=default_limits())
    assert not m.is_error(), m.get_error()
    return m


def request(dialect, choice, messages=None, tools=TOOLS):
    body = {"model": MODELS[dialect][0], "messages": [{"role": "user", "content": "hi"}] + (messages or []),
            "tools": tools, "tool_choice": choice, "thinking": {"type": "disabled"}}
    return dr.ChatCompletionRequest(body).convert(dr.ConversionOptions())


def dsml_ids(tok, text):
    """Token ids as the recipe encodes DSML text: the marker its own token, the rest plain text."""
    ids = []
    for i, piece in enumerate(text.split(MARKER)):
        ids += ([tok.token_id(MARKER)] if i else []) + tok.encode(piece)
    return ids


def opening(dialect):
    return f"\n\n<{MARKER}{DIALECTS[dialect].calls}>\n"


def rendered_block(tok, recipe_tok, dialect, calls):
    """The recipe's rendering of an assistant turn calling `calls`: (its text, its token ids)."""
    tool_calls = [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                  for i, (n, a) in enumerate(calls)]
    messages = [{"role": "assistant", "content": "", "tool_calls": tool_calls}]
    messages += [{"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in tool_calls]
    conv = request(dialect, "auto", messages).conversation
    prompt = MODELS[dialect][1]().render_conversation(conv).prompt
    start = prompt.rindex(opening(dialect))
    text = prompt[start:prompt.index("<｜end▁of▁sentence｜>", start)]
    ids = MODELS[dialect][1]().with_tokenizer(recipe_tok).encode(conv)
    end = ids.index(EOS, len(ids) - 2 * len(text))
    begin = next(k for k in range(end, -1, -1) if tok.decode(ids[k:end]) == text)
    return text, ids[begin:end]


def parse(recipe_tok, dialect, opened, ids):
    """The calls the recipe's StreamProcessor reads from the generated ids: (content, tool_calls)."""
    conv = request(dialect, "required" if opened else "auto")
    model = MODELS[dialect][0]
    proc = dr.StreamProcessor(dr.ChatCompletionRequest.chunk_generator(conv, "t", model), conv.parsing_options,
                              recipe_tok)
    answer = dr.ChatCompletionResponse("t", model, 0, 1, 0)
    for chunk in [dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=1)),
                  dr.InferenceChunk.tokens(ids), dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop)]:
        for out in proc.push(chunk):
            answer.accumulate(out)
    for out in proc.finish():
        answer.accumulate(out)
    message = json.loads(answer.to_json())["choices"][0]["message"]
    return message.get("content"), message.get("tool_calls") or []


CALLS = [("get_weather", {"city": 'Paris <b>"x"</b>\nnext line', "opts": {"hourly": True, "tags": ["a", "b"]}}),
         ("ping", {}),
         ("search", {"query": "cheap trips", "limit": 2.5, "when": "2026-12-03"}),
         ("plot", {"at": {"x": 1, "y": -2}, "label": None, "kind": "dot", "host": "10.0.0.255",
                   "stamp": "2024-02-29T23:59:59.5+01:00"}),
         ("plot", {})]


@pytest.mark.parametrize("dialect", ["v4", "v41"])
@pytest.mark.parametrize("opened", [False, True])
def test_the_recipes_own_rendering_is_derived_token_by_token(tok, recipe_tok, ll_tok, special, dialect, opened):
    text, ids = rendered_block(tok, recipe_tok, dialect, CALLS)
    assert ids == dsml_ids(tok, text)             # the recipe encodes the marker alone, "</" as text
    skip = len(dsml_ids(tok, opening(dialect))) if opened else 0
    assert tok.decode(ids[:skip]) == (opening(dialect) if opened else "")
    m = matcher(ll_tok, special, dialect, opened)
    for i, t in enumerate(ids[skip:]):
        assert m.consume_token(t), (i, tok.decode(ids[skip:skip + i + 1]), m.get_error())
    assert m.is_accepting() and m.is_stopped()
    _, calls = parse(recipe_tok, dialect, opened, ids[skip:])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS


def sample(m, rng, bias, cap=3000):
    """Tokens drawn under the grammar's masks from random logits, until it stops (or EOS)."""
    mask = np.zeros((1, N_VOCAB // 32), dtype=np.int32)
    out = []
    while not m.is_stopped() and len(out) < cap:
        llg_np.fill_next_token_bitmask(m, mask, 0)
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little").astype(bool)
        assert allowed.any(), m.get_error()
        logits = np.where(allowed, rng.standard_normal(N_VOCAB) + bias, -np.inf)
        token = int(np.argmax(logits))
        if token == EOS:
            break
        assert m.consume_token(token), m.get_error()
        out.append(token)
    return out


@pytest.mark.parametrize("dialect", ["v4", "v41"])
@pytest.mark.parametrize("opened", [False, True])
def test_random_samples_parse_into_calls_valid_against_the_tools(tok, recipe_tok, ll_tok, special, dialect, opened):
    # a push toward tokens that close things (quotes, brackets, "<", the marker), so that outputs end
    # well under the cap: unpushed, a raw string would run for hundreds of tokens. "<" and "</" alike,
    # so that another call or parameter is as likely as the closing tag
    bias = np.array([2.5 if re.search(r'["\]}<]', tok.decode([t])) else 0.0 for t in range(N_VOCAB)])
    bias[special[MARKER]] = 4.0
    base = matcher(ll_tok, special, dialect, opened)
    rng = np.random.default_rng(7 + len(dialect) + opened)
    names, most, invoke = set(), 0, f'{MARKER}{DIALECTS[dialect].invoke} name="'
    for n in range(16):
        m = base.deep_copy()
        ids = sample(m, rng, bias)
        assert m.is_stopped() and m.is_accepting(), (n, len(ids), tok.decode(ids)[-200:])
        content, calls = parse(recipe_tok, dialect, opened, ids)
        assert not content and len(calls) == tok.decode(ids).count(invoke) >= 1, tok.decode(ids)
        most = max(most, len(calls))
        for call in calls:
            name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
            jsonschema.validate(args, SCHEMAS[name], format_checker=FORMATS)
            names.add(name)
    assert len(names) >= 3 and most >= 2           # most of the tools, and blocks of several calls


def refused(m, ids) -> bool:
    return m.validate_tokens(ids) < len(ids)


@pytest.mark.parametrize("dialect", ["v4", "v41"])
def test_wrong_names_missing_parameters_and_bad_values_are_refused(tok, recipe_tok, ll_tok, special, dialect):
    text, ids = rendered_block(tok, recipe_tok, dialect, [("get_weather", {"city": "Rome", "days": 3})])
    m = matcher(ll_tok, special, dialect, False)
    assert not refused(m, ids)
    p = DIALECTS[dialect].parameter
    city = f'<{MARKER}{p} name="city" string="true">Rome</{MARKER}{p}>\n'
    bad = {"tool name": text.replace("get_weather", "get_wether"),
           "required parameter left out": text.replace(city, ""),
           "unknown parameter": text.replace('name="days"', 'name="weeks"'),
           "out of range": text.replace(">3<", ">30<"),
           "JSON for raw text": text.replace('name="city" string="true"', 'name="city" string="false"'),
           "parameters out of order": text.replace(city, "").replace("</" + MARKER + p + ">\n",
                                                                      "</" + MARKER + p + ">\n" + city, 1)}
    for what, variant in bad.items():
        assert variant != text and refused(m, dsml_ids(tok, variant)), what
    # the fused `</｜DSML｜` token decodes to the same text, but the recipe does not close on it
    fused = tok.encode(text)
    assert special["</" + MARKER] in fused and refused(m, fused)
    assert parse(recipe_tok, dialect, False, fused)[1][0]["function"]["arguments"].count(MARKER) > 0


@pytest.mark.parametrize("pattern", ["^a|b$", "ab", "^[0-9]{3}$", "x/y", "[|]z", r"\d+\|"])
def test_a_raw_pattern_is_a_search_as_in_json_schema(tok, ll_tok, special, pattern):
    tools = [fn("f", {"required": ["s"], "properties": {"s": {"type": "string", "pattern": pattern}}})]
    base = matcher(ll_tok, special, "v41", True, tools)
    for value in ["ab", "xab", "ax", "xb", "123", "1234", "x/y", "|z", "z", "7|", "a|b"]:
        text = (f'<{MARKER} invoke name="f">\n<{MARKER} parameter name="s" string="true">{value}'
                f'</{MARKER} parameter>\n</{MARKER} invoke>\n</{MARKER} calls>')
        assert (not refused(base.deep_copy(), dsml_ids(tok, text))) == bool(re.search(pattern, value)), value


def test_a_literal_marker_and_a_tool_without_parameters(tok, ll_tok):
    """Without the marker among the special ids it is literal text (here the tokenizer's text
    `｜DSML｜` still encodes as the special token, so the ids are the marker's bytes one by one)."""
    tools = [fn("get_weather", SCHEMAS["get_weather"]), fn("ping", {"type": "object", "properties": {}})]
    m = matcher(ll_tok, {}, "v41", False, tools)
    text = (f'\n\n<{MARKER} calls>\n<{MARKER} invoke name="ping">\n\n</{MARKER} invoke>\n'
            f'<{MARKER} invoke name="get_weather">\n<{MARKER} parameter name="city" string="true">a</b> c'
            f'</{MARKER} parameter>\n</{MARKER} invoke>\n</{MARKER} calls>')
    ids = [i for ch in text for i in tok.encode(ch)]
    assert not refused(m, ids)
    assert refused(m.deep_copy(), [i for ch in text.replace("a</b> c", f"a{MARKER}") for i in tok.encode(ch)])


def test_a_required_name_without_a_property_takes_additional_properties_schema(tok, ll_tok, special):
    tools = [fn("f", {"required": ["n"], "additionalProperties": {"type": "integer"}})]
    m = matcher(ll_tok, special, "v41", True, tools)
    call = (f'<{MARKER} invoke name="f">\n<{MARKER} parameter name="n" string="false">{{}}</{MARKER} parameter>\n'
            f'</{MARKER} invoke>\n</{MARKER} calls>')
    assert not refused(m, dsml_ids(tok, call.format("7")))
    assert refused(m, dsml_ids(tok, call.format('"7"')))
    assert refused(m, dsml_ids(tok, f'<{MARKER} invoke name="f">\n\n</{MARKER} invoke>\n</{MARKER} calls>'))


def test_the_compiler_builds_tool_call_matchers(tok, special):
    compiler = GrammarCompiler(tok.backend.to_str(), N_VOCAB, EOS, "v41", special_ids=special)
    try:
        m = compiler.matcher(Constraint.tool_calls(TOOLS, opened=True))
        text = f'<{MARKER} invoke name="ping">\n\n</{MARKER} invoke>\n</{MARKER} calls>'
        assert all(m.consume(t) for t in dsml_ids(tok, text)) and m.stopped
    finally:
        compiler.close()


BAD_TOOLS = {
    "not a list": ({"type": "function"}, "non-empty list"),
    "empty": ([], "non-empty list"),
    "not a function tool": ([{"type": "retrieval"}], "tools[0] is not a function tool"),
    "no name": ([{"type": "function", "function": {"parameters": {}}}], "tools[0] is not a function tool"),
    "a name with a space": ([fn("get weather")], "'get weather'"),
    "a name with a quote": ([fn('f"x')], "tool 'f\"x'"),
    "twice": ([fn("f"), fn("f")], "defined twice"),
    "not an object": ([fn("f", {"type": "array"})], "of type object"),
    "anyOf at the top": ([fn("f", {"type": "object", "anyOf": [{"required": ["a"]}]})], "anyOf"),
    "a parameter name with a space": ([fn("f", {"properties": {"a b": {}}})], "parameter name 'a b'"),
    "required but false": ([fn("f", {"properties": {"a": False}, "required": ["a"]})], "allows nothing"),
    "an unknown type": ([fn("f", {"properties": {"a": {"type": "strin"}}})], "tool 'f', parameter 'a'"),
    "a look-ahead pattern": ([fn("f", {"properties": {"a": {"type": "string", "pattern": "(?=x)y"}}})],
                             "tool 'f', parameter 'a'"),
    "a bad required": ([fn("f", {"properties": {}, "required": [{"a": 1}]})], "a list of names"),
    "a format that is a list": ([fn("f", {"properties": {"a": {"type": "string", "format": ["x"]}}})],
                                "tool 'f', parameter 'a'"),
    "a bad maxLength": ([fn("f", {"properties": {"a": {"type": "string", "maxLength": -1}}})], "maxLength"),
    "an enum value with the marker": ([fn("f", {"properties": {"a": {"enum": [f"x{MARKER}"]}}})], "marker"),
    "a dangling $ref": ([fn("f", {"properties": {"a": {"$ref": "#/$defs/nope"}}})], "tool 'f', parameter 'a'"),
}


@pytest.mark.parametrize("case", list(BAD_TOOLS))
def test_bad_tool_lists_raise_grammar_errors(special, case):
    tools, message = BAD_TOOLS[case]
    with pytest.raises(GrammarError, match=re.escape(message)):
        tool_call_lark(tools, "v41", False, special)


def test_an_unknown_dialect_is_a_grammar_error(special):
    with pytest.raises(GrammarError, match="dialect"):
        tool_call_lark(TOOLS, "v5", False, special)
