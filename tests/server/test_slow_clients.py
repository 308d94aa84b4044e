"""Slow, stalled and flooding clients against the daemon's front (server/front/connection.py, server/front/bulk_put.py)
and aiohttp's batch_put: strangers' bytes never reach an upload thread, every request has a
deadline, a connection or a stalled upload costs little memory, errors arrive as answers."""

import asyncio
import json
import re
import struct
import time

import numpy as np
import pytest
from aiohttp import web

from kvcache.server.front.connection import Front
from kvcache.server.front.bulk_put import UPLOAD
from kvcache.server.front.site import FrontSite
from kvcache.server.app import build_app
from kvcache.server.request_state import METRICS, QUOTAS
from kvcache.server.config import ServerConfig, TokenInfo
from kvcache.kvstore import Namespace, hash_blocks, wire
from kvcache.client.async_client import AsyncKVClient
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.errors import BlockFormatError
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.types import PutItem
from kvcache.client.sync_client import KVClient
from kvcache.tiering.config import NvmeConfig

NS = Namespace("slow-model@1", "raw/v1", 16, name="slow")
KEYS = hash_blocks(NS, np.arange(16 * 64))
ALICE, BOB, SMALL = "a" * 32, "b" * 32, "s" * 32
TOKENS = (TokenInfo(ALICE, "alice"), TokenInfo(BOB, "bob"), TokenInfo(SMALL, "small", quota_bytes=300_000))


def start_daemon(tmp_path, **server):
    """A daemon on a real listening socket; no DRAM tier, so payloads get memory of their own."""
    async def start():
        store = BlockStore(StoreConfig(str(tmp_path), nvme=NvmeConfig(segment_bytes=4 << 20)))
        app = build_app(store, ServerConfig(**{"tokens": TOKENS, **server}))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        front = Front(app, runner.server, UPLOAD)
        site = FrontSite(runner, front, host="127.0.0.1", port=0)
        await site.start()

        async def stop():
            await front.drain(2)
            await runner.cleanup()
            store.close()
        return {"url": f"http://127.0.0.1:{site.port}", "port": site.port, "app": app, "front": front,
                "stop": stop}
    return start()


@pytest.fixture
async def daemon(tmp_path):
    made = []

    async def make(**server):
        made.append(await start_daemon(tmp_path / str(len(made)), **server))
        return made[-1]
    yield make
    for d in made:
        await d["stop"]()


def head(token: str | None, length: int, extra: str = "") -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"POST /v1/blocks/batch_put HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {length}\r\n{extra}\r\n").encode()


def frame_head(i: int, nbytes: int) -> bytes:
    """A frame's bytes up to its payload, declaring nbytes of payload."""
    return wire.encode_put_frame(wire.PutFrame(KEYS[i], NS.id, b""))[0][:-8] + struct.pack("<Q", nbytes)


async def read_response(reader) -> tuple[int, dict, dict]:
    status_line = await reader.readline()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1]), headers, json.loads(body) if body else {}


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) << 10


async def trickle(writer, data: bytes, every_s: float) -> None:
    """One byte of `data` every `every_s` seconds until the daemon closes the connection."""
    try:
        for b in data:
            writer.write(bytes([b]))
            await writer.drain()
            await asyncio.sleep(every_s)
    except (ConnectionError, OSError):
        pass


async def test_slow_strangers_do_not_starve_uploads(daemon):
    """40 connections without a token, each announcing a 60 MB batch_put and trickling a byte a
    second, hold no upload thread (each gets its 401 on the event loop, its body unread): an
    authenticated put_many completes at once."""
    d = await daemon()
    conns = [await asyncio.open_connection("127.0.0.1", d["port"]) for _ in range(40)]
    for _, w in conns:
        w.write(head(None, 60_000_000))
    trickles = [asyncio.create_task(trickle(w, bytes(100), 0.5)) for _, w in conns]
    await asyncio.sleep(0.3)
    c = AsyncKVClient(d["url"], ALICE, retries=0, timeout_s=3, shared_memory="off")
    try:
        await c.register_namespace(NS)
        t0 = time.monotonic()
        r = await c.put_many([PutItem(KEYS[i], bytes([i]) * 50_000, NS.id) for i in range(8)])
        assert r.stored == 8 and time.monotonic() - t0 < 2
        for reader, _ in conns:                     # each got its 401 and was closed, unread
            status, headers, _ = await asyncio.wait_for(read_response(reader), 3)
            assert status == 401 and headers["connection"] == "close"
    finally:
        await c.close()
        for t in trickles:
            t.cancel()
        for _, w in conns:
            w.close()


async def test_a_trickled_upload_is_cut_off_at_the_request_deadline(daemon):
    """An authenticated client sending one byte every 0.2 s (each read well within any per-read
    timeout) gets 408 once request_timeout_s has passed, on both upload paths."""
    d = await daemon(request_timeout_s=1.0)
    for via_aiohttp in (False, True):
        reader, writer = await asyncio.open_connection("127.0.0.1", d["port"])
        if via_aiohttp:                              # any other request first: aiohttp owns it then
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await read_response(reader))[0] == 200
        body = wire.stream_header(1) + frame_head(0, 1000)
        writer.write(head(ALICE, len(body) + 1000) + body)
        t0 = time.monotonic()
        slow = asyncio.create_task(trickle(writer, bytes(1000), 0.2))
        status, _, reply = await asyncio.wait_for(read_response(reader), 5)
        assert status == 408 and "request_timeout_s" in reply["message"], (via_aiohttp, reply)
        assert 0.9 < time.monotonic() - t0 < 3
        slow.cancel()
        writer.close()


async def test_a_408_lingers_so_a_client_still_sending_reads_it(daemon):
    """After its 408 the native path shuts its write side and keeps reading and dropping the body
    for a linger: a client still sending gets no reset that would eat the answer."""
    import socket
    d = await daemon(request_timeout_s=0.5)
    c = AsyncKVClient(d["url"], ALICE, retries=0, shared_memory="off")
    await c.register_namespace(NS)
    await c.close()

    def client() -> bytes:
        body = wire.stream_header(1) + frame_head(8, 1 << 20)
        with socket.create_connection(("127.0.0.1", d["port"])) as s:
            s.settimeout(3)
            s.sendall(head(ALICE, len(body) + (1 << 20)) + body)
            got = b""
            while b"}" not in got:
                got += s.recv(4096)
            for _ in range(10):              # the rest of the body, after the answer
                s.sendall(bytes(20_000))
                time.sleep(0.03)
            s.shutdown(socket.SHUT_WR)
            while more := s.recv(4096):
                got += more
            return got
    got = await asyncio.wait_for(asyncio.to_thread(client), 10)
    assert got.startswith(b"HTTP/1.1 408") and b"connection: close" in got.lower()


async def test_stalled_large_uploads_hold_what_they_sent(daemon):
    """16 uploads each declaring a 64 MiB payload and stalling after 100 kB hold what they sent,
    not what they declared: a payload's memory grows with its bytes, on both upload paths, and no
    staging buffer is taken for a payload that cannot use it (~1 MiB each, measured 18 MiB in all)."""
    d = await daemon(max_block_bytes=64 << 20)
    before = rss_bytes()
    conns = []
    for i in range(16):
        reader, writer = await asyncio.open_connection("127.0.0.1", d["port"])
        if i % 2:                                    # half of them on aiohttp's path
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            await read_response(reader)
        body = wire.stream_header(1) + frame_head(i, 64 << 20)
        writer.write(head(ALICE, len(body) + (64 << 20)) + body + bytes(100_000))
        await writer.drain()
        conns.append((reader, writer))
    await asyncio.sleep(1.0)
    grown = rss_bytes() - before
    assert grown < 64 << 20, grown
    assert d["app"][QUOTAS].pending_total <= 16 * (2 << 20)
    for _, w in conns:
        w.close()


async def test_pending_upload_bytes_are_bounded_and_counted_against_the_quota(daemon):
    d = await daemon(max_pending_upload_bytes=1 << 20)
    reader, writer = await asyncio.open_connection("127.0.0.1", d["port"])
    body = wire.stream_header(1) + frame_head(0, 2 << 20) + bytes(2 << 20)
    writer.write(head(ALICE, len(body)) + body)
    status, headers, reply = await asyncio.wait_for(read_response(reader), 3)
    assert status == 503 and headers["retry-after"] == "1" and "max_pending_upload_bytes" in reply["message"]
    writer.close()
    # a tenant's quota counts what its uploads under way have received, before more is reserved
    c = AsyncKVClient(d["url"], SMALL, retries=0, shared_memory="off")
    await c.register_namespace(NS)
    r1, w1 = await asyncio.open_connection("127.0.0.1", d["port"])
    body = wire.stream_header(1) + frame_head(1, 200_000)
    w1.write(head(SMALL, len(body) + 200_000) + body + bytes(1000))     # stalls: 200 kB pending
    await w1.drain()
    await asyncio.sleep(0.2)
    for put in (c.put_many([PutItem(KEYS[2], bytes(200_000), NS.id)]), c.put(KEYS[2], bytes(200_000), NS.id)):
        with pytest.raises(Exception, match="quota"):
            await put
    w1.close()
    await c.close()
    a = AsyncKVClient(d["url"], ALICE, retries=0, shared_memory="off")   # a single PUT counts as pending too
    await a.register_namespace(NS)
    with pytest.raises(Exception, match="max_pending_upload_bytes"):
        await a.put(KEYS[3], bytes(2 << 20), NS.id)
    await a.close()


async def test_a_huge_content_length_is_answered(daemon):
    """A 5,000-digit Content-Length (more than int() takes) is a 413 that says so."""
    d = await daemon()
    reader, writer = await asyncio.open_connection("127.0.0.1", d["port"])
    writer.write(b"POST /v1/blocks/batch_put HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n")
    status, _, reply = await asyncio.wait_for(read_response(reader), 3)
    assert status == 413 and "digits" in reply["message"]
    writer.close()


async def test_garbage_on_the_front_is_not_logged_at_error(daemon, caplog):
    d = await daemon()
    for junk in (b"\x00\xff" * 3000 + b"\r\n\r\n", b"POST /v1/blocks/batch_put HTTP/1.1\r\nContent-Length: 5\r\n\r\n"):
        reader, writer = await asyncio.open_connection("127.0.0.1", d["port"])
        writer.write(junk)
        await writer.drain()
        try:
            await asyncio.wait_for(reader.read(), 3)
        except ConnectionError:
            pass
        writer.close()
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


async def test_one_tenant_cannot_hold_every_upload_thread(daemon):
    """Past max_uploads_per_tenant, a tenant's uploads are served by aiohttp (no thread held)."""
    d = await daemon(max_uploads_per_tenant=1)
    c = AsyncKVClient(d["url"], ALICE, retries=0, shared_memory="off")
    await c.register_namespace(NS)
    reader, writer = await asyncio.open_connection("127.0.0.1", d["port"])
    body = wire.stream_header(1) + frame_head(3, 100_000)
    writer.write(head(ALICE, len(body) + 100_000) + body)      # holds alice's one thread
    await writer.drain()
    await asyncio.sleep(0.2)
    assert d["front"].uploads["alice"] == 1
    r = await asyncio.wait_for(c.put_many([PutItem(KEYS[4], bytes(50_000), NS.id)]), 3)
    assert r.stored == 1 and d["front"].uploads["alice"] == 1
    writer.close()
    await c.close()


async def stall_uploads(d, token: str, first: int, count: int) -> list:
    """`count` native uploads by `token`, each stalled inside its payload (holding a thread)."""
    conns = []
    for i in range(first, first + count):
        reader, writer = await asyncio.open_connection("127.0.0.1", d["port"])
        body = wire.stream_header(1) + frame_head(i, 100_000)
        writer.write(head(token, len(body) + 100_000) + body)
        await writer.drain()
        conns.append((reader, writer))
    return conns


async def test_uploads_that_find_no_free_thread_are_served_by_aiohttp(daemon):
    """Two tenants stalling their share of uploads each hold every upload thread between them; a
    third tenant's upload is served by aiohttp at once rather than queued for a thread (where it
    would wait for their request_timeout_s)."""
    from kvcache.server.front.bulk_put import UPLOAD_THREADS
    d = await daemon(max_uploads_per_tenant=UPLOAD_THREADS // 2)
    for token in (ALICE, BOB, SMALL):
        c = AsyncKVClient(d["url"], token, retries=0, shared_memory="off")
        await c.register_namespace(NS)
        await c.close()
    half = UPLOAD_THREADS // 2
    conns = await stall_uploads(d, ALICE, 0, half) + await stall_uploads(d, BOB, half, half)
    c = AsyncKVClient(d["url"], SMALL, retries=0, timeout_s=5, shared_memory="off")
    try:
        for _ in range(50):
            if sum(d["front"].uploads.values()) == UPLOAD_THREADS:
                break
            await asyncio.sleep(0.05)
        assert dict(d["front"].uploads) == {"alice": half, "bob": half}
        t0 = time.monotonic()
        r = await asyncio.wait_for(c.put_many([PutItem(KEYS[40], bytes(50_000), NS.id)]), 3)
        assert r.stored == 1 and time.monotonic() - t0 < 2
        assert "small" not in d["front"].uploads
    finally:
        await c.close()
        for _, w in conns:
            w.close()


async def test_without_tokens_uploads_are_not_capped_per_tenant(daemon):
    """With no tokens there is one tenant: max_uploads_per_tenant does not send its uploads to
    the slower aiohttp path."""
    d = await daemon(tokens=(), max_uploads_per_tenant=1)
    c = AsyncKVClient(d["url"], None, retries=0, shared_memory="off")
    await c.register_namespace(NS)
    await c.close()
    conns = await stall_uploads(d, None, 50, 3)
    try:
        for _ in range(50):
            if d["front"].uploads[""] == 3:
                break
            await asyncio.sleep(0.05)
        assert d["front"].uploads[""] == 3
    finally:
        for _, w in conns:
            w.close()


async def test_a_block_over_max_block_bytes_is_one_clear_413(daemon):
    """An 80 MiB block (more than the 64 MiB the daemon drains) gets its 413 as an answer the
    blocking client reads, sent once: no reset, no re-sending."""
    d = await daemon(max_block_bytes=1 << 20)
    big = np.zeros(80 << 20, dtype=np.uint8)

    def put() -> BaseException:
        with KVClient(d["url"], ALICE, retries=3, backoff_s=0.01, shared_memory="off") as c:
            c.register_namespace(NS)
            try:
                c.put_many([PutItem(KEYS[5], big, NS.id)])
            except BaseException as e:
                return e
        raise AssertionError("accepted")
    err = await asyncio.wait_for(asyncio.to_thread(put), 20)
    assert isinstance(err, BlockFormatError) and "413" in str(err) and "max_block_bytes" in str(err), err
    text, _ = d["app"][METRICS].render()
    text = text.decode() if isinstance(text, bytes) else text
    sent = re.search(r'endpoint="/v1/blocks/batch_put",status="413"} (\d+)', text)
    assert sent is not None and float(sent.group(1)) == 1           # sent once


async def test_each_upload_on_a_connection_gets_its_own_deadline(daemon):
    """A request near its deadline shortens the socket's read timeout; the next upload on the
    same connection starts with the whole timeout again (a pause of 0.8 s within its 1.5 s)."""
    d = await daemon(request_timeout_s=1.5)
    c = AsyncKVClient(d["url"], ALICE, retries=0, shared_memory="off")
    await c.register_namespace(NS)
    await c.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", d["port"])
    for i, pause in ((6, 1.0), (7, 0.8)):
        body = wire.stream_header(1) + frame_head(i, 1000) + bytes(1000)
        writer.write(head(ALICE, len(body)) + body[:100])
        await writer.drain()
        await asyncio.sleep(pause)
        writer.write(body[100:200])
        await writer.drain()
        await asyncio.sleep(0.05)                   # a read after the pause: its timeout is what is left
        writer.write(body[200:])
        status, _, reply = await asyncio.wait_for(read_response(reader), 3)
        assert status == 200 and reply["stored"] == 1, (i, reply)
    writer.close()
