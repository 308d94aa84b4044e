"""The daemon's own routes: /healthz, GC steps, store-wide stats and /metrics (admin or metrics
tokens); live reconfiguration is server/reconfigure.py's."""

from __future__ import annotations

import dataclasses

from aiohttp import web

from kvcache.gc.collector import Collector
from kvcache.kvstore.errors import BlockFormatError
from kvcache.server.request_body import json_body
from kvcache.server.request_state import METRICS, STORE, call, principal, require_admin


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def run_gc(request: web.Request) -> web.Response:
    require_admin(request)
    body = await json_body(request) if request.can_read_body else {}
    if not isinstance(body, dict) or not isinstance(body.get("max_steps", 100), int) or body.get("max_steps", 100) < 1:
        raise BlockFormatError('expected {"max_steps": a positive integer} or no body')
    steps = body.get("max_steps", 100)
    report = await call(request, Collector(request.app[STORE]).run, steps)
    return web.json_response(dataclasses.asdict(report))


async def stats(request: web.Request) -> web.Response:
    require_admin(request)  # store-wide totals: not for tenants
    st = await call(request, request.app[STORE].stats)
    return web.json_response(st.to_dict())


async def metrics(request: web.Request) -> web.Response:
    if not principal(request).metrics_only:        # admins and metrics tokens
        require_admin(request)
    body, content_type = await call(request, request.app[METRICS].render)
    return web.Response(body=body, headers={"Content-Type": content_type})
