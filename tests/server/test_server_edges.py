"""The daemon's API at its edges (found by review): quotas under concurrent puts, bodies without a
Content-Length, partial reconfigures, malformed fields as 400s, and the client's bounds."""

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvcache.server.app import build_app
from kvcache.server.config import ServerConfig, TokenInfo
from kvcache.kvstore import wire
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.types import PutItem
from kvcache.tiering.config import NvmeConfig
from tests.server.test_server import ADMIN, ALICE, KEYS, NS, auth, client, payload, put, register  # noqa: F401


@pytest.fixture
async def quota_client(tmp_path):
    store = BlockStore(StoreConfig(str(tmp_path), dram=None, nvme=NvmeConfig(segment_bytes=4 << 20)))
    cfg = ServerConfig(tokens=(TokenInfo(ALICE, "alice", quota_bytes=10_000), TokenInfo(ADMIN, "ops", True)))
    async with TestClient(TestServer(build_app(store, cfg))) as c:
        yield c, store
    store.close()


async def test_concurrent_puts_stay_within_the_quota(quota_client, monkeypatch):
    c, store = quota_client
    await register(c)
    real = store.put_many

    def slow_put(items):                   # widen the window between a put's check and its commit
        import time
        time.sleep(0.05)
        return real(items)
    monkeypatch.setattr(store, "put_many", slow_put)
    codes = [r.status for r in await asyncio.gather(*(put(c, i) for i in range(8)))]   # 3000 bytes each
    assert sorted(codes) == [200] * 3 + [507] * 5
    assert store.tenant_usage("alice") == (9000, 3)


async def test_a_chunked_body_over_the_block_limit_is_413(client):
    await register(client)

    async def chunks():
        for _ in range(3):
            yield b"x" * (600 << 10)       # 1.8 MiB against a 1 MiB limit, no Content-Length
    r = await client.put(f"/v1/blocks/{KEYS[0].hex()}", data=chunks(),
                         headers={**auth(ALICE), "X-KVCache-Namespace": NS.id.hex()})
    assert r.status == 413
    assert (await client.head(f"/v1/blocks/{KEYS[0].hex()}", headers=auth(ALICE))).status == 404


@pytest.mark.parametrize("headers, what", [({"X-KVCache-Layout": '[[1, "uint8", [10]]]'}, "Layout"),
                                           ({"X-KVCache-Layout": '{"a": 1}'}, "Layout"),
                                           ({"X-KVCache-TTL": "inf"}, "ttl"), ({"X-KVCache-TTL": "x"}, "")])
async def test_malformed_put_headers_are_400(client, headers, what):
    await register(client)
    r = await client.put(f"/v1/blocks/{KEYS[0].hex()}", data=b"x" * 10,
                         headers={**auth(ALICE), "X-KVCache-Namespace": NS.id.hex(), **headers})
    assert r.status == 400 and what in (await r.json())["message"]


async def test_gc_body_and_pin_ttl_are_checked(client):
    for body in ([1], {"max_steps": "x"}, {"max_steps": 0}):
        r = await client.post("/v1/gc", json=body, headers=auth(ADMIN))
        assert r.status == 400 and "max_steps" in (await r.json())["message"]
    r = await client.post("/v1/pin", json={"keys": [], "ttl_s": 1e400}, headers=auth(ALICE))
    assert r.status == 400 and "finite" in (await r.json())["message"]


async def test_bytes_after_the_last_frame_are_400(client):
    await register(client)
    frames = [wire.stream_header(1)] + wire.encode_put_frame(wire.PutFrame(KEYS[0], NS.id, payload(0)))
    r = await client.post("/v1/blocks/batch_put", data=b"".join(bytes(f) for f in frames) + b"junk",
                          headers=auth(ALICE))
    assert r.status == 400 and "follow the last frame" in (await r.json())["message"]


async def test_a_partial_reconfigure_keeps_what_it_does_not_send(client):
    r = await client.post("/v1/admin/reconfigure", json={"retention": {"ttl_hours": 24}}, headers=auth(ADMIN))
    assert r.status == 200, await r.text()
    body = await r.json()
    assert body == {"applied": ["retention"], "restart_required": []}
    assert (await client.get("/v1/stats")).status == 401                  # auth is still on
    assert (await client.get("/v1/stats", headers=auth(ADMIN))).status == 200
    r = await client.post("/v1/admin/reconfigure", json={"server": {"max_keys": 5}}, headers=auth(ADMIN))
    assert (await r.json())["applied"] == ["server.max_keys"]
    r = await client.post("/v1/lookup", json={"keys": ["ab" * 16] * 6}, headers=auth(ALICE))
    assert r.status == 413


@pytest.mark.parametrize("server", [{"max_keys": "abc"}, {"max_keys": -1}, {"max_block_bytes": 0},
                                    {"shm_lease_s": "x"}, {"tokens": [{"token": "t" * 20, "quota_bytes": "x"}]},
                                    {"tokens": "x"}])
async def test_reconfigure_refuses_bad_settings_and_changes_nothing(client, server):
    r = await client.post("/v1/admin/reconfigure", json={"server": server}, headers=auth(ADMIN))
    assert r.status == 400, await r.text()
    r = await client.post("/v1/lookup", json={"keys": ["ab" * 16] * 3}, headers=auth(ALICE))
    assert r.status == 200, await r.text()


def test_the_environment_token_opens_the_shared_memory_path(monkeypatch):
    from kvcache.client.async_client import AsyncKVClient
    from kvcache.client.sync_client import KVClient
    monkeypatch.setenv("KVCACHE_TOKEN", ADMIN)
    assert AsyncKVClient("http://127.0.0.1:1")._token == ADMIN
    sync = KVClient("http://127.0.0.1:1")
    assert sync._client._token == ADMIN
    sync.close()


async def test_a_control_socket_that_never_answers_times_out(tmp_path):
    from kvcache.client.shm_client import ArenaUnavailable, ShmControl
    path = str(tmp_path / "ctl.sock")
    silent = await asyncio.start_unix_server(lambda r, w: None, path)      # accepts, never answers
    async with silent:
        with pytest.raises(ArenaUnavailable, match="did not answer"):
            await asyncio.wait_for(ShmControl.connect(path, ADMIN, timeout_s=0.5), 10)


def test_put_items_of_infinite_ttl_are_refused(tmp_path):
    store = BlockStore(StoreConfig(str(tmp_path), dram=None, nvme=NvmeConfig(segment_bytes=1 << 20)))
    store.register_namespace(NS)
    with pytest.raises(ValueError, match="finite"):
        store.put_many([PutItem(KEYS[0], b"x" * 10, NS.id, None, "", float("inf"))])
    store.close()


def test_only_an_ascii_content_length_takes_the_native_upload_path():
    from kvcache.server.front.bulk_put import BULK_PATH, wants
    from kvcache.server.front.connection import Head
    head = lambda length: Head("POST", BULK_PATH, "HTTP/1.1", {"content-length": length}, 0)  # noqa: E731
    assert wants(head("12")) and not wants(head("\u00b2")) and not wants(head("1\u0661"))


async def test_a_cancelled_control_call_never_hands_its_answer_to_the_next(tmp_path):
    """A caller cancelled while its lease request is in flight: the connection closes, so the
    next call fails (and the client reads over HTTP) instead of taking the old answer as its own."""
    from kvcache.kvstore import shm_wire as w
    from kvcache.client.shm_client import ShmControl
    path = str(tmp_path / "ctl.sock")

    async def slow_echo(reader, writer):              # answers each request with its own body, late
        try:
            while True:
                n, _ = w.split_head(await reader.readexactly(w.HEAD_BYTES))
                body = await reader.readexactly(n)
                await asyncio.sleep(0.3)
                writer.write(w.frame(0, body))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
    server = await asyncio.start_unix_server(slow_echo, path)
    async with server:
        reader, writer = await asyncio.open_unix_connection(path)
        ctl = ShmControl(reader, writer, timeout_s=5)
        first = asyncio.create_task(ctl.call(w.LEASE, b"first"))
        await asyncio.sleep(0.05)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        try:
            answer = await ctl.call(w.LEASE, b"second")
        except (OSError, asyncio.IncompleteReadError):
            answer = None                              # the closed connection: fall back
        assert answer != (0, b"first")
        assert not ctl.alive()


def test_a_blocking_control_socket_that_never_answers_is_unavailable_not_an_error(tmp_path):
    import socket
    from kvcache.client.shm_client import ArenaUnavailable, BlockingShmControl
    path = str(tmp_path / "ctl.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)                                 # accepts (in the backlog), never answers
    try:
        with pytest.raises(ArenaUnavailable, match="did not answer"):
            BlockingShmControl.connect(path, ADMIN, timeout_s=0.3)
    finally:
        listener.close()


def test_a_boolean_frame_ttl_is_refused():
    from kvcache.kvstore.errors import BlockFormatError
    meta = b'{"ttl_s": true}'
    frame = bytes([16]) + KEYS[0] + NS.id + len(meta).to_bytes(4, "little") + meta + (0).to_bytes(8, "little")
    with pytest.raises(BlockFormatError, match="boolean"):
        wire.parse_put_head(frame, 1 << 20)


async def test_json_bodies_are_bounded_by_the_live_key_limit(client):
    """A JSON key list is bounded by max_keys (live, reconfigurable), not by the block limit the
    app was built with: 30,000 keys of 64 bytes (3.9 MB of JSON) pass a 1 MiB block limit once
    max_keys allows them, and a body past the JSON bound is a 413 before it is parsed."""
    keys = [bytes([i % 251]) * 32 + i.to_bytes(32, "big") for i in range(30_000)]
    body = {"keys": [k.hex() for k in keys]}
    r = await client.post("/v1/exists", json=body, headers=auth(ALICE))
    assert r.status == 413                                      # max_keys is 100
    r = await client.post("/v1/admin/reconfigure", json={"server": {"max_keys": 30_000}}, headers=auth(ADMIN))
    assert r.status == 200, await r.text()
    r = await client.post("/v1/exists", json=body, headers=auth(ALICE))
    assert r.status == 200, await r.text()
    assert (await r.json())["exists"] == [False] * 30_000
    r = await client.post("/v1/exists", data=b"[" * (30_000 * 136 + (1 << 20) + 1), headers=auth(ALICE))
    assert r.status == 413
    r = await client.post("/v1/exists", data=b"\xff{", headers=auth(ALICE))
    assert r.status == 400 and "not JSON" in await r.text()
