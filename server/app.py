"""The `kvcache serve` HTTP application: thin aiohttp handlers over one BlockStore.

    request ─> error middleware ─> auth middleware (token -> Principal) ─> metrics ─> handler
    handler:  parse (hex keys -> the tenant's stored keys) ─> store call in a worker thread ─> encode

The store is synchronous and thread-safe; its calls run in a thread pool so an fsync never
stalls the event loop. build_app wires the state every handler reads (server/request_state.py)
and the routes, grouped by concern: blocks.py, namespaces.py, admin.py, reconfigure.py,
shm_routes.py. See docs/api.md for the wire contract.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from kvcache.kvstore.store import BlockStore
from kvcache.server import admin, blocks, namespaces, shm_routes
from kvcache.server.batch_get import GetBudget
from kvcache.server.config import ServerConfig
from kvcache.server.errors import error_middleware, quiet_bad_requests
from kvcache.server.front.bulk_put import STAGING, UPLOAD_THREADS, UPLOADS, StagingPool
from kvcache.server.metrics import Metrics
from kvcache.server.quota import Quotas
from kvcache.server.reconfigure import LiveConfig, reconfigure_handler
from kvcache.server.request_state import (CONFIG, GET_BUDGET, METRICS, POOL, QUOTAS, STORE, TOKENED,
                                          auth_middleware)


@web.middleware
async def metrics_middleware(request: web.Request, handler):
    t0 = time.perf_counter()
    route = request.match_info.route.resource
    endpoint = route.canonical if route is not None else "unmatched"
    response = await handler(request)
    request.app[METRICS].observe_request(endpoint, response.status, time.perf_counter() - t0)
    return response


def build_app(store: BlockStore, config: ServerConfig) -> web.Application:
    app = web.Application(middlewares=[error_middleware, auth_middleware, metrics_middleware],
                          client_max_size=config.max_block_bytes + (1 << 20))
    quiet_bad_requests()
    app[STORE], app[CONFIG] = store, LiveConfig(config)
    app[POOL] = ThreadPoolExecutor(config.workers, thread_name_prefix="kvcache-store")
    app[METRICS] = Metrics(store)
    app[QUOTAS] = Quotas()
    app[GET_BUDGET] = GetBudget(config.max_batch_get_bytes)
    app[TOKENED] = weakref.WeakSet()
    app[STAGING] = StagingPool()
    app[UPLOADS] = ThreadPoolExecutor(UPLOAD_THREADS, thread_name_prefix="kvcache-upload")
    app.router.add_get("/healthz", admin.healthz)
    namespaces.add_routes(app)
    blocks.add_routes(app)
    app.router.add_post("/v1/gc", admin.run_gc)
    app.router.add_get("/v1/stats", admin.stats)
    app.router.add_post("/v1/admin/reconfigure", reconfigure_handler)
    app.router.add_get("/metrics", admin.metrics)
    shm_routes.add_routes(app, config)
    app.on_cleanup.append(_shutdown_pools)
    return app


async def _shutdown_pools(app: web.Application) -> None:
    app[UPLOADS].shutdown(wait=True)
    app[POOL].shutdown(wait=True)
