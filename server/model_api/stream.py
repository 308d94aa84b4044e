"""One request through the engine and the recipe's StreamProcessor, as SSE or as one JSON answer.

    engine.generate(ids, params) ─ each output ─┬─ first: InferenceChunk.ready(PromptUsage(prompt,
                                                │          cached by the prefix cache))
                                                ├─ new token ids ─ InferenceChunk.tokens (a stop
                                                │   token never: it ends as finish(Stop); an answer
                                                │   its grammar completed ends in a real token, kept)
                                                ├─ finished: finish(Stop) | finish(Length);
                                                │   aborted or failed: EngineFailed; past the
                                                │   request's deadline: RequestTimedOut (aborted)
                                                └─ processor.finished after a push (a stop string
                                                    cut the answer): abort the engine request
    processor chunks ─> SSE  `event: <name>\\ndata: <json>\\n\\n` ... (`data: [DONE]` for chat)
                     or accumulated into the API's response object

The final usage block gets the per-tier split of the cached tokens as an extension field,
`cached_tokens_by_tier`. Leaving the generator early (a client gone, a stop string, an error)
closes the engine's generator, whose `finally` aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import deepseek_recipe as dr

from kvcache.engine.request import FinishReason
from kvcache.kvstore.types import TierName
from kvcache.server.model_api.conversation import CHAT, RESPONSES, Prepared
from kvcache.server.model_api.errors import ApiError, Dialect, error_body, log
from kvcache.server.model_api.host import ModelHost

_FINISH = {FinishReason.STOP: dr.InferenceFinishReason.Stop, FinishReason.LENGTH: dr.InferenceFinishReason.Length}


class EngineFailed(Exception):
    """The engine ended the request with an error (or aborted it) before its answer was complete."""
    status, code = 500, "server_error"

    def api_error(self) -> ApiError:
        return ApiError(self.status, f"the request failed: {self}", code=self.code)


class RequestTimedOut(EngineFailed):
    """The request ran past the server's request timeout: aborted, its blocks freed."""
    status, code = 504, "request_timeout"


@dataclass(frozen=True)
class Deadline:
    """When a request must be done by (event-loop time) and the timeout that set it."""
    at: float
    timeout_s: float

    @classmethod
    def after(cls, timeout_s: float | None) -> Deadline | None:
        return None if timeout_s is None else cls(asyncio.get_running_loop().time() + timeout_s, timeout_s)


async def next_output(outputs, deadline: Deadline | None):
    """The engine's next output (None once there are no more), or RequestTimedOut past the
    deadline. Only this wait is timed (never a write to the client): its cancellation lands in
    the engine's generator, which aborts the request and frees its blocks."""
    if deadline is None:
        return await anext(outputs, None)
    try:
        async with asyncio.timeout_at(deadline.at):
            return await anext(outputs, None)
    except TimeoutError:
        raise RequestTimedOut(f"it ran past the server's request timeout ({deadline.timeout_s:g} s) "
                              "and was aborted") from None


@dataclass
class Outcome:
    """What a request came to: for its usage block, metrics and the access log."""
    prompt_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    generated: int = 0
    finish_reason: str | None = None      # the engine's (stop, length, abort, error)
    error: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    started: float = field(default_factory=time.perf_counter)

    @property
    def cached(self) -> int:
        return sum(self.cached_by_tier.values())

    def tiers(self) -> dict[str, int]:
        """Every tier, zero where it served nothing: one shape for clients to read."""
        return {str(t): self.cached_by_tier.get(str(t), 0) for t in TierName}


def engine_outputs(host: ModelHost, prompt_ids: list[int], params, request_id: str, salt: str,
                   cache_points: tuple[int, ...] = ()):
    """The engine's outputs for one request. `salt` (the tenant's, or its sharing group's:
    ServerConfig.cache_salt) keys its cached prefixes apart from every other salt's: no hit
    across them, so no timing channel between tenants that share no group."""
    return host.engine.generate(prompt_ids, params, request_id=request_id, cache_salt=salt,
                                cache_points=cache_points)


class Run:
    """Drives one request; `chunks()` yields the processor's chunks, a list per engine output."""

    def __init__(self, host: ModelHost, prep: Prepared, salt: str, gone: Callable[[], bool] = lambda: False,
                 deadline: Deadline | None = None):
        self.host, self.prep, self.salt, self.gone, self.deadline = host, prep, salt, gone, deadline
        self.outcome = Outcome(prompt_tokens=len(prep.prompt_ids))
        self.started = False

    async def chunks(self) -> AsyncIterator[list]:
        processor = dr.StreamProcessor(self.prep.generator, self.prep.parsing, self.host.recipe_tokenizer)
        prep = self.prep
        outputs = engine_outputs(self.host, prep.prompt_ids, prep.params, prep.request_id, self.salt,
                                 prep.cache_points)
        req = None
        try:
            while (out := await next_output(outputs, self.deadline)) is not None:
                req = out.request
                for chunk in self._inputs(out):
                    yield processor.push(chunk)
                    if processor.finished:         # a stop string: the answer is complete
                        self._record(req, "stop")
                        yield processor.finish()
                        return
                if self.gone():
                    self._record(req, "abort")
                    return
            self._record(req, req.finish_reason.value if req and req.finish_reason else "abort")
            if req is None or req.finish_reason not in _FINISH:
                raise EngineFailed((req.error if req is not None else None) or "the request was aborted")
            yield processor.finish()
        except ValueError as e:                 # the engine's own check of the request, before it ran
            if req is None:
                raise ApiError(400, str(e)) from None
            raise
        except RequestTimedOut as e:
            self._record(req, "abort")
            self.outcome.error = str(e)
            raise
        finally:
            await outputs.aclose()              # aborts the engine request if it is still running
            if not processor.finished:
                processor.close()

    def _inputs(self, out) -> list:
        """The processor's inputs for one engine output."""
        req, chunks = out.request, []
        if not self.started:
            self.started = True
            self._start(req)
            chunks.append(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(
                prompt_tokens=self.outcome.prompt_tokens, prompt_cache_hit_tokens=self.outcome.cached)))
        tokens = out.new_tokens
        if out.finished and req.finish_reason is FinishReason.STOP and tokens and self._stop_token(req, tokens[-1]):
            tokens = tokens[:-1]                 # the stop token: pushed as text it would show in the answer
        if tokens:
            self.outcome.generated += len(tokens)
            chunks.append(dr.InferenceChunk.tokens(tokens))
        if out.finished and req.finish_reason in _FINISH:
            chunks.append(dr.InferenceChunk.finish(_FINISH[req.finish_reason]))
        return chunks

    def _stop_token(self, req, token: int) -> bool:
        """Whether the request's last token is a stop token (not one its completed grammar ended on)."""
        return self.host.engine.engine.scheduler.is_stop_token(req, token)

    def _start(self, req) -> None:
        usage = req.usage
        if usage is not None:
            self.outcome.cached_by_tier = {str(t): n for t, n in usage.cached_tokens.items() if n}
        self.outcome.ttft_s = req.metrics.ttft_s

    def _record(self, req, reason: str) -> None:
        o = self.outcome
        o.finish_reason = reason
        if req is None:
            return
        o.tpot_s = req.metrics.tpot_s(len(req.output))
        o.error = req.error


def with_usage(text: str, outcome: Outcome, keep_usage: bool) -> str:
    """A chunk's JSON with the per-tier split in its usage block (top-level `usage`, or a
    Responses event's `response.usage`) and the engine's count of generated tokens; without
    keep_usage, the block dropped (an OpenAI chat stream that did not ask for it)."""
    if '"usage":{' not in text:
        return text
    obj = json.loads(text)
    holder = obj if isinstance(obj.get("usage"), dict) else obj.get("response")
    if not isinstance(holder, dict) or not isinstance(holder.get("usage"), dict):
        return text
    if keep_usage:
        _own_counts(holder["usage"], outcome)
        holder["usage"]["cached_tokens_by_tier"] = outcome.tiers()
    else:
        holder.pop("usage")
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _own_counts(usage: dict, outcome: Outcome) -> None:
    """The output counts as the engine generated them (every token pushed, the stop token not):
    the recipe counts from the text it decoded, which a model emitting special tokens inside its
    answer (the demo's random weights do) makes come out lower, and its reasoning count higher."""
    n = outcome.generated
    for key in ("completion_tokens", "output_tokens"):
        if isinstance(usage.get(key), int):
            usage[key] = n
    if isinstance(usage.get("total_tokens"), int):
        usage["total_tokens"] = outcome.prompt_tokens + n
    for key in ("completion_tokens_details", "output_tokens_details"):
        details = usage.get(key)
        if isinstance(details, dict) and isinstance(details.get("reasoning_tokens"), int):
            details["reasoning_tokens"] = min(details["reasoning_tokens"], n)


def sse_frame(name: str | None, data: str) -> bytes:
    return ((f"event: {name}\n" if name else "") + f"data: {data}\n\n").encode()


async def sse_events(run: Run, dialect: Dialect) -> AsyncIterator[bytes]:
    """The request's answer as SSE frames; an engine failure ends it with an error event in the
    API's shape (the status line went out with the first frame)."""
    response, prep, n = run.prep.protocol.response, run.prep, 0
    try:
        async with aclosing(run.chunks()) as chunk_lists:      # closed at once if the client goes
            async for chunks in chunk_lists:
                for chunk in chunks:
                    n += 1
                    yield sse_frame(response.sse_event_name(chunk), with_usage(chunk.to_json(), run.outcome,
                                                                               prep.include_usage))
    except ApiError:                     # before the first frame: still a 4xx (routes._stream)
        raise
    except RequestTimedOut as e:
        if not n:                        # no status line yet: the API's 504
            raise e.api_error() from None
        yield error_event(prep, dialect, e.api_error(), n)
        return
    except EngineFailed as e:
        yield error_event(prep, dialect, e.api_error(), n)
        return
    except Exception as e:               # a bug past the status line: the stream still ends in the API's shape
        log.exception("model stream %s failed", prep.request_id)
        yield error_event(prep, dialect, ApiError(500, f"the request failed: internal error ({type(e).__name__}); "
                                                  "see the server log", code="server_error"), n)
        return
    done = response.sse_done_data()
    if done is not None:
        yield sse_frame(None, done)


def error_event(prep: Prepared, dialect: Dialect, err: ApiError, sequence: int) -> bytes:
    body = error_body(err, dialect)
    if prep.protocol is CHAT:
        return sse_frame(None, json.dumps(body))
    if prep.protocol is RESPONSES:
        err = body["error"]
        return sse_frame("error", json.dumps({"type": "error", "code": err["code"], "message": err["message"],
                                              "param": None, "sequence_number": sequence}))
    return sse_frame("error", json.dumps(body))


async def answer(run: Run) -> dict:
    """The request's whole answer (non-streamed), as the API's response object."""
    prep, acc = run.prep, None
    async with aclosing(run.chunks()) as chunk_lists:
        async for chunks in chunk_lists:
            if acc is None:
                o = run.outcome
                acc = prep.protocol.response(prep.request_id, prep.model, prep.created, o.prompt_tokens, o.cached)
            for chunk in chunks:
                acc.accumulate(chunk)
    if acc is None:                               # the client left before the first token
        raise EngineFailed("the request ended before its first token")
    return json.loads(with_usage(acc.to_json(), run.outcome, True))
