"""The namespace route: POST /v1/namespaces registers (or renames) the tenant's namespace and
answers the id the client computes (server/tenancy.py maps it into the tenant's space)."""

from __future__ import annotations

from aiohttp import web

from kvcache.server import tenancy
from kvcache.server.request_body import json_body
from kvcache.server.request_state import CONFIG, STORE, call, principal


async def register_namespace(request: web.Request) -> web.Response:
    """The tenant's own namespace, registered or renamed. A new one past
    server.max_namespaces_per_tenant is a 429."""
    ns = tenancy.namespace_to_register(await json_body(request), principal(request).tenant)
    cfg = request.app[CONFIG]         # without tokens there is one trust domain: no per-tenant limit
    before = await call(request, request.app[STORE].save_namespace, ns,
                        cfg.max_namespaces_per_tenant if cfg.auth_required else None)
    return web.json_response(tenancy.registration_reply(ns, before))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/namespaces", register_namespace)
