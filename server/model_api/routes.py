"""The model routes, beside the cache API on the daemon's app.

    POST /v1/chat/completions  /v1/responses  /v1/messages       the recipe's three chat APIs
    POST /v1/completions                                         legacy text completions
    POST /v1/messages/count_tokens                               {"input_tokens": n}
    GET  /v1/models                                              the served name (both SDKs' list shapes)
    GET  /health   200 while the process lives
    GET  /ready    200 once the engine is warm, else 503 (loading, or shutting down)

    handler ─ ready? ─ body (at most max_body_bytes: 413) ─ prepare (4xx: the API's error shape)
            ─ compile its output constraint, if any (structured.py; off the event loop: a bad
              schema, pattern or grammar is a 400, streamed or not)
            ─ admission (429 + Retry-After) ─ Run ─ SSE frames or one JSON answer
              (past --request-timeout: aborted, a 504 or, mid-stream, an error event)
            ─ metrics and the access log, whatever the outcome

Every answer a client gets on these routes is in its API's shape: a client's mistake is a 4xx,
a bug a logged 500. The status line of a stream goes out with its first frame (the first token),
so a request the engine itself refuses still gets its 4xx.
"""

from __future__ import annotations

import contextlib
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from aiohttp import web

from kvcache.server.model_api import conversation
from kvcache.server.model_api.admission import Overloaded
from kvcache.server.model_api.completions import (CompletionRun, completion_answer, completion_events,
                                                  prepare_completion)
from kvcache.server.model_api.errors import ApiError, dialect_for, error_response, internal_error, refusal
from kvcache.server.model_api.host import ModelHost
from kvcache.server.model_api.stream import Deadline, EngineFailed, Outcome, Run, answer, sse_events
from kvcache.server.model_api.structured import compile_structured
from kvcache.server.request_state import CONFIG, PRINCIPAL, REFUSAL, principal

log = logging.getLogger("kvcache.server.model_api")

MAX_BODY_BYTES = 8 << 20
NOT_READY_RETRY_S = 2.0      # Retry-After while the model loads (a demo build takes about a minute)
DEFAULT_REQUEST_TIMEOUT_S = 600.0
_REJECTIONS = {400: "invalid_request", 404: "unknown_model", 413: "body_too_large", 503: "not_ready"}


@dataclass
class Serving:
    """What the model routes share: the host once it has loaded (None until then: 503), and the
    admission, metrics and access log (each optional)."""
    host: ModelHost | None = None
    admission: Any = None          # admission.Admission
    metrics: Any = None            # metrics.ServingMetrics
    access_log: Any = None         # access_log.AccessLog
    max_body_bytes: int = MAX_BODY_BYTES
    request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S   # past it a request is aborted (None: never)

    @property
    def ready(self) -> bool:
        return self.host is not None and self.host.ready

    def running_waiting(self) -> tuple[int, int]:
        """The engine's running and waiting requests; none while the model loads."""
        return self.host.running_waiting() if self.host is not None else (0, 0)

    def spec_stats(self):
        """The engine's speculative decoding statistics (None: none, or still loading)."""
        spec = self.host.engine.engine.spec if self.host is not None else None
        return None if spec is None else spec.stats


SERVING = web.AppKey("model_serving", Serving)


@dataclass
class Exchange:
    """One model request as the metrics and the access log see it."""
    api: str
    request_id: str | None = None
    outcome: Outcome | None = None        # set once the engine ran it
    started: float = field(default_factory=time.perf_counter)


def add_routes(app: web.Application, serving: Serving) -> None:
    app[SERVING] = serving
    app[REFUSAL] = _refused
    app.router.add_post("/v1/chat/completions", _api("chat", lambda r, x: _chat(r, x, conversation.CHAT)))
    app.router.add_post("/v1/responses", _api("responses", lambda r, x: _chat(r, x, conversation.RESPONSES)))
    app.router.add_post("/v1/messages", _api("messages", lambda r, x: _chat(r, x, conversation.MESSAGES)))
    app.router.add_post("/v1/completions", _api("completions", _completions))
    app.router.add_post("/v1/messages/count_tokens", _api("count_tokens", _count_tokens))
    app.router.add_get("/v1/models", _api("models", _models))
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)


_APIS = {"/v1/chat/completions": "chat", "/v1/responses": "responses", "/v1/messages": "messages",
         "/v1/completions": "completions", "/v1/messages/count_tokens": "count_tokens", "/v1/models": "models"}


def _refused(request: web.Request, status: int, code: str, message: str) -> web.Response:
    """The token check's refusal, in the API's shape, and in the access log for a model route."""
    api = _APIS.get(request.path)
    if api is not None:
        _log(request.app[SERVING], request, Exchange(api), status, message)
    return refusal(request, status, code, message)


def _api(api: str, serve):
    """A model route's handler: `serve(request, exchange)` with the API's errors, metrics and log."""
    async def handler(request: web.Request) -> web.StreamResponse:
        s, x = request.app[SERVING], Exchange(api)
        if s.metrics is not None and api not in ("models", "count_tokens"):
            s.metrics.arrived(api)
        try:
            response = await serve(request, x)
        except ApiError as e:
            if s.metrics is not None and x.outcome is None:
                s.metrics.rejected(api, e.reason or _REJECTIONS.get(e.status, f"http_{e.status}"))
            _observe(s, x)               # one the engine ran (a stream timed out before its first frame)
            response = error_response(e, dialect_for(request.path))
            _log(s, request, x, response.status, e.message)
            return response
        except EngineFailed as e:        # the engine failed it (it logged why): a 500; past its deadline: 504
            _observe(s, x)
            response = error_response(e.api_error(), dialect_for(request.path))
            _log(s, request, x, e.status, str(e))
            return response
        except ConnectionError:          # the client went away mid-answer: nobody to answer
            log.debug("client closed the connection during %s", request.path)
            _observe(s, x)
            _log(s, request, x, 499, "client closed the connection")
            raise
        except Exception as e:
            response = internal_error(request)
            _log(s, request, x, 500, f"{type(e).__name__}: {e}")
            return response
        _observe(s, x)
        _log(s, request, x, response.status, x.outcome.error if x.outcome else None)
        return response
    return handler


async def _chat(request: web.Request, x: Exchange, protocol) -> web.StreamResponse:
    s = _serving(request)
    prep = conversation.prepare(protocol, await read_body(request, s.max_body_bytes), s.host)
    x.request_id = prep.request_id
    await compile_structured(s.host, prep.structured)
    with _admitted(s, request, len(prep.prompt_ids) + prep.params.max_tokens):
        run = Run(s.host, prep, _cache_salt(request), gone=lambda: _gone(request),
                  deadline=Deadline.after(s.request_timeout_s))
        x.outcome = run.outcome
        if prep.stream:
            return await _stream(request, sse_events(run, dialect_for(request.path)))
        return web.json_response(await answer(run))


async def _completions(request: web.Request, x: Exchange) -> web.StreamResponse:
    s = _serving(request)
    creq = prepare_completion(await read_body(request, s.max_body_bytes), s.host)
    x.request_id = creq.request_id
    await compile_structured(s.host, creq.structured)
    with _admitted(s, request, len(creq.prompt_ids) + creq.params.max_tokens):
        run = CompletionRun(s.host, creq, _cache_salt(request), gone=lambda: _gone(request),
                            deadline=Deadline.after(s.request_timeout_s))
        x.outcome = run.outcome
        if creq.stream:
            return await _stream(request, completion_events(run))
        return web.json_response(await completion_answer(run))


async def _count_tokens(request: web.Request, x: Exchange) -> web.Response:
    s = _serving(request)
    return web.json_response({"input_tokens": conversation.count_tokens(await read_body(request, s.max_body_bytes),
                                                                        s.host)})


async def _models(request: web.Request, x: Exchange) -> web.Response:
    """OpenAI's model list, with the fields Anthropic's SDK reads too (both list GET /v1/models)."""
    host = _serving(request).host
    name = host.served_model_name
    model = {"id": name, "object": "model", "created": 0, "owned_by": "kvcache", "type": "model",
             "display_name": name, "created_at": "1970-01-01T00:00:00Z"}
    return web.json_response({"object": "list", "data": [model], "has_more": False, "first_id": name,
                              "last_id": name})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    is_ready = request.app[SERVING].ready
    return web.json_response({"ready": is_ready}, status=200 if is_ready else 503)


def _serving(request: web.Request) -> Serving:
    s = request.app[SERVING]
    if not s.ready:
        raise ApiError(503, "the model is not ready yet (loading or shutting down): retry shortly",
                       retry_after_s=NOT_READY_RETRY_S)
    return s


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body, at most `limit` bytes (413 past it, before reading more than that)."""
    too_large = ApiError(413, f"the request body is larger than this server takes ({limit >> 20} MiB)")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    data = bytearray()
    while chunk := await request.content.read(1 << 16):
        data += chunk
        if len(data) > limit:
            raise too_large
    return bytes(data)


@contextlib.contextmanager
def _admitted(s: Serving, request: web.Request, tokens: int):
    """The request's place under the admission limits, held until its answer is done."""
    if s.admission is None:
        yield
        return
    try:
        ticket = s.admission.enter(principal(request).tenant, tokens)
    except Overloaded as e:
        raise ApiError(e.status, e.message, retry_after_s=e.retry_after_s or None, reason=e.reason,
                       code="rate_limit_exceeded" if e.status == 429 else None) from None
    with ticket:
        yield


async def _stream(request: web.Request, frames: AsyncIterator[bytes]) -> web.StreamResponse:
    """SSE. The first frame is awaited before the status line, so an error before it is a 4xx."""
    async with aclosing(frames) as it:
        first = await anext(it, None)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        if first is not None:
            await response.write(first)
            async for frame in it:
                await response.write(frame)
        await response.write_eof()
    return response


def _cache_salt(request: web.Request) -> str:
    """The tenant's sharing group's name, or the tenant's own ([server] cache_sharing)."""
    return request.app[CONFIG].cache_salt(principal(request).tenant)


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _observe(s: Serving, x: Exchange) -> None:
    o = x.outcome
    if s.metrics is None or o is None or o.finish_reason is None:
        return
    if o.ttft_s is not None:
        s.metrics.first_token(o.ttft_s)
    s.metrics.finished(x.api, o.finish_reason, o.prompt_tokens, o.generated, dict(o.cached_by_tier),
                       time.perf_counter() - x.started, o.tpot_s)


def _log(s: Serving, request: web.Request, x: Exchange, status: int, error: str | None) -> None:
    if s.access_log is None:
        return
    o, who = x.outcome, request.get(PRINCIPAL)      # (none when its token was refused)
    s.access_log.write({"method": request.method, "path": request.path, "status": status,
                        "tenant": who.tenant if who is not None else None, "api": x.api, "request_id": x.request_id,
                        "prompt_tokens": o.prompt_tokens if o else None, "cached_tokens": o.cached if o else None,
                        "generated_tokens": o.generated if o else None, "ttft_s": o.ttft_s if o else None,
                        "duration_s": time.perf_counter() - x.started,
                        "finish_reason": o.finish_reason if o else None, "error": error})
