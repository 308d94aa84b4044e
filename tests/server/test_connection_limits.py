"""Connection floods and idle connections against the daemon's front (server/front/connection.py): a head
must be whole within header_timeout_s, connections past max_connections make room by dropping
idle ones (strangers' first), an idle connection costs a small buffer, and aiohttp's connections
close at keepalive_s."""

import asyncio
import re
import time

import pytest

from kvcache.server.front.connection import BUFFER_BYTES
from kvcache.client.async_client import AsyncKVClient
from tests.daemon_proc import DaemonProcess
from tests.server.test_slow_clients import ALICE, daemon, head, read_response, rss_bytes, start_daemon, trickle  # noqa: F401

async def test_a_trickled_head_is_cut_off_at_the_header_timeout(daemon):
    d = await daemon(header_timeout_s=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", d["port"])
    t0 = time.monotonic()
    slow = asyncio.create_task(trickle(writer, head(ALICE, 10), 0.1))
    assert await asyncio.wait_for(reader.read(), 3) == b""
    assert time.monotonic() - t0 < 1.5
    slow.cancel()
    writer.close()
    # a connection that never sends a byte is closed as soon, not after the 75 s keep-alive
    reader, writer = await asyncio.open_connection("127.0.0.1", d["port"])
    assert await asyncio.wait_for(reader.read(), 3) == b""
    writer.close()


async def test_at_max_connections_a_new_connection_drops_the_oldest_idle_one(daemon):
    """A peer holding max_connections idle connections locks nobody out: each new connection
    closes the oldest that has completed no request."""
    d = await daemon(max_connections=5)
    held = [await asyncio.open_connection("127.0.0.1", d["port"]) for _ in range(5)]
    await asyncio.sleep(0.1)
    reader, writer = await asyncio.open_connection("127.0.0.1", d["port"])
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await asyncio.wait_for(read_response(reader), 2))[0] == 200
    assert await asyncio.wait_for(held[0][0].read(), 2) == b""          # the oldest idle one
    assert d["front"].open_count() == 5
    writer.close()
    for _, w in held:
        w.close()


async def test_at_max_connections_idle_aiohttp_connections_are_dropped_too(daemon):
    """/healthz needs no token: a stranger's connections that each served one and idle at
    keep-alive must not lock others out either."""
    d = await daemon(max_connections=5)
    held = [await asyncio.open_connection("127.0.0.1", d["port"]) for _ in range(5)]
    for r, w in held:                                # each has completed a request (aiohttp serves it)
        w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(r))[0] == 200
    reader, writer = await asyncio.open_connection("127.0.0.1", d["port"])
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await asyncio.wait_for(read_response(reader), 2))[0] == 200
    assert await asyncio.wait_for(held[0][0].read(), 2) == b""          # the oldest idle one
    writer.close()
    for _, w in held:
        w.close()


async def test_connections_past_max_connections_are_closed_when_none_is_idle(daemon):
    d = await daemon(max_connections=5)
    held = [await asyncio.open_connection("127.0.0.1", d["port"]) for _ in range(5)]
    for r, w in held:                                # each inside a request: its body is awaited
        w.write(b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + ALICE.encode()
                + b"\r\nContent-Length: 100\r\n\r\n")
    await asyncio.sleep(0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", d["port"])
    try:
        assert await asyncio.wait_for(reader.read(), 2) == b""
    except ConnectionResetError:
        pass
    writer.close()
    for _, w in held:
        w.close()
    await asyncio.sleep(0.1)
    c = AsyncKVClient(d["url"], ALICE, retries=0, shared_memory="off")
    assert await c.healthz() == {"status": "ok"}       # room again once they closed
    await c.close()


async def test_idle_connections_cost_a_small_buffer(daemon):
    """An idle connection holds a head buffer of BUFFER_BYTES: 300 of them cost well under
    64 KiB each."""
    d = await daemon()
    before = rss_bytes()
    conns = [await asyncio.open_connection("127.0.0.1", d["port"]) for _ in range(300)]
    await asyncio.sleep(0.2)
    grown = rss_bytes() - before
    assert len(d["front"].connections) >= 300
    assert all(len(c._buf) <= BUFFER_BYTES for c in d["front"].connections)
    assert grown < 300 * (64 << 10), grown
    for _, w in conns:
        w.close()


def process_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) << 10


@pytest.mark.slow
def test_idle_connections_to_the_daemon_process_cost_little(tmp_path):
    """The real `kvcache serve`: 400 connections that never send a byte cost a few KiB each
    and close at header_timeout_s."""
    import socket

    (tmp_path / "kvcache.toml").write_text("[server]\nheader_timeout_s = 3.0\n")
    with DaemonProcess(tmp_path / "data", "--config", str(tmp_path / "kvcache.toml")) as d:
        before = process_rss(d.proc.pid)
        socks = [socket.create_connection(("127.0.0.1", d.port)) for _ in range(400)]
        time.sleep(0.5)
        grown = process_rss(d.proc.pid) - before
        assert grown < 400 * (48 << 10), grown
        t0 = time.monotonic()
        for s in socks:                                  # closed by the daemon at the header timeout
            s.settimeout(6)
            assert s.recv(1) == b""
            s.close()
        assert time.monotonic() - t0 < 5


def test_the_daemon_closes_idle_aiohttp_connections_at_keepalive_s(tmp_path):
    """A connection aiohttp serves (any request but a bulk upload) closes when idle for
    server.keepalive_s (aiohttp's own default under an AppRunner is an hour)."""
    import socket

    (tmp_path / "kvcache.toml").write_text("[server]\nkeepalive_s = 1.0\n")
    with DaemonProcess(tmp_path / "data", "--config", str(tmp_path / "kvcache.toml")) as d:
        s = socket.create_connection(("127.0.0.1", d.port))
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        t0, got = time.monotonic(), b""
        while chunk := s.recv(4096):                 # the reply, then the daemon's close
            got += chunk
        assert got.startswith(b"HTTP/1.1 200") and time.monotonic() - t0 < 4
        s.close()


async def test_at_max_connections_a_tenants_idle_connections_are_kept(daemon):
    """Room is made from strangers' connections only: a tenant's pooled keep-alive connections
    are never torn down because someone without a token keeps connecting."""
    d = await daemon(max_connections=5)
    held = [await asyncio.open_connection("127.0.0.1", d["port"]) for _ in range(5)]
    body = b'{"keys": []}'
    for r, w in held:
        w.write(b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + ALICE.encode()
                + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert (await read_response(r))[0] == 200
    reader, writer = await asyncio.open_connection("127.0.0.1", d["port"])
    try:
        assert await asyncio.wait_for(reader.read(), 2) == b""        # the stranger is refused
    except ConnectionResetError:
        pass
    for r, w in held:                                                 # and alice's pool still serves
        w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(read_response(r), 2))[0] == 200
        w.close()
    writer.close()
