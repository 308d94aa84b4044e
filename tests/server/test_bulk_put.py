"""The native batch_put path (server/front/connection.py + server/front/bulk_put.py) on a real listening socket:
the client's bulk connections, raw HTTP/1.1 edge cases, hand-over to aiohttp, limits, auth."""

import asyncio
import json

import numpy as np
import pytest
from aiohttp import web

from kvcache.server.front.connection import Front, parse_head
from kvcache.server.front.bulk_put import UPLOAD
from kvcache.server.front.site import FrontSite
from kvcache.server.app import build_app
from kvcache.server.config import ServerConfig, TokenInfo
from kvcache.kvstore import Namespace, hash_blocks, wire
from kvcache.kvstore.hashing import tenant_key
from kvcache.client.async_client import AsyncKVClient
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.types import PutItem
from kvcache.tiering.config import DramConfig, NvmeConfig

NS = Namespace("bulk-model@1", "raw/v1", 16, name="bulk")
KEYS = hash_blocks(NS, np.arange(16 * 64))
ALICE, ADMIN, SMALL, PROM = "a" * 32, "c" * 32, "s" * 32, "m" * 32


def payload(i: int, n: int = 70_000) -> bytes:
    return bytes([i % 251]) * n


@pytest.fixture
async def daemon(tmp_path):
    store = BlockStore(StoreConfig(str(tmp_path), dram=DramConfig(capacity_bytes=32 << 20, page_bytes=1 << 20,
                                                                  prefault=False),
                                   nvme=NvmeConfig(segment_bytes=4 << 20)))
    cfg = ServerConfig(tokens=(TokenInfo(ALICE, "alice"), TokenInfo(ADMIN, "ops", True),
                               TokenInfo(SMALL, "small", quota_bytes=200_000), TokenInfo(PROM, metrics=True)),
                       max_block_bytes=1 << 20, max_batch_blocks=64)
    app = build_app(store, cfg)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    front = Front(app, runner.server, UPLOAD, read_timeout_s=5)
    site = FrontSite(runner, front, host="127.0.0.1", port=0)
    await site.start()
    yield {"url": f"http://127.0.0.1:{site.port}", "port": site.port, "store": store, "front": front, "app": app}
    await front.drain(5)
    await runner.cleanup()
    store.close()


def batch_body(indices, size=70_000, ns=NS.id) -> bytes:
    parts = [wire.stream_header(len(indices))]
    for i in indices:
        parts += wire.encode_put_frame(wire.PutFrame(KEYS[i], ns, payload(i, size)))
    return b"".join(bytes(p) for p in parts)


def request(body: bytes, token=ALICE, extra: str = "", length: int | None = None) -> bytes:
    head = (f"POST /v1/blocks/batch_put HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n{extra}\r\n")
    return head.encode() + body


async def read_response(reader) -> tuple[int, dict, dict]:
    status_line = await reader.readline()
    headers = {}
    while (line := await reader.readline()) != b"\r\n":
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1]), headers, json.loads(body) if body else {}


async def registered(d) -> AsyncKVClient:
    c = AsyncKVClient(d["url"], ALICE, retries=0, shared_memory="off")
    await c.register_namespace(NS)
    return c


async def test_client_puts_take_the_native_path_and_read_back(daemon):
    c = await registered(daemon)
    try:
        items = [PutItem(KEYS[i], payload(i), NS.id) for i in range(40)]
        r = await c.put_many(items)
        assert (r.stored, r.already_present, r.durable) == (40, 0, True)
        assert (await c.put_many(items[:5])).already_present == 5
        got = await c.get_many(KEYS[:40])
        assert got == [payload(i) for i in range(40)]
        # served by the front protocol: the bulk connection never went to aiohttp
        assert any(not conn._handed for conn in daemon["front"].connections)
        text = await (await c._get_session().get(daemon["url"] + "/metrics",
                                                 headers={"Authorization": f"Bearer {ADMIN}"})).text()
        assert 'endpoint="/v1/blocks/batch_put",status="200"' in text
        dram = daemon["store"].dram       # received straight into DRAM: every new block adopted, none left over
        assert dram.adopted == 40 and dram.reserved_bytes == 0
    finally:
        await c.close()


async def test_keep_alive_error_skips_body_then_serves_next_and_hands_over(daemon):
    await (await registered(daemon)).close()
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon["port"])
    body = batch_body([0, 1, 2])
    writer.write(request(batch_body([0, 1], ns=b"\x01" * 16)) + request(body))   # pipelined: a 422, then a good one
    await writer.drain()
    status, headers, reply = await read_response(reader)
    assert status == 422 and reply["error"] == "unknown_namespace" and headers.get("connection") != "close"
    status, _, reply = await read_response(reader)
    assert status == 200 and reply == {"stored": 3, "already_present": 0, "durable": True}
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")          # anything else: aiohttp takes over
    await writer.drain()
    status, _, reply = await read_response(reader)
    assert status == 200 and reply == {"status": "ok"}
    writer.write(request(batch_body([3])))                             # aiohttp's batch_put from now on
    await writer.drain()
    status, _, reply = await read_response(reader)
    assert status == 200 and reply["stored"] == 1
    writer.close()
    assert daemon["store"].get(tenant_key("alice", KEYS[3])) == payload(3)


async def test_a_bad_token_is_refused_on_the_loop_and_its_body_never_read(daemon):
    """A 401 comes at once, with Connection: close, and the connection closes without the
    daemon reading (or draining) the body it announced."""
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon["port"])
    writer.write(request(b"", token="x" * 32, length=60_000_000) + b"\x00" * 1000)
    await writer.drain()
    status, headers, reply = await asyncio.wait_for(read_response(reader), 2)
    assert status == 401 and reply["error"] == "unauthorized" and headers["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 3) == b""            # closed, nothing drained
    assert not daemon["front"].uploads                                  # no upload thread was lent
    writer.close()


async def test_a_metrics_token_is_forbidden_to_upload(daemon):
    """As on every aiohttp route: a known token without the right is a 403, not a 401; and it
    never acts as tenant "" (the raw key space, where the namespace is registered here)."""
    from kvcache.server.request_state import STORE
    store = daemon["app"][STORE]
    store.register_namespace(NS)
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon["port"])
    writer.write(request(batch_body([0]), token=PROM))
    await writer.drain()
    status, headers, reply = await asyncio.wait_for(read_response(reader), 2)
    assert status == 403 and reply["error"] == "forbidden" and "metrics" in reply["message"]
    assert headers["connection"] == "close" and not daemon["front"].uploads
    assert store.index.get_many([KEYS[0]]) == [None] and not store.exists_many([KEYS[0]])[0]
    writer.close()


async def test_each_upload_on_a_lent_connection_is_authenticated_again(daemon):
    """A reconfigure that gives a token a quota applies to the next upload on a connection that
    is already streaming uploads with it."""
    import dataclasses

    from kvcache.server.request_state import CONFIG
    await (await registered(daemon)).close()
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon["port"])
    writer.write(request(batch_body([60])))
    await writer.drain()
    assert (await read_response(reader))[0] == 200
    live = daemon["app"][CONFIG]
    live.current = dataclasses.replace(live.current, tokens=tuple(
        dataclasses.replace(t, quota_bytes=1000) if t.token == ALICE else t for t in live.current.tokens))
    writer.write(request(batch_body([61])))          # within the upload thread's hold on the connection
    await writer.drain()
    status, _, reply = await asyncio.wait_for(read_response(reader), 3)
    assert status == 507 and reply["error"] == "quota_exceeded", reply
    writer.close()


async def test_frames_past_content_length_and_trailing_bytes_are_400(daemon):
    await (await registered(daemon)).close()
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon["port"])
    body = batch_body([10, 11])
    writer.write(request(body[:-100], length=len(body) - 100))        # the last payload runs past the length
    await writer.drain()
    status, _, reply = await read_response(reader)
    assert status == 400 and "past the Content-Length" in reply["message"]
    writer.write(request(body + b"junk"))                              # bytes after the last frame
    await writer.drain()
    status, _, reply = await read_response(reader)
    assert status == 400 and "follow the last frame" in reply["message"]
    writer.close()


async def test_bad_frames_limits_unknown_namespace_and_quota(daemon):
    await (await registered(daemon)).close()
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon["port"])
    cases = [
        (b"XXXX" + bytes(4), 400, "KVB1"),
        (wire.stream_header(1000), 413, "exceeds the limit"),
        (wire.stream_header(1) + b"\x00", 400, "key length"),
        (batch_body([1], ns=b"\x01" * 16), 422, "unknown_namespace"),
        (batch_body([1], size=(1 << 20) + 1), 413, "exceeds"),
    ]
    for body, want, text in cases:
        writer.write(request(body))
        await writer.drain()
        status, _, reply = await read_response(reader)
        assert status == want and text in reply["message"] + reply["error"], (want, reply)
    small = AsyncKVClient(daemon["url"], SMALL, retries=0, shared_memory="off")
    await small.register_namespace(NS)
    writer.write(request(batch_body([20, 21, 22, 23]), token=SMALL))   # 280 kB > the 200 kB quota
    await writer.drain()
    status, _, reply = await read_response(reader)
    assert status == 507 and reply["error"] == "quota_exceeded"
    await small.close()
    writer.close()
    assert daemon["store"].dram.reserved_bytes == 0 and daemon["store"].dram.adopted == 0   # refused: all freed


async def test_truncated_upload_closes_only_that_connection(daemon):
    c = await registered(daemon)
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon["port"])
    body = batch_body([30, 31, 32])
    writer.write(request(body)[: -50_000])                             # the client dies mid-payload
    await writer.drain()
    writer.close()
    await asyncio.sleep(0.1)
    assert await c.exists(KEYS[30:33]) == [False] * 3                  # one chunk: nothing stored
    assert daemon["store"].dram.reserved_bytes == 0                    # its landings were freed
    assert (await c.put_many([PutItem(KEYS[30], payload(30), NS.id)])).stored == 1
    await c.close()


async def test_unusual_requests_go_to_aiohttp(daemon):
    await (await registered(daemon)).close()
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon["port"])
    body = batch_body([40])
    chunked = (b"POST /v1/blocks/batch_put HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + ALICE.encode()
               + b"\r\nTransfer-Encoding: chunked\r\n\r\n" + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
    writer.write(chunked)
    await writer.drain()
    status, _, reply = await read_response(reader)
    assert status == 200 and reply["stored"] == 1
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon["port"])
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n")
    await writer.drain()
    assert (await reader.readline()).split()[1] in (b"400", b"431")
    writer.close()


def test_parse_head():
    h = parse_head(b"POST /v1/blocks/batch_put HTTP/1.1\r\nContent-Length: 12\r\nX-A:  b \r\n\r\n")
    assert (h.method, h.target, h.version, h.headers) == ("POST", "/v1/blocks/batch_put", "HTTP/1.1",
                                                          {"content-length": "12", "x-a": "b"})
    assert parse_head(b"GARBAGE\r\n\r\n") is None
    assert parse_head(b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n") is None
    assert parse_head(b"POST / HTTP/1.1\r\nno colon\r\n\r\n") is None
    assert parse_head(b"POST / HTTP/1.1\r\nContent-Length : 5\r\n\r\n") is None   # aiohttp's to refuse


def test_parse_head_leaves_anything_but_plain_crlf_lines_to_aiohttp():
    from kvcache.server.front.head import NOT_PLAIN, head_end
    for line in (b"X-A: b\nTransfer-Encoding: chunked", b"X-A: b\rc", b"X-A: b\x00c"):
        assert parse_head(b"POST / HTTP/1.1\r\nContent-Length: 1\r\n" + line + b"\r\n\r\n") is None, line
    assert head_end(b"POST / HTTP/1.1\r\nHost: x\r\n\r\nbody") == 28
    assert head_end(b"POST / HTTP/1.1\r\nHost: x\r\n") == -1
    assert head_end(b"POST / HTTP/1.1\nHost: x\n\n") == NOT_PLAIN          # bare LF: never CRLF CRLF
    assert head_end(b"POST / HTTP/1.1\r\nHost: x\n\r\n") == NOT_PLAIN


async def test_smuggled_and_bare_lf_heads_are_answered_by_aiohttp(daemon):
    """A header line hiding a bare LF is not served by its Content-Length, and a head with
    bare-LF line endings is answered at once, not at the header timeout."""
    await (await registered(daemon)).close()
    body = batch_body([50])
    smuggle = (f"POST /v1/blocks/batch_put HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n"
               f"X-A: b\nTransfer-Encoding: chunked\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    bare = (f"POST /v1/blocks/batch_put HTTP/1.1\nHost: x\nAuthorization: Bearer {ALICE}\n"
            f"Content-Length: {len(body)}\n\n").encode()
    for raw in (smuggle, bare):
        reader, writer = await asyncio.open_connection("127.0.0.1", daemon["port"])
        writer.write(raw + body)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 2)
        assert line.split()[1] == b"400", (raw, line)
        writer.close()
    assert daemon["store"].get(tenant_key("alice", KEYS[50])) is None
