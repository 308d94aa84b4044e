"""The app of a model server that uses a cache daemon elsewhere (`kvcache serve --model M --cache URL`):
the model routes alone, behind the daemon's token check, with /metrics for the serving metrics and
the daemon's /healthz. There is no store here, so none of the cache API's routes or state."""

from __future__ import annotations

import weakref

from aiohttp import web
from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvcache.server.config import ServerConfig
from kvcache.server.errors import error_middleware, quiet_bad_requests
from kvcache.server.reconfigure import LiveConfig
from kvcache.server.request_state import CONFIG, TOKENED, auth_middleware, principal, require_admin

REGISTRY = web.AppKey("model_registry", CollectorRegistry)


def build_model_app(config: ServerConfig) -> tuple[web.Application, CollectorRegistry]:
    """The app (add the model routes to it) and the registry its /metrics serves."""
    disable_created_metrics()
    app = web.Application(middlewares=[error_middleware, auth_middleware])
    quiet_bad_requests()
    app[CONFIG], app[TOKENED] = LiveConfig(config), weakref.WeakSet()
    app[REGISTRY] = registry = CollectorRegistry()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    return app, registry


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    if not principal(request).metrics_only:        # admins and metrics tokens, as the daemon's
        require_admin(request)
    return web.Response(body=generate_latest(request.app[REGISTRY]), headers={"Content-Type": CONTENT_TYPE_LATEST})
