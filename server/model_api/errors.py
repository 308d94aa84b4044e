"""What a model route answers when a request fails: each API's own error shape.

    OpenAI (chat, completions, responses, models)   {"error": {"message", "type", "param", "code"}}
    Anthropic (/v1/messages*)                       {"type": "error", "error": {"type", "message"}}

A client's mistake (malformed JSON, an unknown model, a bad parameter, a prompt past the
context) is an ApiError with a 4xx status, raised where the request is parsed; anything else
that escapes a handler is a bug: a 500 in the same shape, logged with its traceback. The
daemon's token check answers in these shapes too on the model routes (`refusal`), since the
SDKs read only their own.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Literal

from aiohttp import web

from kvcache.server.errors import error_response as cache_error_response
from kvcache.server.request_state import MODEL_PATHS

log = logging.getLogger("kvcache.server.model_api")

Dialect = Literal["openai", "anthropic"]

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                 504: "timeout_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


@dataclass
class ApiError(Exception):
    """A request refused with `status`; `param` names the field at fault where there is one."""
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None     # 429: when to try again
    reason: str | None = None              # the metrics' label for a refusal (None: from the status)

    def __str__(self) -> str:
        return self.message


def bad_field(field: str, message: str) -> ApiError:
    """A 400 for one field of the request body."""
    return ApiError(400, message, param=field)


def from_conversion(status: int, body: str) -> ApiError:
    """The recipe's ConversionError (an OpenAI-shaped body) as an ApiError, for any dialect."""
    try:
        err = json.loads(body)["error"]
        return ApiError(status, str(err.get("message") or body), err.get("param"), err.get("code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return ApiError(status, body[:1000])


def dialect_for(path: str) -> Dialect:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def is_model_path(path: str) -> bool:
    return path in MODEL_PATHS


def error_body(err: ApiError, dialect: Dialect) -> dict:
    if dialect == "anthropic":
        kind = _ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": err.message}}
    kind = _OPENAI_TYPES.get(err.status, "server_error" if err.status >= 500 else "invalid_request_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def error_response(err: ApiError, dialect: Dialect) -> web.Response:
    headers = {"Retry-After": str(max(1, round(err.retry_after_s)))} if err.retry_after_s else None
    return web.json_response(error_body(err, dialect), status=err.status, headers=headers)


def internal_error(request: web.Request) -> web.Response:
    """A bug's answer (the caller logs it)."""
    log.exception("unhandled error on %s %s", request.method, request.path)
    return error_response(ApiError(500, "internal error; see the server log", code="internal_error"),
                          dialect_for(request.path))


def refusal(request: web.Request, status: int, code: str, message: str) -> web.Response:
    """The token check's 401/403 (server/request_state.py): in the API's shape on a model route,
    the cache API's elsewhere."""
    if not is_model_path(request.path):
        return cache_error_response(status, code, message)
    return error_response(ApiError(status, message, code=code), dialect_for(request.path))
