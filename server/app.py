"""The `kvcache serve` HTTP daemon: thin aiohttp handlers over one BlockStore.

    request ─> error middleware ─> auth middleware (token -> tenant, admin) ─> metrics ─> handler
    handler:  parse (hex keys -> the tenant's stored keys) ─> store call in a worker thread ─> encode

The store is synchronous and thread-safe; its calls run in a thread pool so an fsync never
stalls the event loop. Handlers map the client's keys into the tenant's key space
(`kvstore.hashing.tenant_key`) on the way in and answer with the client's keys on the way
out. See docs/api.md for the wire contract.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from aiohttp import web

from kvcache.server import tenancy
from kvcache.server.batch_get import GetBudget, GetStream, send_block, stream_blocks
from kvcache.server.metrics import Metrics
from kvcache.server.quota import PendingBytes, Quotas, put_within_quota
from kvcache.server.config import ServerConfig
from kvcache.server.errors import error_middleware, parse_json, quiet_bad_requests
from kvcache.server.errors import error_response as _error
from kvcache.kvstore import wire
from kvcache.kvstore.errors import BlockFormatError
from kvcache.kvstore.hashing import tenant_key
from kvcache.kvstore.store import BlockStore, PutItem
from kvcache.kvstore.types import TensorSpec, is_real

log = logging.getLogger(__name__)
STORE = web.AppKey("store", BlockStore)
CONFIG = web.AppKey("config", ServerConfig)
POOL = web.AppKey("pool", ThreadPoolExecutor)
METRICS = web.AppKey("metrics", Metrics)
QUOTAS = web.AppKey("quotas", Quotas)
TENANT = web.RequestKey("tenant", str)
ADMIN = web.RequestKey("admin", bool)
QUOTA = web.RequestKey("quota", object)
SHM = web.RequestKey("shm", bool)
METRICS_ONLY = web.RequestKey("metrics_only", bool)
METRICS_PATHS = ("/metrics", "/healthz")   # all a metrics token may read
GET_BUDGET = web.AppKey("get_budget", GetBudget)
TOKENED = web.AppKey("tokened_transports", weakref.WeakSet)   # connections that showed a valid token


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request acts as, from its bearer token."""
    tenant: str = ""
    admin: bool = True
    quota: int | None = None
    shm: bool = True       # may map the shared DRAM arena (it holds every tenant's bytes)
    metrics_only: bool = False   # a metrics token: /metrics, nothing else


OPEN = Principal()     # no tokens configured (loopback only): everything allowed, one tenant
NOBODY = Principal(admin=False, shm=False, metrics_only=True)   # /healthz without a token: no rights at all


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
    if path == "/healthz":      # anyone may ask; the answer acts as nobody
        return NOBODY
    presented = authorization[7:] if authorization.startswith("Bearer ") else ""
    match = cfg.match_token(presented)
    if match is None:
        return None
    return Principal(match.tenant, match.admin, match.quota_bytes, match.admin or match.shared_memory, match.metrics)


METRICS_FORBIDDEN = (403, "forbidden", "this is a metrics token: it reads /metrics only")
UNAUTHORIZED = (401, "unauthorized", "missing or unknown bearer token (Authorization: Bearer <token>)")


@web.middleware
async def auth_middleware(request: web.Request, handler):
    who = identify(request.app[CONFIG], request.headers.get("Authorization", ""), request.path)
    if who is None:
        return _error(*UNAUTHORIZED)
    if who.metrics_only and request.path not in METRICS_PATHS:   # it has no tenant: never near the data
        return _error(*METRICS_FORBIDDEN)
    request[TENANT], request[ADMIN], request[QUOTA], request[SHM] = who.tenant, who.admin, who.quota, who.shm
    request[METRICS_ONLY] = who.metrics_only
    if who is not NOBODY and request.transport is not None:   # a token's connection: never dropped for room
        request.app[TOKENED].add(request.transport)
    return await handler(request)


def principal(request: web.Request) -> Principal:
    return Principal(request[TENANT], request[ADMIN], request[QUOTA], request[SHM])


@web.middleware
async def metrics_middleware(request: web.Request, handler):
    t0 = time.perf_counter()
    route = request.match_info.route.resource
    endpoint = route.canonical if route is not None else "unmatched"
    response = await handler(request)
    request.app[METRICS].observe_request(endpoint, response.status, time.perf_counter() - t0)
    return response


async def _call(request: web.Request, fn, *args, **kw):
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[POOL], functools.partial(fn, *args, **kw))


def _require_admin(request: web.Request) -> None:
    if not request[ADMIN]:
        raise web.HTTPForbidden(text="this operation needs an admin token")


HEX_KEY = re.compile(r"(?:[0-9a-fA-F]{2})+")    # bytes.fromhex alone would take "00 ff" too


def _key(request: web.Request, text: str) -> bytes:
    if not HEX_KEY.fullmatch(text):
        raise BlockFormatError(f"block keys are hex digits, two per byte, got {text[:40]!r}")
    key = bytes.fromhex(text)
    if not 1 <= len(key) <= 64:
        raise BlockFormatError(f"block keys are 1-64 bytes, got {len(key)}")
    return tenant_key(request[TENANT], key)


async def _keys(request: web.Request) -> tuple[list[bytes], dict]:
    body = await json_body(request)
    keys = body.get("keys") if isinstance(body, dict) else None
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise BlockFormatError('expected {"keys": ["<hex>", ...]}')
    if len(keys) > request.app[CONFIG].max_keys:
        raise web.HTTPRequestEntityTooLarge(max_size=request.app[CONFIG].max_keys, actual_size=len(keys),
                                            text=f"at most {request.app[CONFIG].max_keys} keys per request")
    return [_key(request, k) for k in keys], body


# ---------------------------------------------------------------- handlers
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def register_namespace(request: web.Request) -> web.Response:
    """The tenant's own namespace (server/tenancy.py), registered or renamed; answers the id the
    client computes. A new one past server.max_namespaces_per_tenant is a 429."""
    ns = tenancy.namespace_to_register(await json_body(request), request[TENANT])
    cfg = request.app[CONFIG]         # without tokens there is one trust domain: no per-tenant limit
    before = await _call(request, request.app[STORE].save_namespace, ns,
                         cfg.max_namespaces_per_tenant if cfg.auth_required else None)
    return web.json_response(tenancy.registration_reply(ns, before))


async def put_block(request: web.Request) -> web.Response:
    limit = request.app[CONFIG].max_block_bytes
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    ns_hex = request.headers.get("X-KVCache-Namespace")
    if not ns_hex:
        raise BlockFormatError("missing X-KVCache-Namespace header (the namespace id from POST /v1/namespaces)")
    key = _key(request, request.match_info["key"])      # malformed input is a 400 before any 422
    layout, ttl = _layout(request.headers.get("X-KVCache-Layout")), request.headers.get("X-KVCache-TTL")
    ns = tenancy.stored_namespace_id(request[TENANT], ns_hex, request.app[STORE].namespaces)
    app, who = request.app, principal(request)
    pending = PendingBytes(app[QUOTAS], app[STORE], who, app[CONFIG].max_pending_upload_bytes)
    try:                     # the body counts as pending (quota, daemon-wide bound) as it arrives
        body = await _read_at_most(request, limit, pending)
        item = PutItem(key, body, ns, layout, request[TENANT],
                       float(ttl) if ttl else None)
        r = await _call(request, put_within_quota, app[STORE], app[QUOTAS], who, [item], pending)
    finally:
        pending.release()
    return web.json_response(_put_json(r))


def json_limit(config) -> int:
    """The largest JSON body taken: a full key list (max_keys keys of up to 64 bytes, in hex and
    quoted) and room for the rest. From the live config, so a reconfigure that raises max_keys
    raises it too (aiohttp's client_max_size is fixed when the app is built)."""
    return config.max_keys * 136 + (1 << 20)


async def json_body(request: web.Request):
    """The request's JSON body, within json_limit (413 past it); malformed JSON is a 400."""
    return parse_json(await _read_at_most(request, json_limit(request.app[CONFIG])), "request body")


async def _read_at_most(request: web.Request, limit: int, pending: PendingBytes | None = None) -> bytes:
    """The body, or 413 once it passes `limit` (a chunked body has no Content-Length to check
    first); 408 when it takes longer than server.request_timeout_s to arrive. With `pending`,
    each chunk is counted there before it is kept."""
    body = bytearray()
    try:
        async with asyncio.timeout(request.app[CONFIG].request_timeout_s):
            async for chunk in request.content.iter_chunked(1 << 20):
                if pending is not None:
                    pending.add(len(chunk))
                body += chunk
                if len(body) > limit:
                    raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(body))
    except TimeoutError:
        raise web.HTTPRequestTimeout(text="the request body took longer than server.request_timeout_s") from None
    return bytes(body)


def _layout(header: str | None) -> tuple[TensorSpec, ...] | None:
    """X-KVCache-Layout: a JSON list of [name, dtype, shape] (shape a list of ints), or absent."""
    if not header:
        return None
    specs = parse_json(header, "X-KVCache-Layout")
    try:
        if specs is None:             # a header that is there names a layout
            raise TypeError("null is no layout")
        return wire.parse_layout(specs)
    except (ValueError, TypeError) as e:     # TensorSpec checks the names, dtypes and dims (integers)
        raise BlockFormatError(f"X-KVCache-Layout must be a JSON list of [name, dtype, [dims...]] ({e})") from None


def _put_json(r) -> dict:
    return {"stored": r.stored, "already_present": r.already_present, "durable": r.durable}


async def get_block(request: web.Request) -> web.StreamResponse:
    return await send_block(request, _get_stream(request), _key(request, request.match_info["key"]))


def _get_stream(request: web.Request) -> GetStream:
    app = request.app
    return GetStream(app[STORE], functools.partial(_call, request), app[METRICS], app[GET_BUDGET],
                     app[CONFIG].request_timeout_s)


async def head_block(request: web.Request) -> web.Response:
    [found] = await _call(request, request.app[STORE].exists_many, [_key(request, request.match_info["key"])])
    return web.Response(status=200 if found else 404)


async def batch_put(request: web.Request) -> web.Response:
    from kvcache.server.put_batch import ingest_request   # put_batch imports this module
    return web.json_response(await ingest_request(request.app, principal(request), request.content))


async def batch_get(request: web.Request) -> web.StreamResponse:
    """Frames stream out in groups within a daemon-wide byte budget and a write deadline
    (server/batch_get.py): a client that never reads holds little, briefly."""
    keys, body = await _keys(request)
    app = request.app
    if len(keys) > app[CONFIG].max_batch_blocks:
        raise wire.FrameLimitError(f"at most {app[CONFIG].max_batch_blocks} blocks per batch_get")
    return await stream_blocks(request, _get_stream(request), keys, [bytes.fromhex(k) for k in body["keys"]])


async def lookup(request: web.Request) -> web.Response:
    keys, body = await _keys(request)
    ns = body.get("namespace")
    if ns is not None and not (isinstance(ns, str) and len(ns) == 32):
        raise BlockFormatError('"namespace" is the 32-hex-digit namespace id (optional; labels hit-rate reports)')
    ns_id = tenancy.stored_namespace_id(request[TENANT], ns) if ns else None
    r = await _call(request, request.app[STORE].lookup, keys, request[TENANT], ns_id)
    request.app[METRICS].count_lookup(len(keys), r.tiers)
    return web.json_response({"num_hits": r.num_hits, "tiers": [t.label for t in r.tiers]})


async def exists(request: web.Request) -> web.Response:
    keys, _ = await _keys(request)
    return web.json_response({"exists": await _call(request, request.app[STORE].exists_many, keys)})


async def pin(request: web.Request) -> web.Response:
    keys, body = await _keys(request)
    ttl = body.get("ttl_s")
    if ttl is not None and not (is_real(ttl) and ttl > 0):      # a 400-digit int is no float
        raise BlockFormatError("ttl_s must be a positive, finite number of seconds")
    return web.json_response({"changed": await _call(request, request.app[STORE].pin, keys, ttl)})


async def unpin(request: web.Request) -> web.Response:
    keys, _ = await _keys(request)
    return web.json_response({"changed": await _call(request, request.app[STORE].unpin, keys)})


async def delete(request: web.Request) -> web.Response:
    """Keys of the admin's own tenant, or of the tenant the body names with "tenant"."""
    _require_admin(request)
    keys, body = await _keys(request)
    owner = tenancy.delete_tenant(body, request[TENANT], request[ADMIN])
    if owner != request[TENANT]:
        keys = [tenant_key(owner, bytes.fromhex(k)) for k in body["keys"]]
    return web.json_response({"deleted": await _call(request, request.app[STORE].delete, keys)})


async def run_gc(request: web.Request) -> web.Response:
    import dataclasses
    from kvcache.gc.collector import Collector
    _require_admin(request)
    body = await json_body(request) if request.can_read_body else {}
    if not isinstance(body, dict) or not isinstance(body.get("max_steps", 100), int) or body.get("max_steps", 100) < 1:
        raise BlockFormatError('expected {"max_steps": a positive integer} or no body')
    steps = body.get("max_steps", 100)
    report = await _call(request, Collector(request.app[STORE]).run, steps)
    return web.json_response(dataclasses.asdict(report))


async def stats(request: web.Request) -> web.Response:
    _require_admin(request)  # store-wide totals: not for tenants
    st = await _call(request, request.app[STORE].stats)
    return web.json_response(st.to_dict())


async def metrics(request: web.Request) -> web.Response:
    if not request[METRICS_ONLY]:        # admins and metrics tokens
        _require_admin(request)
    body, content_type = await _call(request, request.app[METRICS].render)
    return web.Response(body=body, headers={"Content-Type": content_type})


def build_app(store: BlockStore, config: ServerConfig) -> web.Application:
    app = web.Application(middlewares=[error_middleware, auth_middleware, metrics_middleware],
                          client_max_size=config.max_block_bytes + (1 << 20))
    quiet_bad_requests()
    from kvcache.server.reconfigure import LiveConfig, reconfigure_handler
    app[STORE], app[CONFIG] = store, LiveConfig(config)
    app[POOL] = ThreadPoolExecutor(config.workers, thread_name_prefix="kvcache-store")
    app[METRICS] = Metrics(store)
    app[QUOTAS] = Quotas()
    app[GET_BUDGET] = GetBudget(config.max_batch_get_bytes)
    app[TOKENED] = weakref.WeakSet()
    from kvcache.server.front.bulk_put import STAGING, UPLOAD_THREADS, UPLOADS, StagingPool
    app[STAGING] = StagingPool()
    app[UPLOADS] = ThreadPoolExecutor(UPLOAD_THREADS, thread_name_prefix="kvcache-upload")
    app.router.add_get("/healthz", healthz)
    app.router.add_post("/v1/namespaces", register_namespace)
    app.router.add_put("/v1/blocks/{key}", put_block)
    app.router.add_get("/v1/blocks/{key}", get_block, allow_head=False)
    app.router.add_head("/v1/blocks/{key}", head_block)
    app.router.add_post("/v1/blocks/batch_put", batch_put)
    app.router.add_post("/v1/blocks/batch_get", batch_get)
    for path, handler in (("lookup", lookup), ("exists", exists), ("pin", pin), ("unpin", unpin),
                          ("delete", delete), ("gc", run_gc)):
        app.router.add_post(f"/v1/{path}", handler)
    app.router.add_get("/v1/stats", stats)
    app.router.add_post("/v1/admin/reconfigure", reconfigure_handler)
    app.router.add_get("/metrics", metrics)
    from kvcache.server import shm_leases
    shm_leases.add_routes(app, config)
    app.on_cleanup.append(_shutdown_pool)
    return app


async def _shutdown_pool(app: web.Application) -> None:
    from kvcache.server.front.bulk_put import UPLOADS
    app[UPLOADS].shutdown(wait=True)
    app[POOL].shutdown(wait=True)
