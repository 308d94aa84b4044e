"""Malformed input on every parsing boundary is the client's 4xx, never a 500 or a logged traceback:
JSON bodies and headers, namespaces, layouts, KVB1 frame metadata (both upload paths) and
reconfigure sections; and requests aiohttp itself cannot parse do not reach the log at ERROR."""

import asyncio
import json
import re
import logging

import pytest
from kvcache.server.request_state import STORE
from kvcache.kvstore import wire
from kvcache.kvstore.errors import BlockFormatError
from kvcache.kvstore.hashing import Namespace
from kvcache.kvstore.types import TensorSpec

from tests.server.test_bulk_put import daemon, read_response, request  # noqa: F401  (the native front fixture)
from tests.server.test_server import ADMIN, ALICE, KEYS, NS, auth, client, put, register  # noqa: F401

DEEP = "[" * 5000 + "]" * 5000
HUGE_INT = "1" + "0" * 400


def no_tracebacks(caplog) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not bad, [(r.name, r.getMessage()[:200]) for r in bad]


async def answer(r, status: int, *words: str) -> dict:
    assert r.status == status, await r.text()
    body = await r.json()
    assert set(body) == {"error", "message"}
    for w in words:
        assert w in body["message"], body
    return body


@pytest.mark.parametrize("path", ["/v1/exists", "/v1/lookup", "/v1/pin", "/v1/unpin", "/v1/blocks/batch_get",
                                  "/v1/namespaces", "/v1/gc", "/v1/delete", "/v1/admin/reconfigure"])
async def test_json_nested_thousands_deep_is_400(client, caplog, path):
    for body in (DEEP, '{"keys": ' + DEEP + "}"):
        r = await client.post(path, data=body, headers={**auth(ADMIN), "Content-Type": "application/json"})
        await answer(r, 400, "nested too deeply")
    no_tracebacks(caplog)


async def test_a_pin_ttl_of_400_digits_is_400(client, caplog):
    await register(client)
    assert (await put(client, 0)).status == 200
    r = await client.post("/v1/pin", data='{"keys": ["%s"], "ttl_s": %s}' % (KEYS[0].hex(), HUGE_INT),
                          headers=auth(ALICE))
    await answer(r, 400, "ttl_s")
    no_tracebacks(caplog)


@pytest.mark.parametrize("field,value,words", [
    ("block_size", 2 ** 32, "block_size"), ("block_size", 2 ** 64, "block_size"), ("block_size", 1.0, "block_size"),
    ("model_fingerprint", "\ud800", "UTF-8"), ("algo", [], "HashAlgo"), ("scheme_version", [1], "scheme")])
async def test_namespace_fields_out_of_range_are_400(client, caplog, field, value, words):
    body = {**NS.to_dict(), field: value}
    r = await client.post("/v1/namespaces", data=json.dumps(body), headers=auth(ALICE))
    await answer(r, 400, words)
    no_tracebacks(caplog)


def test_namespace_block_size_bounds():
    assert Namespace("m", "l", 0xFFFFFFFF).root     # the largest a u32 holds still hashes
    with pytest.raises(ValueError, match="block_size"):
        Namespace("m", "l", True)


@pytest.mark.parametrize("layout,words", [
    ('[["raw", "uint8", [1e400]]]', "shape"), ('[["raw", "uint8", [1.5]]]', "shape"),
    ('[["raw", "uint8", [true]]]', "shape"), ('[["raw", "uint8", [0, %s]]]' % ("9" * 30), "shape"),
    ('[["raw", "uint8", "abc"]]', "shape"), ('[[5, "uint8", [1]]]', "name"), ('[["raw", ["x"], [1]]]', "dtype"),
    ('{"raw": 1}', "[name, dtype"), ('[["raw", "uint8"]]', "[name, dtype"),
    ("[" * 3000 + "]" * 3000, "nested too deeply"),           # within aiohttp's 8 KiB header line
    ('[["\\ud800", "uint8", [1]]]', "name")])
async def test_malformed_layout_headers_are_400(client, caplog, layout, words):
    await register(client)
    r = await client.put(f"/v1/blocks/{KEYS[0].hex()}", data=b"x" if "[0," not in layout else b"",
                         headers={**auth(ALICE), "X-KVCache-Namespace": NS.id.hex(), "X-KVCache-Layout": layout})
    await answer(r, 400, words)
    no_tracebacks(caplog)


def test_tensor_specs_refuse_what_a_block_header_cannot_hold():
    assert TensorSpec("k", "float16", (2 ** 63 - 1,)).nbytes == 2 * (2 ** 63 - 1)
    for shape in ((2 ** 63,), (True,), [1], (1.0,)):
        with pytest.raises(ValueError, match="shape"):
            TensorSpec("k", "float16", shape)
    for name in ("", 5, "\ud800", "x" * 256):
        with pytest.raises(ValueError, match="name"):
            TensorSpec(name, "float16", (1,))


BAD_META = [(DEEP.encode(), "nested too deeply"), (b'{"ttl_s": %s}' % HUGE_INT.encode(), "ttl_s"),
            (b'{"ttl_s": "60"}', "ttl_s"), (b'{"layout": [["raw", "uint8", [1e400]]]}', "shape"),
            (b'{"layout": [["raw", "uint8", [1]]], "x": ' + b"[" * 3000 + b"]" * 3000 + b"}", "nested too deeply"),
            (b"[1]", "JSON object"), (b'{"layout": 5}', "layout"), (b"\xff\xfe", "not JSON"),
            (b"{}" + b" " * wire.MAX_META, "exceeds")]


def frame_with_meta(meta: bytes, key: bytes = KEYS[1]) -> bytes:
    return (wire.stream_header(1) + bytes([len(key)]) + key + NS.id + len(meta).to_bytes(4, "little") + meta
            + (1).to_bytes(8, "little") + b"x")


@pytest.mark.parametrize("meta,words", BAD_META)
def test_frame_metadata_is_checked_where_both_upload_paths_parse_it(meta, words):
    head = frame_with_meta(meta)[wire.STREAM_HEADER_BYTES:]
    with pytest.raises(BlockFormatError, match=words.replace("[", r"\[")):
        wire.parse_put_head(head, 1 << 20)

    async def read_all():
        buf = memoryview(head)
        pos = 0

        async def read(n):
            nonlocal pos
            pos += n
            return bytes(buf[pos - n: pos])
        return await wire.read_put_frame(read, 1 << 20)
    with pytest.raises(BlockFormatError, match=words.replace("[", r"\[")):
        asyncio.run(read_all())


@pytest.mark.parametrize("meta,words", BAD_META)
async def test_bad_frame_metadata_is_400_on_the_aiohttp_batch_put(client, caplog, meta, words):
    await register(client)
    r = await client.post("/v1/blocks/batch_put", data=frame_with_meta(meta), headers=auth(ALICE))
    await answer(r, 400)
    no_tracebacks(caplog)


async def test_bad_frame_metadata_is_400_on_the_native_upload_path(daemon, caplog):  # noqa: F811
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon["port"])
    try:
        for meta, _ in BAD_META:
            writer.write(request(frame_with_meta(meta)))
            status, _, body = await asyncio.wait_for(read_response(reader), 10)
            assert status == 400 and body["error"] == "bad_request", (meta[:40], body)
    finally:
        writer.close()
    no_tracebacks(caplog)


@pytest.mark.parametrize("section,words", [
    ({"dram": 5}, "[dram] must be a table"), ({"nvme": []}, "[nvme] must be a table"),
    ({"retention": "x"}, "[retention] must be a table"), ({"object": 5}, "[object] must be a table"),
    ({"store": 5}, "[store] must be a table"), ({"retention": {"namespaces": 5}}, "[retention.namespaces]"),
    ({"retention": {"tenants": {"bob": 5}}}, "[retention.tenants.bob]"),
    ({"retention": {"ttl_hours": 1e400}}, "finite number"), ({"retention": {"ttl_hours": "72"}}, "finite number"),
    ({"retention": {"namespaces": {"x": {"ttl_hours": int(HUGE_INT)}}}}, "finite number"),
    ({"dram": {"capacity_mib": 1e400}}, "capacity_mib"), ({"dram": {"capacity_bytes": "x"}}, "capacity_bytes"),
    ({"dram": {"enabled": "x"}}, "enabled"), ({"nvme": {"fsync_interval_s": True}}, "fsync_interval_s"),
    ({"store": {"dram": None}}, ""), ({"store": {"retention": {}}}, "retention")])
async def test_malformed_reconfigure_sections_are_400_and_change_nothing(client, caplog, section, words):
    app = client.server.app
    old = app[STORE].config
    r = await client.post("/v1/admin/reconfigure", json=section, headers=auth(ADMIN))
    await answer(r, 400, words)
    assert app[STORE].config is old
    no_tracebacks(caplog)


@pytest.mark.parametrize("raw", [
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n",
    b"POST /v1/exists HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/exists HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\n\x00\x01\x02\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /\x7f HTTP/9.9\r\n\r\n"])
async def test_requests_aiohttp_cannot_parse_are_not_logged_at_error(client, caplog, raw):
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(raw)
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(1 << 16), 10)
    writer.close()
    assert re.search(rb"HTTP/1.. 4", reply) and not re.search(rb"HTTP/1.. 5", reply), reply[:200]
    no_tracebacks(caplog)
    assert (await client.get("/healthz")).status == 200
