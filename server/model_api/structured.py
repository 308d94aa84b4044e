"""A request's output constraint, from its body and the recipe's conversion, as the engine's Constraint.

    API          field                                    constraint
    chat         response_format json_schema | json_object json          (the recipe's output_constraint)
                 response_format regex                    regex          (the recipe's)
                 tool_choice "required" | a function      tool_calls, opened: the recipe's prompt ends
                                                          inside the DSML block it opened
    responses    text.format json_schema | json_object    json           (the recipe's)
                 tool_choice "required" | a function      tool_calls, opened
    messages     tool_choice {"type": "tool"}             tool_calls, opened
                 tool_choice {"type": "any"}              tool_calls, not opened (the recipe reports it
                                                          as tools with auto: constrained here)
    completions  response_format json_schema | json_object json          (no recipe: read here)
    all four     structured_outputs {json | regex | choice | grammar | json_object}, exactly one
                                                          (vLLM's extension, which the recipe ignores)

Tools with tool_choice auto are not constrained: the model may answer in text. A prompt ending
in `<think>` (thinking mode) constrains only the answer after `</think>` (after_thinking). Two
constraints at once are a 400. `compile_structured` builds the grammar in the engine's compiler
pool, off the event loop, before the engine runs: a bad schema, pattern or grammar is a 400 naming
the field it came from, before any compute (the engine then finds it compiled).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from kvcache.engine.structured.constraint import Constraint
from kvcache.engine.structured.grammar import GrammarError
from kvcache.server.model_api.errors import bad_field

STRUCTURED = "structured_outputs"
_FORMAT_FIELD = {"chat": "response_format", "responses": "text.format"}


@dataclass(frozen=True)
class Structured:
    """A request's constraint and the body field it came from (its errors' param)."""
    constraint: Constraint
    field: str


def chat_structured(api: str, body: dict, recipe_constraint, prompt_ids: list[int],
                    think_token: int | None) -> Structured | None:
    """The constraint of a chat, Responses or Messages request (`api`: the protocol's name), from
    the recipe's output_constraint and the body's structured_outputs; after_thinking when the
    prompt ends in thinking mode."""
    s = _one(_from_recipe(api, body, recipe_constraint), structured_outputs(body))
    thinking = think_token is not None and bool(prompt_ids) and prompt_ids[-1] == think_token
    if s is None or not thinking:
        return s
    return Structured(s.constraint.with_after_thinking(True), s.field)


def completion_structured(body: dict) -> Structured | None:
    """The constraint of a /v1/completions request: response_format or structured_outputs."""
    return _one(response_format(body), structured_outputs(body))


async def compile_structured(host, s: Structured | None) -> None:
    """Compile the request's grammar now (the engine's compiler caches it); a GrammarError is a
    400 naming the field."""
    if s is None:
        return
    grammars = host.grammars
    if grammars is None:
        raise bad_field(s.field, "structured outputs need the checkpoint's tokenizer.json")
    try:
        await grammars.compile(s.constraint)
    except GrammarError as e:
        raise bad_field(s.field, f"{s.field}: {e}") from None


def _one(*found: Structured | None) -> Structured | None:
    given = [s for s in found if s is not None]
    if len(given) > 1:
        raise bad_field(given[1].field, f"two output constraints at once ({given[0].field} and "
                        f"{given[1].field}): send one")
    return given[0] if given else None


def _from_recipe(api: str, body: dict, oc) -> Structured | None:
    """The recipe's output_constraint: json (schema "" is any JSON object), regex, the tool kinds."""
    if oc is None:
        return None
    field = _FORMAT_FIELD.get(api, "response_format")
    if oc.kind == "json":
        return _built(field, lambda: Constraint.json(oc.schema or None))
    if oc.kind == "regex":
        return _built(field, lambda: Constraint.regex(oc.schema))
    if oc.kind == "tool_call_required":
        tools = _narrowed(oc.schema, _chosen_tool(body))
        return _built("tool_choice", lambda: Constraint.tool_calls(tools, opened=True))
    if oc.kind == "tool_call" and api == "messages" and _choice_type(body) == "any":
        return _built("tool_choice", lambda: Constraint.tool_calls(oc.schema, opened=False))
    return None                   # tools with auto: the model may answer in text


def _choice_type(body: dict) -> str | None:
    choice = body.get("tool_choice")
    return choice.get("type") if isinstance(choice, dict) else choice


def _chosen_tool(body: dict) -> str | None:
    """The name a tool_choice names: chat {"function": {"name"}}, Responses and Messages {"name"}."""
    choice = body.get("tool_choice")
    if not isinstance(choice, dict):
        return None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else choice.get("name")
    return name if isinstance(name, str) else None


def _narrowed(tools_json: str, name: str | None) -> str:
    """The recipe's tool list (Chat Completions function tools) cut to the named tool."""
    if name is None:
        return tools_json
    tools = json.loads(tools_json)
    chosen = [t for t in tools if _tool_name(t) == name]
    if not chosen:
        raise bad_field("tool_choice", f"tool_choice names {name!r}, which is not among the request's tools")
    return tools_json if len(chosen) == len(tools) else json.dumps(chosen, separators=(",", ":"),
                                                                   ensure_ascii=False)


def _tool_name(tool: Any) -> str | None:
    if not isinstance(tool, dict):
        return None
    function = tool.get("function")
    return function.get("name") if isinstance(function, dict) else tool.get("name")


def structured_outputs(body: dict) -> Structured | None:
    """vLLM's `structured_outputs`: exactly one of json (a schema or its text), regex, choice
    (a list of strings), grammar (Lark), json_object (true: any JSON object)."""
    so = body.get(STRUCTURED)
    if so is None:
        return None
    keys = ", ".join(_BUILDERS)
    if not isinstance(so, dict):
        raise bad_field(STRUCTURED, f"{STRUCTURED} must be an object with one of {keys}")
    unknown = sorted(k for k in so if k not in _BUILDERS)
    if unknown:
        raise bad_field(STRUCTURED, f"{STRUCTURED} has an unknown key {unknown[0][:40]!r}; it takes one of {keys}")
    given = [k for k in _BUILDERS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad_field(STRUCTURED, f"{STRUCTURED} takes exactly one of {keys}; got "
                        f"{', '.join(given) if given else 'none'}")
    key = given[0]
    return _built(STRUCTURED, lambda: _BUILDERS[key](so[key]), f"{STRUCTURED}.{key}")


def _json(value: Any) -> Constraint:
    if not isinstance(value, (dict, bool, str)):
        raise ValueError("a JSON schema must be an object (or its JSON text)")
    return Constraint.json(value)


def _choice(value: Any) -> Constraint:
    if not isinstance(value, list):
        raise ValueError("choice must be a non-empty list of strings")
    return Constraint.choice(value)


def _json_object(value: Any) -> Constraint:
    if value is not True:
        raise ValueError("json_object must be true")
    return Constraint.json(None)


_BUILDERS: dict[str, Callable[[Any], Constraint]] = {"json": _json, "regex": Constraint.regex, "choice": _choice,
                                                     "grammar": Constraint.grammar, "json_object": _json_object}


def response_format(body: dict) -> Structured | None:
    """/v1/completions' response_format, as chat's: text, json_object, json_schema {schema}, regex {regex}."""
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _built("response_format", lambda: Constraint.json(None))
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_field("response_format", "response_format json_schema needs a json_schema object "
                            "({\"name\", \"schema\"})")
        schema = spec.get("schema")
        return _built("response_format", lambda: _json({} if schema is None else schema))
    if kind == "regex":
        return _built("response_format", lambda: Constraint.regex(rf.get("regex")))
    raise bad_field("response_format", "response_format must be an object whose type is text, json_object, "
                    "json_schema or regex")


def _built(field: str, build: Callable[[], Constraint], name: str | None = None) -> Structured:
    """`build()` as the field's constraint; its ValueError a 400 naming the field."""
    try:
        return Structured(build(), field)
    except (ValueError, TypeError) as e:
        raise bad_field(field, f"{name or field}: {e}") from None
