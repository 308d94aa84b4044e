"""What a request's output must match: a constraint, as plain data (no grammar library here).

    Constraint.json(schema)      a JSON value valid against the schema (None / {}: any JSON object)
    Constraint.regex(pattern)    text that the whole pattern matches
    Constraint.choice([...])     exactly one of the strings
    Constraint.grammar(lark)     text the Lark grammar derives (llguidance's Lark dialect)
    Constraint.tool_calls(tools) a DSML tool-call block calling the tools (Chat Completions function
                                 tools), each call's arguments valid against its tool's schema;
                                 `opened`: the prompt already opened the block (tool_choice
                                 "required" / a named tool, as deepseek-recipe renders it)

`after_thinking`: the constraint starts once the model closes its thinking block (`</think>`),
so the reasoning is free text and the answer is constrained. The grammar is compiled by the
engine's GrammarCompiler (engine/structured/compiler.py), against its own tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar", "tool_calls")
MAX_SPEC_BYTES = 256 * 1024        # a schema, pattern or grammar longer than this is refused


@dataclass(frozen=True)
class Constraint:
    kind: str
    spec: str                      # json: the schema as JSON text; regex: the pattern; choice: a JSON
    #                                array of strings; grammar: Lark source; tool_calls: a JSON array of tools
    after_thinking: bool = False
    opened: bool = False           # tool_calls: the prompt ends inside the opened block

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}; one of {', '.join(KINDS)}")
        if not isinstance(self.spec, str):
            raise ValueError(f"a {self.kind} constraint's spec must be a string")
        if len(self.spec.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
            raise ValueError(f"the {self.kind} constraint is {len(self.spec)} characters; at most "
                             f"{MAX_SPEC_BYTES} bytes are accepted")

    @classmethod
    def json(cls, schema: dict | bool | str | None = None, **kw) -> Constraint:
        """Any JSON object (schema None or {}), or a value valid against `schema` (a dict or its text)."""
        if schema is None or schema == {} or schema == "":
            schema = {"type": "object"}
        text = schema if isinstance(schema, str) else _dumps(schema, "schema")
        return cls("json", text, **kw)

    @classmethod
    def regex(cls, pattern: str, **kw) -> Constraint:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("a regex constraint needs a non-empty pattern string")
        return cls("regex", pattern, **kw)

    @classmethod
    def choice(cls, choices, **kw) -> Constraint:
        if isinstance(choices, str) or not isinstance(choices, (list, tuple)) or not choices \
                or not all(isinstance(c, str) for c in choices):
            raise ValueError("a choice constraint needs a non-empty list of strings")
        return cls("choice", _dumps(list(choices), "choices"), **kw)

    @classmethod
    def grammar(cls, lark: str, **kw) -> Constraint:
        if not isinstance(lark, str) or not lark.strip():
            raise ValueError("a grammar constraint needs Lark source text")
        return cls("grammar", lark, **kw)

    @classmethod
    def tool_calls(cls, tools: list | str, opened: bool = False, **kw) -> Constraint:
        text = tools if isinstance(tools, str) else _dumps(tools, "tools")
        return cls("tool_calls", text, opened=opened, **kw)

    def with_after_thinking(self, on: bool) -> Constraint:
        return dataclasses.replace(self, after_thinking=on)

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on (the compiler's cache key, with its tokenizer)."""
        return (self.kind, self.spec, self.opened)


def _dumps(value, what: str) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the constraint's {what} is not JSON: {e}") from None
