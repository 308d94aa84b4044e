"""The three chat APIs' request bodies, through deepseek-recipe, to what the engine runs.

    body ─ JSON check ─ recipe request (ChatCompletionRequest | ResponsesRequest | MessagesRequest)
         ─ .model (read first: convert consumes the request) ─ served? else 404
         ─ convert(options) ─> ConversationRequest     (a ConversionError: its status and message)
         ─ encoding.encode(conversation) ─> prompt ids (the chat template and tool syntax are the
                                                         recipe's; nothing of them is written here)
         ─ output constraint (structured.py): the recipe's output_constraint and the body's
           structured_outputs ─> Constraint | None    (compiled later, before the engine runs)
         ─ sampling fields ─> SamplingParams (with the constraint), max_tokens resolved against
           the context
         ─ cache point: just after the prompt's last <｜Assistant｜> (cache_points)
         ─> Prepared (+ the chunk generator and parsing options its StreamProcessor takes)

Everything a client can get wrong is an ApiError (4xx) raised here, before any compute (a
constraint that does not compile: when routes.py compiles it, still before the engine runs).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import deepseek_recipe as dr

from kvcache.engine.sampling import SamplingParams
from kvcache.server.model_api.errors import ApiError, bad_field, from_conversion
from kvcache.server.model_api.host import ModelHost
from kvcache.server.model_api.sampling_fields import (Fields, chat_fields, messages_fields, resolve_max_tokens,
                                                      responses_fields)
from kvcache.server.model_api.structured import Structured, chat_structured


@dataclass(frozen=True)
class Protocol:
    """One API's recipe classes and field mapping."""
    name: str                                   # "chat" | "responses" | "messages": metrics' api label
    request: type
    response: type                              # the accumulator of non-streamed answers
    fields: Callable[[dict, Any, int], Fields]
    id_prefix: str


CHAT = Protocol("chat", dr.ChatCompletionRequest, dr.ChatCompletionResponse, chat_fields, "chatcmpl-")
RESPONSES = Protocol("responses", dr.ResponsesRequest, dr.ResponsesResponse, responses_fields, "resp_")
MESSAGES = Protocol("messages", dr.MessagesRequest, dr.MessagesResponse, messages_fields, "msg_")


@dataclass
class Prepared:
    """A request ready for the engine."""
    protocol: Protocol
    request_id: str
    model: str                                  # the name the client sent (and gets back)
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool                         # usage in a streamed answer (chat: stream_options)
    generator: Any                              # the recipe's chunk generator (a StreamProcessor consumes it)
    parsing: Any                                # its ParsingOptions (stop strings, thinking stage, tools)
    cache_points: tuple[int, ...] = ()          # where exact mode saves a snapshot the next turn resumes at
    structured: Structured | None = None        # its output constraint (also in params) and the field it came from
    created: int = field(default_factory=lambda: int(time.time()))


def parse_body(raw: bytes) -> dict:
    """The request's JSON object, or a 400 saying what is wrong with it."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:   # not JSON, not UTF-8, nested past the parser
        raise ApiError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(body).__name__}")
    return body


def prepare(protocol: Protocol, raw: bytes, host: ModelHost) -> Prepared:
    body = parse_body(raw)
    request = _recipe_request(protocol, body)
    model = request.model
    host.check_model(model)
    extras = _responses_extras(request, host) if protocol is RESPONSES else None
    conv = _convert(request, host)
    ids = encode(conv, host)
    fields = protocol.fields(body, conv.inference_options, host.vocab_size)
    structured = chat_structured(protocol.name, body, conv.inference_options.output_constraint, ids,
                                 host.think_token)
    max_tokens = _max_tokens(conv, fields, len(ids), host.context_limit)
    request_id = protocol.id_prefix + uuid.uuid4().hex[:24]
    generator = protocol.request.chunk_generator(conv, request_id, model)
    if extras is not None:
        tool_map, echo = extras
        generator = generator.with_namespace_tool_map(tool_map).with_echo(echo)
    params = fields.sampling_params(max_tokens, structured.constraint if structured is not None else None)
    return Prepared(protocol, request_id, model, ids, params, conv.stream, _include_usage(protocol, body, conv.stream),
                    generator, conv.parsing_options, cache_points(ids, host.assistant_token), structured)


def cache_points(ids: list[int], assistant_token: int | None) -> tuple[int, ...]:
    """The prompt position the next turn of this conversation shares up to: just after the last
    <｜Assistant｜>. The template ends a prompt with `<｜Assistant｜><think>` (thinking) or
    `<｜Assistant｜></think>` (not), and the next turn renders this answer there as
    `</think>answer<｜end▁of▁sentence｜>`: with thinking the prompts part right after the tag; without,
    one token later, at the prompt's end, which is no cache point (a point leaves a prompt token to
    compute), so the tag it is. User text never encodes as the tag (the recipe encodes it without
    the added vocabulary), so the last one is the template's."""
    if assistant_token is None:
        return ()
    at = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] == assistant_token), None)
    return (at + 1,) if at is not None and 0 < at + 1 < len(ids) else ()


def count_tokens(raw: bytes, host: ModelHost) -> int:
    """/v1/messages/count_tokens: the prompt the request would run with (max_tokens, which the
    counting request does not carry, plays no part in it)."""
    body = parse_body(raw)
    body.setdefault("max_tokens", 1)
    request = _recipe_request(MESSAGES, body)
    host.check_model(request.model)
    return len(encode(_convert(request, host), host))


def encode(conv, host: ModelHost) -> list[int]:
    if any(m.image_sources for m in conv.conversation.messages):
        raise bad_field("messages", "images are not supported by this model")
    try:
        return host.encoding.encode(conv.conversation)
    except RuntimeError as e:
        raise ApiError(400, f"the conversation cannot be encoded: {e}") from None


def _recipe_request(protocol: Protocol, body: dict):
    try:
        return protocol.request(body)
    except (ValueError, OverflowError) as e:   # a field of the wrong type, a missing required field,
        raise ApiError(400, str(e)[:1000]) from None      # a number past 64 bits anywhere in the body


def _convert(request, host: ModelHost):
    try:
        return request.convert(host.options)
    except dr.ConversionError as e:
        raise from_conversion(e.status_code, e.body) from None
    except (ValueError, OverflowError) as e:
        raise ApiError(400, str(e)[:1000]) from None


def _responses_extras(request, host: ModelHost) -> tuple[dict, Any]:
    """What a Responses answer reports of its request; read before convert consumes it."""
    try:
        return request.namespace_tool_map(host.options), request.echo()
    except dr.ConversionError as e:
        raise from_conversion(e.status_code, e.body) from None


def _max_tokens(conv, fields: Fields, prompt_len: int, context_limit: int) -> int:
    default = 1
    if fields.max_tokens is None and prompt_len < context_limit:
        try:                               # the recipe's defaults (8192; 65536 thinking; 131072 at max effort)
            default = conv.resolve_max_tokens(prompt_len, context_limit)
        except dr.ConversionError as e:
            raise from_conversion(e.status_code, e.body) from None
    return resolve_max_tokens(prompt_len, context_limit, fields.max_tokens, default)


def _include_usage(protocol: Protocol, body: dict, stream: bool) -> bool:
    """OpenAI's chat streams carry usage only when stream_options.include_usage asks; every other
    answer carries it."""
    if protocol is not CHAT or not stream:
        return True
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True
