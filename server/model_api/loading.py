"""Loading the model after the port opens, so that /health answers at once and a load of a
minute (a demo build, a large checkpoint) is no minute of connection refused.

    app starts ─ on_startup: a thread runs open_host() (build the demo or read the checkpoint,
                 build the engine, one warm-up request)
    loading    ─ /health 200; /ready 503; the model routes 503 with Retry-After, in their API's shape
    loaded     ─ on_loaded(host) on the event loop: the routes serve, /ready 200
    failed     ─ the error logged with its traceback, then SIGTERM to this process: the serve loop
                 drains and stops as for an operator's, and `error` tells the caller to exit
                 non-zero; never a server that stays up unready
    cleanup    ─ wait for the thread (a warm-up may be writing to the store the daemon closes
                 next), then close the host

The loader is handed what opens the host and what to do with it; it knows nothing of routes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from typing import Callable

from aiohttp import web

from kvcache.server.model_api.host import ModelHost

log = logging.getLogger("kvcache.server.model_api")

_RETRY_STOP_S = 0.05      # how soon to look again for the serve loop's SIGTERM handler


class ModelLoader:
    def __init__(self, open_host: Callable[[], ModelHost], on_loaded: Callable[[ModelHost], None]):
        self._open_host, self._on_loaded = open_host, on_loaded
        self.host: ModelHost | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, app: web.Application) -> None:
        """Load once `app` has started; wait for the load and close the host when it is cleaned up
        (append the store's own cleanup after this call: hooks run in order)."""
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._close)

    async def _start(self, _app) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._load, name="kvcache-model-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        try:
            host = self._open_host()
        except BaseException as e:        # whatever it is, the server must not stay up unready
            self.error = e
            log.error("the model failed to load: %s", e, exc_info=e)
            self._loop.call_soon_threadsafe(self._stop_server)
            return
        self.host = host
        self._loop.call_soon_threadsafe(self._on_loaded, host)

    def _stop_server(self) -> None:
        """SIGTERM to this process. The app starts before the serve loop installs its handler;
        until it has, look again shortly (the default action would kill the process undrained)."""
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._loop.call_later(_RETRY_STOP_S, self._stop_server)
            return
        os.kill(os.getpid(), signal.SIGTERM)

    async def _close(self, _app) -> None:
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        if self.host is not None:
            self.host.close()
