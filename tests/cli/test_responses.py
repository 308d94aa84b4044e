"""How the daemon answers, and what it logs, beyond the happy path: a 503 says when to retry,
block keys are hex digits only, a client that hangs up mid-request is no error in the log,
and a batch_get its client never reads holds bounded memory for a bounded time."""

import asyncio
import json
import logging
import socket
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvcache.cli.server import build_app
from kvcache.cli.server_config import ServerConfig, TokenInfo
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.store import BlockStore
from kvcache.tiering.dram import DramConfig
from kvcache.tiering.nvme import NvmeConfig

from tests.cli.test_server import ADMIN, ALICE, BOB, KEYS, NS, auth, client, put, register  # noqa: F401


def no_errors_logged(caplog) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not bad, [(r.name, r.getMessage()[:200]) for r in bad]


@pytest.fixture
async def make_client(tmp_path):
    """A client of an app built with these [server] settings; clients and stores close after."""
    opened = []

    async def make(**settings) -> TestClient:
        store = BlockStore(StoreConfig(str(tmp_path / f"s{len(opened)}"),
                                       dram=DramConfig(capacity_bytes=64 << 20, page_bytes=1 << 20, prefault=False),
                                       nvme=NvmeConfig(segment_bytes=8 << 20)))
        cfg = ServerConfig(tokens=(TokenInfo(ALICE, "alice"), TokenInfo(BOB, "bob"), TokenInfo(ADMIN, "ops", True)),
                           **{"max_block_bytes": 4 << 20, "max_keys": 100, **settings})
        c = TestClient(TestServer(build_app(store, cfg)))
        await c.start_server()
        opened.append((c, store))
        return c
    yield make
    for c, store in opened:
        await c.close()
        store.close()


async def test_a_503_says_retry_after(make_client):
    c = await make_client(max_pending_upload_bytes=1000)
    await register(c)
    r = await put(c, 0)                       # 3,000 bytes pending: past the daemon-wide 1,000
    assert r.status == 503 and r.headers.get("Retry-After") == "1", (r.status, dict(r.headers))
    assert (await r.json())["error"] == "store_unavailable"


@pytest.mark.parametrize("text", [" ".join(KEYS[0].hex()[i: i + 2] for i in range(0, 32, 2)),
                                  KEYS[0].hex()[:30] + " 0", KEYS[0].hex() + " ", "0x" + KEYS[0].hex()[2:],
                                  KEYS[0].hex()[:-1], "\u0660" * 32])
async def test_block_keys_are_hex_digits_only(client, text):  # noqa: F811
    await register(client)
    assert (await put(client, 0)).status == 200
    r = await client.post("/v1/exists", json={"keys": [text]}, headers=auth(ALICE))
    assert r.status == 400 and "hex digits" in (await r.json())["message"], await r.text()
    r = await client.post("/v1/exists", json={"keys": [KEYS[0].hex().upper()]}, headers=auth(ALICE))
    assert await r.json() == {"exists": [True]}


async def test_namespace_ids_are_hex_digits_only(client):  # noqa: F811
    await register(client)
    spaced = " ".join(NS.id.hex()[i: i + 2] for i in range(0, 32, 2))
    r = await put(client, 0, ns=spaced)
    assert r.status == 400 and "32 hex digits" in (await r.json())["message"], await r.text()
