"""What a request of the daemon carries: the app's shared state, the principal its token names,
and the token check that sets it.

    request ─> auth_middleware: Authorization ─> identify (token -> Principal) ─> request[PRINCIPAL]
    handler ─> principal(request), require_admin(request), app[STORE], app[CONFIG] ...

Every module of the daemon reads request state through this one; none of them reads another
handler module for it, so the handlers, the upload path and the shared-memory path import this
module and never each other.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from aiohttp import web

from kvcache.kvstore.store import BlockStore
from kvcache.server.batch_get import GetBudget
from kvcache.server.config import ServerConfig
from kvcache.server.errors import error_response
from kvcache.server.metrics import Metrics
from kvcache.server.quota import Quotas

STORE = web.AppKey("store", BlockStore)
CONFIG = web.AppKey("config", ServerConfig)    # a reconfigure.LiveConfig: reads go to the settings in force
POOL = web.AppKey("pool", ThreadPoolExecutor)  # the store's calls run here, never on the event loop
METRICS = web.AppKey("metrics", Metrics)
QUOTAS = web.AppKey("quotas", Quotas)
GET_BUDGET = web.AppKey("get_budget", GetBudget)
TOKENED = web.AppKey("tokened_transports", weakref.WeakSet)   # connections that showed a valid token
# how a refused token is answered: (request, status, code, message) -> Response; unset: error_response.
# The model routes set it, so that a refusal there comes in their API's error shape
REFUSAL = web.AppKey("refusal", object)
OPEN_PATHS = ("/healthz", "/health", "/ready")   # liveness and readiness: anyone may ask
METRICS_PATHS = ("/metrics", *OPEN_PATHS)   # all a metrics token may read
# the model server's routes (server/model_api): there an x-api-key header (the anthropic SDK's)
# is a bearer token too
MODEL_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
               "/v1/messages/count_tokens", "/v1/models")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request acts as, from its bearer token."""
    tenant: str = ""
    admin: bool = True
    quota: int | None = None
    shm: bool = True       # may map the shared DRAM arena (it holds every tenant's bytes)
    metrics_only: bool = False   # a metrics token: /metrics, nothing else


PRINCIPAL = web.RequestKey("principal", Principal)
OPEN = Principal()     # no tokens configured (loopback only): everything allowed, one tenant
NOBODY = Principal(admin=False, shm=False, metrics_only=True)   # /healthz without a token: no rights at all
METRICS_FORBIDDEN = (403, "forbidden", "this is a metrics token: it reads /metrics only")
UNAUTHORIZED = (401, "unauthorized", "missing or unknown bearer token (Authorization: Bearer <token>)")


def authenticate(cfg: ServerConfig, authorization: str, path: str) -> Principal | None:
    """The principal of an Authorization header value on `path`; None when the token is missing or
    unknown, and for a metrics token anywhere but METRICS_PATHS (it has no tenant to act as)."""
    who = identify(cfg, authorization, path)
    if who is not None and who.metrics_only and path not in METRICS_PATHS:
        return None
    return who


def identify(cfg: ServerConfig, authorization: str, path: str) -> Principal | None:
    """The principal of an Authorization header value; None when the token is missing or unknown."""
    if not cfg.auth_required:
        return OPEN
    if path in OPEN_PATHS:      # anyone may ask; the answer acts as nobody
        return NOBODY
    presented = authorization[7:] if authorization.startswith("Bearer ") else ""
    match = cfg.match_token(presented)
    if match is None:
        return None
    return Principal(match.tenant, match.admin, match.quota_bytes, match.admin or match.shared_memory, match.metrics)


def credentials(request: web.Request) -> str:
    """The request's Authorization value; on a model route without one, its x-api-key as a bearer token."""
    authorization = request.headers.get("Authorization", "")
    api_key = request.headers.get("x-api-key", "")
    if not authorization and api_key and request.path in MODEL_PATHS:
        return f"Bearer {api_key}"
    return authorization


def refuse(request: web.Request, status: int, code: str, message: str) -> web.Response:
    shape = request.app.get(REFUSAL)
    return error_response(status, code, message) if shape is None else shape(request, status, code, message)


@web.middleware
async def auth_middleware(request: web.Request, handler):
    who = identify(request.app[CONFIG], credentials(request), request.path)
    if who is None:
        return refuse(request, *UNAUTHORIZED)
    if who.metrics_only and request.path not in METRICS_PATHS:   # it has no tenant: never near the data
        return refuse(request, *METRICS_FORBIDDEN)
    request[PRINCIPAL] = who
    if who is not NOBODY and request.transport is not None:   # a token's connection: never dropped for room
        request.app[TOKENED].add(request.transport)
    return await handler(request)


def principal(request: web.Request) -> Principal:
    return request[PRINCIPAL]


def require_admin(request: web.Request) -> None:
    if not request[PRINCIPAL].admin:
        raise web.HTTPForbidden(text="this operation needs an admin token")


async def call(request: web.Request, fn, *args, **kw):
    """fn(*args, **kw) in the store's thread pool: an fsync never stalls the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[POOL], functools.partial(fn, *args, **kw))
