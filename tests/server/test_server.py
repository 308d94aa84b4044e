"""The daemon's HTTP API through aiohttp's test client: routes, errors, auth, tenants, metrics."""

import json

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvcache.server.app import build_app
from kvcache.server.config import ServerConfig, TokenInfo, parse_env_tokens
from kvcache.kvstore import Namespace, hash_blocks, wire
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.store import BlockStore
from kvcache.tiering.config import DramConfig, NvmeConfig

NS = Namespace("srv-model@1", "raw/v1", 16, name="srv")
KEYS = hash_blocks(NS, np.arange(16 * 8))
ALICE, BOB, ADMIN = "a" * 32, "b" * 32, "c" * 32


def payload(i: int, n: int = 3000) -> bytes:
    return bytes([i % 251]) * n


@pytest.fixture
async def client(tmp_path):
    store = BlockStore(StoreConfig(str(tmp_path), dram=DramConfig(capacity_bytes=8 << 20, page_bytes=1 << 20,
                                                                  prefault=False),
                                   nvme=NvmeConfig(segment_bytes=1 << 20)))
    cfg = ServerConfig(tokens=(TokenInfo(ALICE, "alice"), TokenInfo(BOB, "bob"), TokenInfo(ADMIN, "ops", True)),
                       max_block_bytes=1 << 20, max_batch_blocks=64, max_keys=100)
    async with TestClient(TestServer(build_app(store, cfg))) as c:
        yield c
    store.close()


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


async def register(c, token=ALICE) -> str:
    r = await c.post("/v1/namespaces", json=NS.to_dict(), headers=auth(token))
    assert r.status == 200
    return (await r.json())["id"]


async def put(c, i, token=ALICE, ns=None):
    return await c.put(f"/v1/blocks/{KEYS[i].hex()}", data=payload(i),
                       headers={**auth(token), "X-KVCache-Namespace": ns or NS.id.hex()})


async def test_single_block_roundtrip(client):
    assert await register(client) == NS.id.hex()
    r = await put(client, 0)
    assert await r.json() == {"stored": 1, "already_present": 0, "durable": True}
    assert (await (await put(client, 0)).json())["already_present"] == 1
    r = await client.get(f"/v1/blocks/{KEYS[0].hex()}", headers=auth(ALICE))
    assert r.status == 200 and await r.read() == payload(0) and r.headers["X-KVCache-Tier"] == "dram"
    assert (await client.head(f"/v1/blocks/{KEYS[0].hex()}", headers=auth(ALICE))).status == 200
    assert (await client.head(f"/v1/blocks/{KEYS[1].hex()}", headers=auth(ALICE))).status == 404
    r = await client.get(f"/v1/blocks/{KEYS[1].hex()}", headers=auth(ALICE))
    assert r.status == 404 and (await r.json())["error"] == "not_found"


async def test_batches_lookup_pins(client):
    await register(client)
    frames = [wire.stream_header(5)]
    for i in range(5):
        frames += wire.encode_put_frame(wire.PutFrame(KEYS[i], NS.id, payload(i)))
    r = await client.post("/v1/blocks/batch_put", data=b"".join(bytes(f) for f in frames), headers=auth(ALICE))
    assert await r.json() == {"stored": 5, "already_present": 0, "durable": True}
    keys = [k.hex() for k in KEYS[:7]]
    r = await client.post("/v1/lookup", json={"keys": keys}, headers=auth(ALICE))
    assert await r.json() == {"num_hits": 5, "tiers": ["dram"] * 5}
    r = await client.post("/v1/blocks/batch_get", json={"keys": keys}, headers=auth(ALICE))
    read = r.content.readexactly
    assert await wire.read_stream_header(read, 100) == 7
    got = [await wire.read_get_frame(read) for _ in range(7)]
    assert [g.key for g in got] == KEYS[:7]
    assert [g.payload for g in got] == [payload(i) for i in range(5)] + [None, None]
    r = await client.post("/v1/exists", json={"keys": keys[4:6]}, headers=auth(ALICE))
    assert (await r.json())["exists"] == [True, False]
    r = await client.post("/v1/pin", json={"keys": keys[:2], "ttl_s": 60}, headers=auth(ALICE))
    assert (await r.json())["changed"] == 2
    r = await client.post("/v1/unpin", json={"keys": keys[:3]}, headers=auth(ALICE))
    assert (await r.json())["changed"] == 2


async def test_auth_and_admin(client):
    assert (await client.get("/healthz")).status == 200
    r = await client.get("/v1/stats")
    assert r.status == 401 and "Bearer" in (await r.json())["message"]
    assert (await client.get("/v1/stats", headers=auth("x" * 32))).status == 401
    assert (await client.get("/v1/stats", headers=auth(ALICE))).status == 403   # store-wide: admin only
    assert (await client.get("/v1/stats", headers=auth(ADMIN))).status == 200
    await register(client)
    await put(client, 0)
    r = await client.post("/v1/delete", json={"keys": [KEYS[0].hex()]}, headers=auth(ALICE))
    assert r.status == 403
    r = await client.post("/v1/gc", json={"max_steps": 2}, headers=auth(ADMIN))
    assert r.status == 200 and "expired" in await r.json()


async def test_tenants_cannot_see_each_other(client):
    await register(client)
    await put(client, 0, ALICE)
    k = KEYS[0].hex()
    assert (await client.get(f"/v1/blocks/{k}", headers=auth(BOB))).status == 404
    assert (await client.head(f"/v1/blocks/{k}", headers=auth(BOB))).status == 404
    assert (await (await client.post("/v1/lookup", json={"keys": [k]}, headers=auth(BOB))).json())["num_hits"] == 0
    assert (await (await client.post("/v1/pin", json={"keys": [k]}, headers=auth(BOB))).json())["changed"] == 0
    await register(client, BOB)    # namespaces are per tenant too
    r = await put(client, 0, BOB)  # same key: stored anew, nothing revealed
    assert (await r.json())["already_present"] == 0
    r = await client.post("/v1/delete", json={"keys": [k]}, headers=auth(ADMIN))
    assert (await r.json())["deleted"] == 0  # the admin's tenant holds no such block either
    assert (await client.get(f"/v1/blocks/{k}", headers=auth(ALICE))).status == 200


@pytest.mark.parametrize("method, path, kwargs, status, code", [
    ("put", "/v1/blocks/" + "ab" * 16, {"data": b"x"}, 422, "unknown_namespace"),
    ("put", "/v1/blocks/abcd", {"data": b"x"}, 400, "bad_request"),          # a tenant's keys: >= 16 bytes
    ("get", "/v1/blocks/not-hex", {}, 400, "bad_request"),
    ("get", "/v1/blocks/" + "ab" * 65, {}, 400, "bad_request"),
    ("post", "/v1/lookup", {"data": b"{nope"}, 400, "bad_request"),
    ("post", "/v1/lookup", {"json": {"keys": "ab"}}, 400, "bad_request"),
    ("post", "/v1/lookup", {"json": {"keys": ["ab"] * 101}}, 413, "request_entity_too_large"),
    ("post", "/v1/blocks/batch_put", {"data": b"XXXX\x01\x00\x00\x00"}, 400, "bad_request"),
    ("post", "/v1/blocks/batch_put", {"data": wire.stream_header(65)}, 413, "request_entity_too_large"),
    ("post", "/v1/blocks/batch_get", {"json": {"keys": ["ab" * 16] * 65}}, 413, "request_entity_too_large"),
    ("post", "/v1/blocks/batch_put", {"data": wire.stream_header(2) + b"\x10" + b"k" * 8}, 400, "truncated_body"),
    ("post", "/v1/pin", {"json": {"keys": [], "ttl_s": -1}}, 400, "bad_request"),
    ("get", "/v1/nothing", {}, 404, "not_found"),
    ("delete", "/v1/lookup", {}, 405, "method_not_allowed"),
])
async def test_bad_requests_get_json_errors(client, method, path, kwargs, status, code):
    headers = {**auth(ALICE), "X-KVCache-Namespace": "00" * 16}
    r = await getattr(client, method)(path, headers=headers, **kwargs)
    assert r.status == status
    body = await r.json()
    assert body["error"] == code and body["message"]


async def test_put_without_namespace_header_is_400(client):
    r = await client.put("/v1/blocks/abcd", data=b"x", headers=auth(ALICE))
    assert r.status == 400 and "X-KVCache-Namespace" in (await r.json())["message"]


async def test_oversized_block_is_413(client):
    await register(client)
    r = await client.put(f"/v1/blocks/{KEYS[0].hex()}", data=b"x" * ((1 << 20) + 1),
                         headers={**auth(ALICE), "X-KVCache-Namespace": NS.id.hex()})
    assert r.status == 413


async def test_metrics_are_prometheus_text(client):
    await register(client)
    await put(client, 0)
    await client.get(f"/v1/blocks/{KEYS[0].hex()}", headers=auth(ALICE))
    await client.get(f"/v1/blocks/{KEYS[1].hex()}", headers=auth(ALICE))
    assert (await client.get("/metrics", headers=auth(ALICE))).status == 403
    text = await (await client.get("/metrics", headers=auth(ADMIN))).text()
    assert 'kvcache_blocks_total{op="get",result="hit",tier="dram"} 1.0' in text
    assert 'kvcache_blocks_total{op="get",result="miss",tier="none"} 1.0' in text
    assert 'kvcache_tier_capacity_bytes{tier="dram"}' in text and "kvcache_request_seconds_bucket" in text
    assert "kvcache_quarantined_total 0.0" in text


def test_server_config_rules(monkeypatch):
    with pytest.raises(ValueError, match="without auth"):
        ServerConfig(host="0.0.0.0")
    ServerConfig(host="::1")
    assert ServerConfig(host="0.0.0.0", tokens=(TokenInfo(ALICE, "a"),)).auth_required
    toks = parse_env_tokens(f"{ALICE}:alice, {ADMIN}:ops:admin")
    assert [(t.tenant, t.admin) for t in toks] == [("alice", False), ("ops", True)]
    with pytest.raises(ValueError, match="at least 16"):
        parse_env_tokens("short:x")
    with pytest.raises(ValueError, match="unknown"):
        ServerConfig.from_dict({"hots": "x"}, env={})
    cfg = ServerConfig.from_dict({"port": 9000, "tokens": [{"token": BOB, "tenant": "b"}]},
                                 env={"KVCACHE_TOKENS": f"{ALICE}:a"}, host="0.0.0.0")
    assert cfg.port == 9000 and cfg.host == "0.0.0.0" and len(cfg.tokens) == 2
    assert json.dumps(NS.to_dict())


async def test_tenant_quota(tmp_path):
    store = BlockStore(StoreConfig(str(tmp_path), dram=None, nvme=NvmeConfig(segment_bytes=1 << 20)))
    cfg = ServerConfig(tokens=(TokenInfo(ALICE, "alice", quota_bytes=10_000),))
    async with TestClient(TestServer(build_app(store, cfg))) as c:
        await register(c)
        assert (await put(c, 0)).status == 200          # 3000 bytes
        assert (await put(c, 1)).status == 200          # 6000
        assert (await put(c, 2)).status == 200          # 9000
        r = await put(c, 3)
        assert r.status == 507 and (await r.json())["error"] == "quota_exceeded"
        assert store.tenant_usage("alice") == (9000, 3)
        frames = [wire.stream_header(1)] + wire.encode_put_frame(wire.PutFrame(KEYS[4], NS.id, payload(4)))
        r = await c.post("/v1/blocks/batch_put", data=b"".join(bytes(f) for f in frames), headers=auth(ALICE))
        assert r.status == 507
    store.close()
