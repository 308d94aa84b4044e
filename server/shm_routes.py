"""The shared-memory path's routes and lifetime (the path itself: server/shm_leases.py):
GET /v1/shm, and while the app runs, the control socket (server/shm_control.py) and a sweeper
that ends abandoned leases."""

from __future__ import annotations

import asyncio

from aiohttp import web

from kvcache.server.request_state import STORE, principal
from kvcache.server.shm_control import ControlServer
from kvcache.server.shm_leases import CONTROL_PATH, DENIED, LEASES, LeaseTable, control_path


def _arena_info(store):
    return store.dram.arena.info() if store.dram is not None else None


async def shm_info(request: web.Request) -> web.Response:
    if not principal(request).shm:
        raise web.HTTPForbidden(text=DENIED)
    info = _arena_info(request.app[STORE])
    if info is None:
        raise web.HTTPNotFound(text="this daemon's DRAM tier is not in shared memory "
                                    "(set [dram] shared_memory = true); read over the socket")
    dram = request.app[STORE].dram
    table = dram.directory_arena.info() if dram.directory_arena is not None else None
    return web.json_response({"pid": info.pid, "fd": info.fd, "size": info.size, "inode": info.inode,
                              "lease_s": request.app[LEASES].lease_s, "control_socket": request.app[CONTROL_PATH],
                              "directory": vars(table) if table is not None else None})


def add_routes(app: web.Application, config) -> None:
    store = app[STORE]
    app[LEASES] = LeaseTable(store.release_dram, config.shm_lease_s, config.max_shm_leases)
    app[CONTROL_PATH] = control_path(config)
    app.router.add_get("/v1/shm", shm_info)

    async def control(app: web.Application):
        """The control socket while the app runs, and a sweeper for abandoned leases."""
        server = ControlServer(app, app[CONTROL_PATH]) if _arena_info(store) is not None else None

        async def sweep():
            while True:
                await asyncio.sleep(app[LEASES].lease_s / 2)
                app[LEASES].sweep()
        task = asyncio.get_running_loop().create_task(sweep())
        yield
        task.cancel()
        if server is not None:
            server.close()
        app[LEASES].release_all()
    app.cleanup_ctx.append(control)
