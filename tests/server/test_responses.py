"""How the daemon answers, and what it logs, beyond the happy path: a 503 says when to retry,
block keys are hex digits only, a client that hangs up mid-request is no error in the log,
and a batch_get its client never reads holds bounded memory for a bounded time."""

import asyncio
import json
import logging
import os
import socket
import struct
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvcache.server.request_state import GET_BUDGET, STORE
from kvcache.server.config import ServerConfig, TokenInfo
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.errors import StoreError
from kvcache.tiering.config import DramConfig, NvmeConfig

from tests.server.app_clients import AppClients
from tests.server.test_server import ADMIN, ALICE, BOB, KEYS, NS, auth, client, put, register  # noqa: F401


def no_errors_logged(caplog) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not bad, [(r.name, r.getMessage()[:200]) for r in bad]


class DaemonLikeServer(TestServer):
    """A TestServer that, like the daemon's AppRunner (server/front/connection.py), lets a handler run on
    after its client hangs up instead of cancelling it (aiohttp's test default)."""

    async def _make_runner(self, **kwargs):
        kwargs["handler_cancellation"] = False
        return await super()._make_runner(**kwargs)


@pytest.fixture
async def make_client(tmp_path):
    """A client of an app built with these [server] settings; clients and stores close after."""
    async with AppClients() as clients:
        async def make(**settings) -> TestClient:
            store = StoreConfig(str(tmp_path / f"s{len(clients)}"),
                                dram=DramConfig(capacity_bytes=64 << 20, page_bytes=1 << 20, prefault=False),
                                nvme=NvmeConfig(segment_bytes=8 << 20))
            cfg = ServerConfig(tokens=(TokenInfo(ALICE, "alice"), TokenInfo(BOB, "bob"), TokenInfo(ADMIN, "ops", True)),
                               **{"max_block_bytes": 4 << 20, "max_keys": 100, **settings})
            return await clients.open(store, cfg, server=DaemonLikeServer)
        yield make


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


def raw_post(port: int, path: str, body: bytes, declared: int | None = None, rcvbuf: int | None = None,
             token: str = ALICE) -> socket.socket:
    """A socket that sent a POST's head and `body` (of `declared` bytes, if more), and reads nothing."""
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
              f"Content-Type: application/json\r\nContent-Length: {declared or len(body)}\r\n\r\n".encode() + body)
    return s


async def until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def disconnect_records(caplog) -> list:
    return [r for r in caplog.records if "client closed the connection" in r.getMessage()]


@pytest.mark.parametrize("path", ["/v1/exists", "/v1/lookup", "/v1/blocks/batch_get"])
async def test_a_client_that_closes_mid_body_is_logged_at_debug(make_client, caplog, path):
    client = await make_client()
    caplog.set_level(logging.DEBUG, logger="kvcache.server")
    s = raw_post(client.server.port, path, b'{"keys": ["', declared=1000)
    await asyncio.sleep(0.2)
    s.close()
    await until(lambda: disconnect_records(caplog))
    no_errors_logged(caplog)
    assert (await client.post("/v1/exists", json={"keys": []}, headers=auth(ALICE))).status == 200


async def test_a_put_closed_mid_body_is_logged_at_debug(make_client, caplog):
    client = await make_client()
    caplog.set_level(logging.DEBUG, logger="kvcache.server")
    await register(client)
    s = socket.create_connection(("127.0.0.1", client.server.port))
    s.sendall(f"PUT /v1/blocks/{KEYS[0].hex()} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n"
              f"X-KVCache-Namespace: {NS.id.hex()}\r\nContent-Length: 100000\r\n\r\n".encode() + b"x" * 5000)
    await asyncio.sleep(0.2)
    s.close()
    await until(lambda: disconnect_records(caplog))
    no_errors_logged(caplog)


@pytest.mark.parametrize("damage", [struct.error("unpack requires a buffer of 8 bytes"), KeyError("tier"),
                                    TypeError("'NoneType' object is not subscriptable")])
async def test_damage_below_the_parsers_is_a_logged_500(client, caplog, monkeypatch, damage):  # noqa: F811
    def exists_many(keys):
        raise damage
    monkeypatch.setattr(client.server.app[STORE], "exists_many", exists_many)
    r = await client.post("/v1/exists", json={"keys": [KEYS[0].hex()]}, headers=auth(ALICE))
    assert r.status == 500 and (await r.json())["error"] == "internal"
    assert any(r.levelno == logging.ERROR and "unhandled error" in r.getMessage() for r in caplog.records)


def drain(s: socket.socket) -> int:
    """Read `s` until the daemon closed it (EOF or a reset); the bytes that came."""
    s.settimeout(5)
    n = 0
    try:
        while chunk := s.recv(1 << 20):
            n += len(chunk)
    except ConnectionResetError:
        pass
    s.close()
    return n


async def put_blocks(c, n: int, size: int) -> list[str]:
    await register(c)
    keys = [os.urandom(16).hex() for _ in range(n)]
    for i, k in enumerate(keys):
        r = await c.put(f"/v1/blocks/{k}", data=bytes([i]) * size,
                        headers={**auth(ALICE), "X-KVCache-Namespace": NS.id.hex()})
        assert r.status == 200, await r.text()
    return keys


def write_buffers(c) -> list[int]:
    """What each of the server's connections holds in its socket's send buffer (not yet sent)."""
    return [h.transport.get_write_buffer_size() for h in c.server.runner.server.connections if h.transport]


async def test_a_batch_get_never_read_holds_bounded_memory_for_a_bounded_time(make_client, caplog):
    from kvcache.server.batch_get import WRITE_SLICE
    c = await make_client(request_timeout_s=1.5, max_batch_get_bytes=24 << 20)
    size = (1 << 20) - 4096
    keys = await put_blocks(c, 12, size)         # a group of 8 blocks (8 MiB at most), then one of 4
    budget = c.server.app[GET_BUDGET]
    body = json.dumps({"keys": keys}).encode()
    stalled = [raw_post(c.server.port, "/v1/blocks/batch_get", body, rcvbuf=4096) for _ in range(3)]
    # three groups in flight, each buffer 8 blocks and their frame heads in whole MiB: no room for a fourth
    await until(lambda: budget.held == 3 * (8 << 20))
    assert max(write_buffers(c)) <= WRITE_SLICE + (64 << 10)  # one slice per connection, not a group's copy
    r = await c.post("/v1/blocks/batch_get", json={"keys": keys}, headers=auth(ALICE))
    assert r.status == 503 and r.headers["Retry-After"] == "1", r.status    # no room: before the stream starts
    assert "max_batch_get_bytes" in (await r.json())["message"]
    t0 = time.monotonic()
    await until(lambda: budget.held == 0)                    # past request_timeout_s: aborted, buffers dropped
    assert time.monotonic() - t0 < 5
    for s in stalled:                    # each stream was cut short: the connection is gone
        assert await asyncio.to_thread(drain, s) < 12 << 20
    r = await c.post("/v1/blocks/batch_get", json={"keys": keys[:2]}, headers=auth(ALICE))
    assert r.status == 200 and len(await r.read()) > 2 * size
    no_errors_logged(caplog)


async def test_a_stream_reads_one_group_ahead_and_no_more(make_client):
    c = await make_client(request_timeout_s=30)
    size = (1 << 20) - 4096
    keys = await put_blocks(c, 20, size)         # groups of 8, 8 and 4 blocks
    budget = c.server.app[GET_BUDGET]
    s = raw_post(c.server.port, "/v1/blocks/batch_get", json.dumps({"keys": keys}).encode(), rcvbuf=4096)
    await until(lambda: budget.held == 2 * (8 << 20))    # the group being written and the next one
    await asyncio.sleep(0.3)
    assert budget.held == 2 * (8 << 20)                  # not the third
    s.close()
    await until(lambda: budget.held == 0)


@pytest.mark.parametrize("failure", [StoreError("the index cannot be read"), RuntimeError("a bug")])
async def test_a_failure_after_the_stream_started_cuts_it_short(make_client, monkeypatch, failure):
    c = await make_client()
    size = (1 << 20) - 4096
    keys = await put_blocks(c, 12, size)               # two groups: the second one fails
    store, calls = c.server.app[STORE], []

    def failing_second(real):          # a group reads through one or the other (ZERO_COPY_BYTES)
        def read(*args):
            calls.append(args)
            if len(calls) == 2:
                raise failure
            return real(*args)
        return read
    for name in ("get_many_into", "lease_views"):
        monkeypatch.setattr(store, name, failing_second(getattr(store, name)))
    s = raw_post(c.server.port, "/v1/blocks/batch_get", json.dumps({"keys": keys}).encode())
    got = await asyncio.get_running_loop().run_in_executor(None, recv_all, s)
    assert got.count(b"HTTP/1.1 ") == 1, got[-300:]     # no error answer inside the stream
    assert got.startswith(b"HTTP/1.1 200") and 8 * size < len(got) < 12 * size


def recv_all(s: socket.socket) -> bytes:
    s.settimeout(10)
    out = bytearray()
    try:
        while chunk := s.recv(1 << 20):
            out += chunk
    except ConnectionResetError:
        pass
    s.close()
    return bytes(out)


def raw_get(port: int, path: str, rcvbuf: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n\r\n".encode())
    return s


async def test_a_block_get_never_read_holds_the_budget_for_a_bounded_time(make_client, caplog):
    """A single GET of a large block goes through batch_get's budget, slices and deadline: a
    client that never reads holds one slice in the socket for request_timeout_s, not the block."""
    from kvcache.server.batch_get import WRITE_SLICE
    c = await make_client(request_timeout_s=1.5, max_batch_get_bytes=10 << 20)
    size = 3 << 20
    [key] = await put_blocks(c, 1, size)
    budget = c.server.app[GET_BUDGET]
    stalled = [raw_get(c.server.port, f"/v1/blocks/{key}", rcvbuf=4096) for _ in range(3)]
    await until(lambda: budget.held == 3 * size)
    assert max(write_buffers(c)) <= WRITE_SLICE + (64 << 10)
    r = await c.get(f"/v1/blocks/{key}", headers=auth(ALICE))
    assert r.status == 503 and r.headers["Retry-After"] == "1"
    await until(lambda: budget.held == 0)                 # past request_timeout_s: aborted
    for s in stalled:
        assert await asyncio.to_thread(drain, s) < size        # the loop runs on: the daemon closes it
    r = await c.get(f"/v1/blocks/{key}", headers=auth(ALICE))
    assert r.status == 200 and len(await r.read()) == size and r.headers["X-KVCache-Tier"]
    assert (await c.get(f"/v1/blocks/{'00' * 16}", headers=auth(ALICE))).status == 404
    no_errors_logged(caplog)


async def test_a_started_stream_gets_room_before_new_ones():
    """New reads must not keep a started stream from its next group (it would be cut short
    mid-stream although its client reads promptly): room given back goes to it first."""
    from kvcache.server.batch_get import GetBudget
    budget = GetBudget(10)
    await budget.take(10, 1.0, first=True)
    newcomer = asyncio.ensure_future(budget.take(6, 1.0, first=True))
    await asyncio.sleep(0.01)
    started = asyncio.ensure_future(budget.take(6, 1.0))
    await asyncio.sleep(0.01)
    budget.give(10)
    assert await started == 6
    await asyncio.sleep(0.01)
    assert not newcomer.done()                 # no room until the started stream gives it back
    budget.give(6)
    assert await newcomer == 6 and budget.held == 6
