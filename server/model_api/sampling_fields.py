"""A request's sampling fields, per API, as the engine's SamplingParams, or a 400 naming the field.

    chat        temperature top_p seed max_tokens n stop presence/frequency_penalty (the recipe's,
                checked there) + max_completion_tokens top_k min_p repetition_penalty logit_bias
                ignore_eos (here); logprobs / top_logprobs refused
    responses   temperature top_p max_output_tokens (the recipe's) + the same extensions;
                top_logprobs > 0, previous_response_id, background refused
    messages    temperature top_p max_tokens stop_sequences (the recipe's) + top_k
    completions everything here: no chat template, no recipe

Stop strings are the recipe's parsing options for the three chat APIs: its StreamProcessor cuts
them, across token boundaries, and the server aborts the request there, so the engine never sees
them. The engine stops at its end-of-sequence token by itself. Fields a request does not carry
keep the engine's defaults; fields no API defines are ignored, as the SDKs' servers do.
max_tokens waits for the prompt's length (resolve_max_tokens). The output constraint
(response_format, tool_choice, structured_outputs) is structured.py's; it joins the
SamplingParams here.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from kvcache.engine.sampling import SamplingParams
from kvcache.engine.structured.constraint import Constraint
from kvcache.server.model_api.errors import ApiError, bad_field

MAX_LOGIT_BIAS_ENTRIES = 300          # OpenAI's limit
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class Fields:
    """A request's checked sampling settings: SamplingParams' keywords but max_tokens, and the
    max_tokens it asked for (None: the API's default, once the prompt's length is known)."""
    params: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None

    def sampling_params(self, max_tokens: int, constraint: Constraint | None = None) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens, constraint=constraint, **self.params)
        except ValueError as e:            # a combination the engine refuses
            raise ApiError(400, str(e)) from None


def chat_fields(body: dict, options, vocab_size: int) -> Fields:
    _refuse_logprobs(options.logprobs or bool(options.top_logprobs), "logprobs")
    params = _recipe_params(options) | _extensions(body, vocab_size)
    params |= _penalties(body)
    asked = _int_field(body, "max_completion_tokens", 1)
    return Fields(params, asked if asked is not None else options.max_tokens)


def responses_fields(body: dict, options, vocab_size: int) -> Fields:
    _refuse_logprobs(bool(options.top_logprobs), "top_logprobs")
    for name in ("previous_response_id", "background"):
        if body.get(name):
            raise bad_field(name, f"{name} is not supported: this server stores no responses; send the "
                            "whole conversation as input")
    params = _recipe_params(options) | _extensions(body, vocab_size) | _penalties(body)
    return Fields(params, options.max_tokens)


def messages_fields(body: dict, options, vocab_size: int) -> Fields:
    params = _recipe_params(options) | _extensions(body, vocab_size)
    return Fields(params, options.max_tokens)


def completions_fields(body: dict, vocab_size: int) -> Fields:
    """/v1/completions: every field is read here (no recipe behind this API)."""
    if body.get("logprobs") is not None:
        _refuse_logprobs(True, "logprobs")
    if body.get("echo"):
        raise bad_field("echo", "echo is not supported")
    if body.get("suffix"):
        raise bad_field("suffix", "suffix (insertion) is not supported")
    n, best_of = _int_field(body, "n", 1), _int_field(body, "best_of", 1)
    if (n or 1) > 1 or (best_of or 1) > 1:
        raise bad_field("n" if (n or 1) > 1 else "best_of", "only n = 1 (and best_of = 1) is supported")
    params = _extensions(body, vocab_size) | _penalties(body)
    temperature = _number_field(body, "temperature", 0.0, 2.0)
    top_p = _number_field(body, "top_p", 0.0, 1.0, low_open=True)
    seed = _int_field(body, "seed", 0, (1 << 63) - 1)
    params |= {k: v for k, v in (("temperature", temperature), ("top_p", top_p), ("seed", seed)) if v is not None}
    stop = body.get("stop")
    if stop is not None:
        params["stop"] = _stop_strings(stop)
    asked = _int_field(body, "max_tokens", 1)
    return Fields(params, COMPLETIONS_DEFAULT_MAX_TOKENS if asked is None else asked)


def resolve_max_tokens(prompt_len: int, context_limit: int, requested: int | None, default: int) -> int:
    """The max_tokens a request runs with: its own, which must fit the context beside the prompt,
    or the API's default lowered to the context left. A 400 before any compute otherwise."""
    if prompt_len >= context_limit:
        raise ApiError(400, f"the prompt has {prompt_len} tokens; this model's context holds {context_limit} "
                       "(prompt and completion together): shorten the prompt", code="context_length_exceeded")
    if requested is None:
        return max(1, min(default, context_limit - prompt_len))
    if prompt_len + requested > context_limit:
        raise ApiError(400, f"this model's context holds {context_limit} tokens; the request asks for "
                       f"{prompt_len + requested} ({prompt_len} in the prompt, {requested} for the completion): "
                       "shorten the prompt or lower max_tokens", param="max_tokens", code="context_length_exceeded")
    return requested


def _recipe_params(options) -> dict[str, Any]:
    """What the recipe parsed and checked (temperature: 1.0 in thinking mode, as DeepSeek's API)."""
    params: dict[str, Any] = {}
    if options.temperature is not None:
        params["temperature"] = float(options.temperature)
    if options.top_p is not None:
        params["top_p"] = float(options.top_p)
    if options.seed is not None:
        params["seed"] = int(options.seed)
    return params


def _extensions(body: dict, vocab_size: int) -> dict[str, Any]:
    """top_k (Anthropic's, and vLLM's extension to OpenAI's), min_p, repetition_penalty, logit_bias, ignore_eos."""
    params: dict[str, Any] = {}
    top_k = _int_field(body, "top_k", -1)
    if top_k is not None:                      # -1 (vLLM) and 0: off; so is one past the vocabulary,
        params["top_k"] = top_k if 0 < top_k < vocab_size else 0    # which keeps every token
    min_p = _number_field(body, "min_p", 0.0, 1.0, high_open=True)
    if min_p is not None:
        params["min_p"] = min_p
    rep = _number_field(body, "repetition_penalty", 0.0, 10.0, low_open=True)
    if rep is not None:
        params["repetition_penalty"] = rep
    if body.get("logit_bias") is not None:
        params["logit_bias"] = _logit_bias(body["logit_bias"], vocab_size)
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise bad_field("ignore_eos", "ignore_eos must be true or false")
        params["ignore_eos"] = ignore_eos
    return params


def _penalties(body: dict) -> dict[str, Any]:
    params = {}
    for name in ("presence_penalty", "frequency_penalty"):
        v = _number_field(body, name, -2.0, 2.0)
        if v is not None:
            params[name] = v
    return params


def _logit_bias(value: Any, vocab_size: int) -> dict[int, float]:
    if not isinstance(value, dict):
        raise bad_field("logit_bias", "logit_bias must be an object of token id -> bias")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_field("logit_bias", f"logit_bias has {len(value)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_field("logit_bias", f"logit_bias key {str(key)[:40]!r} is not a token id") from None
        if not 0 <= token < vocab_size:
            raise bad_field("logit_bias", f"logit_bias token id {token} is outside the vocabulary "
                            f"(0..{vocab_size - 1})")
        if not _is_real(bias) or not -100 <= bias <= 100:
            raise bad_field("logit_bias", f"logit_bias of token {token} must be a number in [-100, 100]")
        out[token] = float(bias)
    return out


def _stop_strings(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_field("stop", "stop must be a non-empty string or a list of them")
    return tuple(stops)


def _refuse_logprobs(asked: bool, name: str) -> None:
    if asked:
        raise bad_field(name, f"{name}: log probabilities are not supported by this server")


def _int_field(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < low or (high is not None and v > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise bad_field(name, f"Invalid {name} value {str(v)[:40]}: an integer {bounds}")
    return int(v)


def _number_field(body: dict, name: str, low: float, high: float, low_open: bool = False,
                  high_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    ok = _is_real(v) and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise bad_field(name, f"Invalid {name} value {str(v)[:40]}: a number in {bounds}")
    return float(v)


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
