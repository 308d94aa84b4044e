"""POST /v1/completions: OpenAI's legacy text completions, straight to the engine.

No chat template: the prompt is text (our tokenizer, BOS first) or token ids, and the answer is
the engine's own detokenised text, stop strings cut by the engine. Streamed text holds back what
may still turn out to be the start of a stop string, and a trailing partial character. An output
constraint comes from response_format or structured_outputs (structured.py); routes.py compiles
it before the engine runs.

    {"id": "cmpl-...", "object": "text_completion", "created", "model",
     "choices": [{"index": 0, "text", "logprobs": null, "finish_reason"}],
     "usage": {"prompt_tokens", "completion_tokens", "total_tokens",
               "prompt_tokens_details": {"cached_tokens"}, "prompt_cache_hit_tokens",
               "prompt_cache_miss_tokens", "cached_tokens_by_tier"}}
"""

from __future__ import annotations

import json
import numbers
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from kvcache.engine.request import FinishReason
from kvcache.engine.sampling import SamplingParams
from kvcache.server.model_api.conversation import parse_body
from kvcache.server.model_api.errors import ApiError, bad_field, error_body, log
from kvcache.server.model_api.host import ModelHost
from kvcache.server.model_api.sampling_fields import completions_fields, resolve_max_tokens
from kvcache.server.model_api.structured import Structured, completion_structured
from kvcache.server.model_api.stream import (Deadline, EngineFailed, Outcome, RequestTimedOut, engine_outputs,
                                            next_output, sse_frame)


@dataclass
class CompletionRequest:
    request_id: str
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    structured: Structured | None = None      # its output constraint (also in params) and its field
    created: int = field(default_factory=lambda: int(time.time()))


def prepare_completion(raw: bytes, host: ModelHost) -> CompletionRequest:
    body = parse_body(raw)
    model = body.get("model")
    if not isinstance(model, str):
        raise bad_field("model", "model must be a string")
    host.check_model(model)
    ids = _prompt_ids(body.get("prompt"), host)
    fields = completions_fields(body, host.vocab_size)
    structured = completion_structured(body)
    max_tokens = resolve_max_tokens(len(ids), host.context_limit, fields.max_tokens, fields.max_tokens or 1)
    stream = body.get("stream") is True
    options = body.get("stream_options")
    include_usage = not stream or (isinstance(options, dict) and options.get("include_usage") is True)
    params = fields.sampling_params(max_tokens, structured.constraint if structured is not None else None)
    return CompletionRequest("cmpl-" + uuid.uuid4().hex[:24], model, ids, params, stream, include_usage, structured)


def _prompt_ids(prompt, host: ModelHost) -> list[int]:
    """One prompt: a string, token ids, or a list holding one of those (a batch of several is refused)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_field("prompt", "the prompt is empty")
        return host.tokenizer.encode(prompt, add_bos=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                   for t in prompt):
        bad = [t for t in prompt if not 0 <= t < host.vocab_size]
        if bad:
            raise bad_field("prompt", f"token id {bad[0]} is outside the vocabulary (0..{host.vocab_size - 1})")
        return [int(t) for t in prompt]
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad_field("prompt", "one prompt per request: send a batch as separate requests")
    raise bad_field("prompt", "prompt must be a non-empty string or a list of token ids")


class CompletionRun:
    """Drives one completion: `texts()` yields the answer's text as it becomes final."""

    def __init__(self, host: ModelHost, creq: CompletionRequest, salt: str, gone: Callable[[], bool] = lambda: False,
                 deadline: Deadline | None = None):
        self.host, self.creq, self.salt, self.gone, self.deadline = host, creq, salt, gone, deadline
        self.outcome = Outcome(prompt_tokens=len(creq.prompt_ids))
        self.shown = 0

    async def texts(self) -> AsyncIterator[str]:
        c, req, first = self.creq, None, True
        async with aclosing(engine_outputs(self.host, c.prompt_ids, c.params, c.request_id, self.salt)) as outputs:
            try:
                while (out := await next_output(outputs, self.deadline)) is not None:
                    req = out.request
                    if first:
                        first = False
                        usage = req.usage
                        self.outcome.cached_by_tier = {str(t): n for t, n in usage.cached_tokens.items() if n} \
                            if usage is not None else {}
                        self.outcome.ttft_s = req.metrics.ttft_s
                    delta = self._delta(req.text, not out.finished)
                    if delta:
                        yield delta
                    if self.gone():
                        break
            except ValueError as e:       # the engine's own check of the request, before it ran
                if req is None:
                    raise ApiError(400, str(e)) from None
                raise
            except RequestTimedOut as e:
                self._record(req)
                self.outcome.finish_reason, self.outcome.error = "abort", str(e)
                raise
        self._record(req)
        if req is None or req.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            if not self.gone():
                raise EngineFailed((req.error if req is not None else None) or "the request was aborted")

    def _delta(self, text: str, running: bool) -> str:
        upto = len(text)
        if running:                      # not what may begin a stop string, nor half a character
            while upto and text[upto - 1] == "\ufffd":
                upto -= 1
            upto = max(0, min(upto, len(text) - (max(map(len, self.creq.params.stop), default=1) - 1)))
        if upto <= self.shown:
            return ""
        delta, self.shown = text[self.shown:upto], upto
        return delta

    def _record(self, req) -> None:
        o = self.outcome
        if req is None:
            o.finish_reason = "abort"
            return
        o.finish_reason = req.finish_reason.value if req.finish_reason else "abort"
        stop_token = (req.finish_reason is FinishReason.STOP and not req.text_cut and req.output
                      and self.host.engine.engine.scheduler.is_stop_token(req, req.output[-1]))
        o.generated = len(req.output) - (1 if stop_token else 0)
        o.tpot_s = req.metrics.tpot_s(len(req.output))
        o.error = req.error


def usage_block(o: Outcome) -> dict:
    return {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.generated,
            "total_tokens": o.prompt_tokens + o.generated, "prompt_tokens_details": {"cached_tokens": o.cached},
            "prompt_cache_hit_tokens": o.cached, "prompt_cache_miss_tokens": o.prompt_tokens - o.cached,
            "cached_tokens_by_tier": o.tiers()}


def _object(c: CompletionRequest, text: str, finish: str | None, usage: dict | None) -> dict:
    obj = {"id": c.request_id, "object": "text_completion", "created": c.created, "model": c.model,
           "system_fingerprint": None,
           "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if usage is not None:
        obj["usage"] = usage
    return obj


def _finish_reason(o: Outcome) -> str:
    return "length" if o.finish_reason == "length" else "stop"


async def completion_answer(run: CompletionRun) -> dict:
    parts = []
    async with aclosing(run.texts()) as texts:
        async for delta in texts:
            parts.append(delta)
    return _object(run.creq, "".join(parts), _finish_reason(run.outcome), usage_block(run.outcome))


async def completion_events(run: CompletionRun) -> AsyncIterator[bytes]:
    """SSE: a chunk per text delta, a last one with the finish reason, one with the usage when
    stream_options.include_usage asks, then [DONE]; an engine failure: an error frame."""
    c, sent = run.creq, 0
    try:
        async with aclosing(run.texts()) as texts:
            async for delta in texts:
                sent += 1
                yield sse_frame(None, json.dumps(_object(c, delta, None, None), ensure_ascii=False))
    except ApiError:                               # before the first frame: still a 4xx
        raise
    except RequestTimedOut as e:
        if not sent:                               # no status line yet: a 504
            raise e.api_error() from None
        yield sse_frame(None, json.dumps(error_body(e.api_error(), "openai")))
        return
    except Exception as e:
        if not isinstance(e, EngineFailed):        # a bug past the status line: logged, the stream ends in shape
            log.exception("completion stream %s failed", c.request_id)
        err = {"message": f"the request failed: {e}", "type": "server_error", "param": None, "code": "server_error"}
        yield sse_frame(None, json.dumps({"error": err}))
        return
    yield sse_frame(None, json.dumps(_object(c, "", _finish_reason(run.outcome), None)))
    if c.include_usage:
        usage = _object(c, "", None, usage_block(run.outcome))
        usage["choices"] = []
        yield sse_frame(None, json.dumps(usage))
    yield sse_frame(None, "[DONE]")
