r"""The DSML tool-call grammar: a Lark grammar (llguidance's dialect) deriving exactly the tool-call
blocks deepseek-recipe renders and parses back, for the tools a request offers.

One block, as the recipe spells it (V4.1; V4 writes `tool_calls`, `invoke`, `parameter` with no
space after the marker M = ｜DSML｜):

    \n\n<M calls>\n                                              the opening (absent when `opened`:
    <M invoke name="get_weather">\n                                the prompt already ends with it)
    <M parameter name="city" string="true">Paris</M parameter>\n   raw text (string schemas)
    <M parameter name="days" string="false">3</M parameter>\n      a JSON value
    </M invoke>\n
    <M invoke name="ping">\n                                       a call with no parameters: V4.1
    \n                                                             holds a blank line, V4 nothing
    </M invoke>\n
    </M calls>                                                     then only EOS

- Each invoke names one of the tools; its parameters are the schema's `properties` in the schema's
  order, the required ones always, the optional ones where the model wants them. Properties beyond
  `properties` (additionalProperties) are never emitted; a required name `properties` lacks is
  emitted with additionalProperties' schema (any JSON where that is absent or true).
- A property whose schema is a string (`type: string`, with at most pattern, format, minLength,
  maxLength), or an enum / const of strings, is `string="true"`: its raw text, which never holds the
  marker. A pattern is a search, as in JSON Schema (anchors at its top level are honoured); the
  formats date, time, date-time, uuid and ipv4 are regexes here (FORMATS). Any other property is
  `string="false"`: a JSON value valid against its schema, through llguidance's `%json`, spelled
  as the recipe renders JSON (", " and ": ", no other whitespace), with the parameters' `$defs` /
  `definitions` carried along for its `$ref`s. So are strings of another format (llguidance knows
  more formats inside JSON) and of a minLength past RAW_MIN_LENGTH.
- The marker is the token `special_ids["｜DSML｜"]` where the tokenizer has it (llguidance never
  matches literal text against a special token), else literal text. A closing tag is always "</"
  then the marker: the recipe's token-stream parser recognises the marker as its own token only,
  so a tokenizer's fused `</｜DSML｜` token (which decodes to the same text) would leave the block
  unclosed; the grammar never allows it. Where the marker is literal text, a JSON value's strings
  may still spell it (`%json` cannot exclude a substring).
- A raw value's lexeme swallows the closing "</" (with a literal marker: "</｜DSML｜"): llguidance
  lexes greedily, so a value followed by a separate "</" lexeme would eat it.

Anything the grammar cannot honour is a GrammarError naming the tool: not a function tool, a name
the recipe refuses, a parameter name the tag cannot hold, top-level keywords beyond properties and
required (anyOf, minProperties, ...), a schema or pattern llguidance refuses.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import llguidance as llg

from kvcache.engine.structured.grammar import GrammarError

MARKER = "｜DSML｜"
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]+")                 # the recipe's own check of tool names
PARAM_NAME = re.compile(r'[^\s"\\\x00-\x1f\x7f]+')       # the recipe copies names into JSON unescaped
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
RAW_KEYS = {"type", "pattern", "format", "minLength", "maxLength", "enum", "const"}
ANNOTATIONS = {"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
               "$comment", "x-guidance"}
UNSUPPORTED_TOP = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentRequired",
                   "dependentSchemas", "dependencies", "minProperties", "maxProperties", "patternProperties",
                   "propertyNames", "unevaluatedProperties", "$ref")
RAW_MIN_LENGTH = 256        # past it, the lexer's check of (length & no marker) costs more fuel than a step has
ANY_TEXT = "(?s:.*)"
NO_MARKER = f"~/{ANY_TEXT}{MARKER}{ANY_TEXT}/"


@dataclass(frozen=True)
class Dialect:
    """What follows the marker in each tag, and what a call without parameters holds."""
    calls: str
    invoke: str
    parameter: str
    no_params: str


DIALECTS = {"v4": Dialect("tool_calls", "invoke", "parameter", ""),
            "v41": Dialect(" calls", " invoke", " parameter", "\n")}

# string formats spelled as raw text (RFC 3339 dates and times, as Python's date.fromisoformat and
# RFC 3339 read them: years 0001-9999, February 29 in leap years only); any other format is a JSON string
_YEAR = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)")
_HM = "(?:[01][0-9]|2[0-3]):[0-5][0-9]"
_TIME = f"{_HM}:[0-5][0-9](?:\\.[0-9]+)?(?:Z|[+-]{_HM})"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_HEX = "[0-9a-fA-F]"
FORMATS = {"date": _DATE, "time": _TIME, "date-time": f"{_DATE}T{_TIME}",
           "uuid": "-".join(f"{_HEX}{{{n}}}" for n in (8, 4, 4, 4, 12)), "ipv4": f"(?:{_OCTET}\\.){{3}}{_OCTET}"}


@dataclass(frozen=True)
class Param:
    name: str
    schema: dict | bool
    required: bool
    raw: bool                      # string="true": raw text; else a JSON value


@dataclass(frozen=True)
class Tool:
    name: str
    params: tuple[Param, ...]


def tool_call_lark(tools: list[dict], dialect: str, opened: bool, special_ids: dict[str, int]) -> str:
    """The Lark source of one DSML block calling `tools` (Chat Completions function tools)."""
    if dialect not in DIALECTS:
        raise GrammarError(f"unknown tool-call dialect {dialect!r}; one of {', '.join(DIALECTS)}")
    parsed = read_tools(tools)
    writer = _Writer(DIALECTS[dialect], (special_ids or {}).get(MARKER))
    text = writer.grammar(parsed, opened)
    problem = _problem(text)
    if problem:
        raise _culprit(parsed, writer, problem)
    return text


# ---------------------------------------------------------------------- reading the tools
def read_tools(tools) -> list[Tool]:
    if not isinstance(tools, list) or not tools:
        raise GrammarError("a tool-call constraint needs a non-empty list of function tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise GrammarError(f"tools[{i}] is not a function tool with a name "
                               '({"type": "function", "function": {"name": ...}})')
        name = fn["name"]
        if not TOOL_NAME.fullmatch(name):
            raise GrammarError(f"tool {name!r}: a tool name is made of A-Z a-z 0-9 _ - (as the recipe requires)")
        if name in seen:
            raise GrammarError(f"tool {name!r} is defined twice")
        seen.add(name)
        out.append(Tool(name, _params(name, fn.get("parameters"))))
    return out


def _params(tool: str, schema) -> tuple[Param, ...]:
    if schema is None or schema is True or schema == {}:
        return ()
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise GrammarError(f"tool {tool!r}: its parameters must be a JSON schema of type object")
    extra = [k for k in UNSUPPORTED_TOP if k in schema]
    if extra:
        raise GrammarError(f"tool {tool!r}: its parameters use {', '.join(extra)}, which tool calls cannot "
                           "enforce (only properties and required are)")
    props, required = schema.get("properties") or {}, schema.get("required") or []
    if not isinstance(props, dict) or not isinstance(required, list) or not all(isinstance(n, str) for n in required):
        raise GrammarError(f"tool {tool!r}: properties must be an object and required a list of names")
    names = list(props) + [n for n in dict.fromkeys(required) if n not in props]
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    out = []
    for name in names:
        if not isinstance(name, str) or not PARAM_NAME.fullmatch(name) or MARKER in name:
            raise GrammarError(f"tool {tool!r}: parameter name {name!r} cannot be spelled in a DSML tag "
                               "(no whitespace, quotes, backslashes or control characters)")
        sub = props[name] if name in props else schema.get("additionalProperties", True)
        if sub is False:
            if name in required:
                raise GrammarError(f"tool {tool!r}: parameter {name!r} is required but its schema allows nothing")
            continue
        if not isinstance(sub, (dict, bool)):
            raise GrammarError(f"tool {tool!r}: parameter {name!r}'s schema is not a JSON schema")
        raw = is_raw(sub)
        if raw:
            try:
                raw_lexeme(sub)
            except GrammarError as e:
                raise GrammarError(f"tool {tool!r}, parameter {name!r}: {e}") from None
        out.append(Param(name, _with_defs(sub, defs), name in required, raw))
    return tuple(out)


def _with_defs(schema: dict | bool, defs: dict) -> dict | bool:
    """The property's schema, carrying the parameters' definitions where it refers to any."""
    if not isinstance(schema, dict) or not defs or "$ref" not in json.dumps(schema):
        return schema
    return {**defs, **schema}


def is_raw(schema) -> bool:
    """Whether the property is rendered string="true": a string the raw lexeme can constrain."""
    if not isinstance(schema, dict) or not set(schema) <= RAW_KEYS | ANNOTATIONS:
        return False
    fmt = schema.get("format", "date")
    if schema.get("type", "string") not in ("string", ["string"]) or not isinstance(fmt, str) or fmt not in FORMATS:
        return False
    if _count(schema.get("minLength")) and schema["minLength"] > RAW_MIN_LENGTH:
        return False
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        return isinstance(values, list) and bool(values) and all(isinstance(v, str) for v in values)
    return "type" in schema


# ---------------------------------------------------------------------- writing the grammar
class _Writer:
    """Lark text for one dialect and one spelling of the marker (token id or literal)."""

    def __init__(self, dialect: Dialect, marker_id: int | None):
        self.d = dialect
        self.special = marker_id is not None
        self.mark = f"<[{int(marker_id)}]>" if self.special else _lit(MARKER)

    def tag(self, before: str, after: str) -> str:
        return f"{_lit(before)} {self.mark} {_lit(after)}"

    def grammar(self, tools: list[Tool], opened: bool) -> str:
        head = "" if opened else self.tag("\n\n<", self.d.calls + ">\n") + " "
        lines = [f"start: {head}invoke+ {self.tag('</', self.d.calls + '>')}",
                 "invoke: " + " | ".join(f"t{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            lines += self.tool_rules(f"t{i}", tool)
        return "\n".join(lines) + "\n"

    def tool_rules(self, rule: str, tool: Tool) -> list[str]:
        open_tag = self.tag("<", f'{self.d.invoke} name="{tool.name}">\n')
        names = [f"{rule}_p{j}" for j in range(len(tool.params))]
        args, lines = _args(f"{rule}_args", names, [p.required for p in tool.params], self.d.no_params)
        lines.insert(0, f"{rule}: {open_tag} {args} {self.tag('</', self.d.invoke + '>' + chr(10))}")
        for name, p in zip(names, tool.params):
            lines += self.param_rules(name, p)
        return lines

    def param_rules(self, rule: str, p: Param) -> list[str]:
        kind = "true" if p.raw else "false"
        opening = self.tag("<", f'{self.d.parameter} name="{p.name}" string="{kind}">')
        expr, defs = self.value(rule, p)
        return [f"{rule}: {opening} {expr} {_lit(self.d.parameter + '>' + chr(10))}"] + defs

    def value(self, rule: str, p: Param) -> tuple[str, list[str]]:
        """The value and the closing tag up to its last word: raw text's lexeme takes the "</"."""
        if p.raw:
            close = "</" if self.special else "</" + MARKER
            term = rule.upper()
            after = f" {self.mark}" if self.special else ""
            return f"{term}{after}", [f"{term}: ({raw_lexeme(p.schema)}) {_lit(close)}"]
        schema = p.schema if isinstance(p.schema, dict) else {}
        body = json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False, allow_nan=False)
        return f"{rule}_json {_lit('</')} {self.mark}", [f"{rule}_json: %json {body}"]


def _args(rule: str, params: list[str], required: list[bool], empty: str) -> tuple[str, list[str]]:
    """The parameters, in order: the required always, each optional one or not. A call with none
    holds `empty` (V4.1 renders a blank line there), also where it leaves out every optional one.
    Returns the invoke rule's expression and the rules it needs."""
    blank = _lit(empty) if empty else ""
    if not params:
        return blank, []
    if any(required):
        return rule, [f"{rule}: " + " ".join(p if r else f"{p}?" for p, r in zip(params, required))]
    lines = []                          # {rule}_sJ: a non-empty, in-order choice of params[J:]
    for j, p in enumerate(params):
        rest = f"{rule}_s{j + 1}"
        lines.append(f"{rule}_s{j}: {p}" if j == len(params) - 1 else f"{rule}_s{j}: {p} {rest}? | {rest}")
    return (f"({rule}_s0 | {blank})" if blank else f"{rule}_s0?"), lines


def raw_lexeme(schema: dict) -> str:
    """The regex (Lark terminal syntax) of a raw string value: the enum's values or any text, as
    its pattern, format and lengths narrow it, never holding the marker."""
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None and any(MARKER in v for v in values):
        raise GrammarError(f"the value {next(v for v in values if MARKER in v)!r} holds the tool-call marker")
    parts = [f"({' | '.join(_lit(v) for v in dict.fromkeys(values))})" if values is not None else f"/{ANY_TEXT}/"]
    if "pattern" in schema:
        parts.append(f"/{_lark_regex(search_regex(schema['pattern']))}/")
    if "format" in schema:
        parts.append(f"/{FORMATS[schema['format']]}/")
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    if not _count(lo) or not (hi is None or _count(hi)):
        raise GrammarError("minLength and maxLength must be non-negative integers")
    if lo or hi is not None:
        parts.append(f"/(?s:.{{{lo},{'' if hi is None else hi}}})/")
    return " & ".join(parts + [NO_MARKER])


def search_regex(pattern: str) -> str:
    """A full-match regex for JSON Schema's `pattern` (a search): each top-level branch is padded
    with any text on the sides it does not anchor."""
    if not isinstance(pattern, str):
        raise GrammarError("a pattern must be a string")
    out = []
    for branch in _branches(pattern):
        head, tail = branch.startswith("^"), branch.endswith("$") and not _escaped(branch, len(branch) - 1)
        core = branch[1 if head else 0:len(branch) - 1 if tail else len(branch)]
        out.append(f"{'' if head else ANY_TEXT}(?:{core}){'' if tail else ANY_TEXT}")
    return "|".join(out)


def _branches(pattern: str) -> list[str]:
    """`pattern` split at its top-level `|` (outside groups, classes and escapes)."""
    out, start, depth, i = [], 0, 0, 0
    classes: list[int] = []             # where each open (nested) character class began
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 1
        elif c == "[":
            classes.append(i)
        elif classes and c == "]":
            at = classes[-1]            # a ] first in its class (after [ or [^) is a literal
            if i > at + 1 and not (i == at + 2 and pattern[at + 1] == "^"):
                classes.pop()
        elif classes:
            pass
        elif c in "()":
            depth += 1 if c == "(" else -1
        elif c == "|" and depth == 0:
            out.append(pattern[start:i])
            start = i + 1
        i += 1
    return out + [pattern[start:]]


def _escaped(text: str, at: int) -> bool:
    n = 0
    while at - 1 - n >= 0 and text[at - 1 - n] == "\\":
        n += 1
    return n % 2 == 1


def _lark_regex(rx: str) -> str:
    """`rx` inside Lark's /.../: unescaped slashes and raw line breaks escaped."""
    out, i = [], 0
    while i < len(rx):
        c = rx[i]
        if c == "\\" and i + 1 < len(rx):
            out.append(rx[i:i + 2])
            i += 2
            continue
        out.append({"/": "\\/", "\n": "\\n", "\r": "\\r"}.get(c, c))
        i += 1
    return "".join(out)


def _count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _culprit(tools: list[Tool], writer: _Writer, problem: str) -> GrammarError:
    """The first parameter whose own grammar llguidance refuses, else the whole grammar's error."""
    for tool in tools:
        for j, p in enumerate(tool.params):
            expr, defs = writer.value(f"v{j}", p)
            text = "\n".join([f"start: {expr}"] + defs) + "\n"
            own = _problem(text)
            if own:
                return GrammarError(f"tool {tool.name!r}, parameter {p.name!r}: {_short(own)}")
    return GrammarError(f"the tool-call grammar is invalid: {_short(problem)}")


def _problem(lark: str) -> str:
    """llguidance's error for the Lark source ("" when it compiles; warnings are no error)."""
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(llg.LLMatcher.grammar_from_lark(lark))
    return messages[0] if is_error and messages else ""


def _short(text: str) -> str:
    text = text.strip()
    return text if len(text) <= 400 else text[:400] + "..."
