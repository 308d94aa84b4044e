"""Test clients of the daemon's app in this process (aiohttp's TestServer), each on a store of
its own, all closed together: what fixtures build when a test needs the app's objects at hand
(monkeypatched handlers, the store behind it, log records). The real `kvcache serve` process is
tests/daemon_proc.py's."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.store import BlockStore
from kvcache.server.app import build_app
from kvcache.server.config import ServerConfig
from kvcache.server.reconfigure import CONFIG_FILE


class AppClients:
    """`async with AppClients() as clients: c = await clients.open(store_config, server_config)`;
    on the way out every client is closed, then its store."""

    def __init__(self):
        self._opened: list[tuple[TestClient, BlockStore]] = []

    def __len__(self) -> int:
        return len(self._opened)

    async def open(self, store_config: StoreConfig, config: ServerConfig, *, config_file: str = "",
                   server: type[TestServer] = TestServer) -> TestClient:
        """A started client of build_app over a new BlockStore; `config_file` is what a reconfigure
        re-reads (none: ""), `server` the TestServer class that serves the app."""
        store = BlockStore(store_config)
        app = build_app(store, config)
        app[CONFIG_FILE] = config_file
        c = TestClient(server(app))
        self._opened.append((c, store))
        await c.start_server()
        return c

    async def __aenter__(self) -> "AppClients":
        return self

    async def __aexit__(self, *exc) -> None:
        for c, store in self._opened:
            await c.close()
            store.close()
