"""The daemon's listening sockets (TCP, and a unix socket if asked) and its serve loop: every
accepted connection starts as a FrontConnection (server/front/connection.py), which serves the
upload path it is given (bulk uploads) itself and hands everything else to aiohttp; SIGTERM/SIGINT
drain both before the store closes."""

from __future__ import annotations

import asyncio
import signal

from aiohttp import web

from kvcache.server.front.connection import Front, FrontConnection, UploadPath
from kvcache.server.request_state import CONFIG


class FrontSite(web.BaseSite):
    """A TCP or unix listening socket whose connections start as FrontConnections."""
    __slots__ = ("_front", "_host", "_port", "_path")

    def __init__(self, runner: web.AppRunner, front: Front, *, host: str = "", port: int = 0, path: str = ""):
        super().__init__(runner)
        self._front, self._host, self._port, self._path = front, host, port, path

    @property
    def name(self) -> str:
        return f"http://unix:{self._path}:" if self._path else f"http://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        """The bound port (the one asked for, or the kernel's pick for 0)."""
        return self._server.sockets[0].getsockname()[1] if self._server and not self._path else self._port

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        factory = lambda: FrontConnection(self._front)  # noqa: E731
        if self._path:
            self._server = await loop.create_unix_server(factory, self._path)
        else:
            self._server = await loop.create_server(factory, self._host, self._port, reuse_address=True)


def run(app: web.Application, host: str, port: int, unix_socket: str, shutdown_timeout_s: float,
        upload: UploadPath | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain: bulk requests finish, aiohttp's requests finish
    (up to the timeout), the app's cleanup hooks run (flush and close the store). `upload`: the
    requests the front serves itself (the daemon's bulk uploads), the rest going to aiohttp."""
    async def main() -> None:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout_s,
                               keepalive_timeout=app[CONFIG].keepalive_s)   # aiohttp's default: an hour
        await runner.setup()
        front = Front(app, runner.server, upload)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            sites = [FrontSite(runner, front, **kw) for kw in
                     [{"host": host, "port": port}] + ([{"path": unix_socket}] if unix_socket else [])]
            for site in sites:
                await site.start()
            await stop.wait()
            for site in sites:          # no new connections while draining
                await site.stop()
            await front.drain(shutdown_timeout_s)
        finally:
            await runner.cleanup()
    asyncio.run(main())
