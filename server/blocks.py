"""The block routes: put, get, head, batch_put, batch_get, lookup, exists, pin, unpin, delete.

    handler:  parse (hex keys -> the tenant's stored keys) ─> store call in a worker thread ─> encode

Handlers map the client's keys into the tenant's key space (`kvstore.hashing.tenant_key`) on the
way in and answer with the client's keys on the way out. See docs/api.md for the wire contract.
"""

from __future__ import annotations

import functools

from aiohttp import web

from kvcache.kvstore import wire
from kvcache.kvstore.errors import BlockFormatError
from kvcache.kvstore.hashing import tenant_key
from kvcache.kvstore.types import PutItem
from kvcache.kvstore.types import is_real
from kvcache.server import tenancy
from kvcache.server.batch_get import GetStream, send_block, stream_blocks
from kvcache.server.metrics import CLIENT_HEADER, client_label
from kvcache.server.put_batch import ingest_request
from kvcache.server.quota import PendingBytes, put_within_quota
from kvcache.server.request_body import block_key, block_keys, layout_header, read_at_most
from kvcache.server.request_state import (CONFIG, GET_BUDGET, METRICS, QUOTAS, STORE, call, principal,
                                          require_admin)


async def put_block(request: web.Request) -> web.Response:
    limit = request.app[CONFIG].max_block_bytes
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    ns_hex = request.headers.get("X-KVCache-Namespace")
    if not ns_hex:
        raise BlockFormatError("missing X-KVCache-Namespace header (the namespace id from POST /v1/namespaces)")
    key = block_key(request, request.match_info["key"])      # malformed input is a 400 before any 422
    layout, ttl = layout_header(request.headers.get("X-KVCache-Layout")), request.headers.get("X-KVCache-TTL")
    app, who = request.app, principal(request)
    ns = tenancy.stored_namespace_id(who.tenant, ns_hex, app[STORE].namespaces)
    pending = PendingBytes(app[QUOTAS], app[STORE], who, app[CONFIG].max_pending_upload_bytes)
    try:                     # the body counts as pending (quota, daemon-wide bound) as it arrives
        body = await read_at_most(request, limit, pending)
        item = PutItem(key, body, ns, layout, who.tenant, float(ttl) if ttl else None)
        r = await call(request, put_within_quota, app[STORE], app[QUOTAS], who, [item], pending)
    finally:
        pending.release()
    return web.json_response(_put_json(r))


def _put_json(r) -> dict:
    return {"stored": r.stored, "already_present": r.already_present, "durable": r.durable}


async def get_block(request: web.Request) -> web.StreamResponse:
    return await send_block(request, _get_stream(request), block_key(request, request.match_info["key"]))


def _get_stream(request: web.Request) -> GetStream:
    app = request.app
    return GetStream(app[STORE], functools.partial(call, request), app[METRICS], app[GET_BUDGET],
                     app[CONFIG].request_timeout_s, client_label(request.headers.get(CLIENT_HEADER)))


async def head_block(request: web.Request) -> web.Response:
    [found] = await call(request, request.app[STORE].exists_many, [block_key(request, request.match_info["key"])])
    return web.Response(status=200 if found else 404)


async def batch_put(request: web.Request) -> web.Response:
    return web.json_response(await ingest_request(request.app, principal(request), request.content,
                                                  client_label(request.headers.get(CLIENT_HEADER))))


async def batch_get(request: web.Request) -> web.StreamResponse:
    """Frames stream out in groups within a daemon-wide byte budget and a write deadline
    (server/batch_get.py): a client that never reads holds little, briefly."""
    keys, body = await block_keys(request)
    app = request.app
    if len(keys) > app[CONFIG].max_batch_blocks:
        raise wire.FrameLimitError(f"at most {app[CONFIG].max_batch_blocks} blocks per batch_get")
    sized = body.get("sized", False)
    if not isinstance(sized, bool):
        raise BlockFormatError('"sized" is true or false (true: a Content-Length, and padded misses)')
    return await stream_blocks(request, _get_stream(request), keys, [bytes.fromhex(k) for k in body["keys"]], sized)


async def lookup(request: web.Request) -> web.Response:
    keys, body = await block_keys(request)
    ns = body.get("namespace")
    if ns is not None and not (isinstance(ns, str) and len(ns) == 32):
        raise BlockFormatError('"namespace" is the 32-hex-digit namespace id (optional; labels hit-rate reports)')
    tenant = principal(request).tenant
    ns_id = tenancy.stored_namespace_id(tenant, ns) if ns else None
    client = client_label(request.headers.get(CLIENT_HEADER))
    r = await call(request, request.app[STORE].lookup, keys, tenant, ns_id, client)
    request.app[METRICS].count_lookup(len(keys), r.tiers, client)
    return web.json_response({"num_hits": r.num_hits, "tiers": [t.label for t in r.tiers]})


async def exists(request: web.Request) -> web.Response:
    keys, _ = await block_keys(request)
    return web.json_response({"exists": await call(request, request.app[STORE].exists_many, keys)})


async def pin(request: web.Request) -> web.Response:
    keys, body = await block_keys(request)
    ttl = body.get("ttl_s")
    if ttl is not None and not (is_real(ttl) and ttl > 0):      # a 400-digit int is no float
        raise BlockFormatError("ttl_s must be a positive, finite number of seconds")
    return web.json_response({"changed": await call(request, request.app[STORE].pin, keys, ttl)})


async def unpin(request: web.Request) -> web.Response:
    keys, _ = await block_keys(request)
    return web.json_response({"changed": await call(request, request.app[STORE].unpin, keys)})


async def delete(request: web.Request) -> web.Response:
    """Keys of the admin's own tenant, or of the tenant the body names with "tenant"."""
    require_admin(request)
    keys, body = await block_keys(request)
    who = principal(request)
    owner = tenancy.delete_tenant(body, who.tenant, who.admin)
    if owner != who.tenant:
        keys = [tenant_key(owner, bytes.fromhex(k)) for k in body["keys"]]
    return web.json_response({"deleted": await call(request, request.app[STORE].delete, keys)})


def add_routes(app: web.Application) -> None:
    app.router.add_put("/v1/blocks/{key}", put_block)
    app.router.add_get("/v1/blocks/{key}", get_block, allow_head=False)
    app.router.add_head("/v1/blocks/{key}", head_block)
    app.router.add_post("/v1/blocks/batch_put", batch_put)
    app.router.add_post("/v1/blocks/batch_get", batch_get)
    for path, handler in (("lookup", lookup), ("exists", exists), ("pin", pin), ("unpin", unpin),
                          ("delete", delete)):
        app.router.add_post(f"/v1/{path}", handler)

