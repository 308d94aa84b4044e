"""Tenants and credentials through the real app (aiohttp TestServer): every token names a tenant,
namespaces belong to tenants (renaming and limits: test_namespaces.py), KVCACHE_TOKENS tokens can
be revoked, an admin deletes another tenant's blocks only when it names the tenant, and a metrics
token reads /metrics only."""

import json
import time

import pytest

from kvcache.server.request_state import STORE, authenticate
from kvcache.server.config import ServerConfig, TokenInfo, parse_env_tokens
from kvcache.server.shm_control import ControlSession
from kvcache.kvstore import Namespace, wire
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.hashing import tenant_key, tenant_namespace_id
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.retention import RetentionPolicy, RetentionRule
from kvcache.tiering.config import NvmeConfig
from tests.server.app_clients import AppClients
from tests.server.test_server import ADMIN, ALICE, BOB, KEYS, NS, auth, payload, put

CAROL, DAVE, PROM = "d" * 32, "e" * 32, "f" * 32
TOKENS = (TokenInfo(ALICE, "alice"), TokenInfo(BOB, "bob"), TokenInfo(ADMIN, "ops", admin=True),
          TokenInfo(PROM, metrics=True))


def store_config(path, retention=RetentionPolicy()) -> StoreConfig:
    return StoreConfig(str(path), dram=None, nvme=NvmeConfig(segment_bytes=1 << 20), retention=retention)


@pytest.fixture
async def serve(tmp_path):
    """serve(config, retention=..., config_file=...) -> a TestClient on a fresh store."""
    async with AppClients() as clients:
        async def start(cfg=ServerConfig(tokens=TOKENS), retention=RetentionPolicy(), config_file=""):
            return await clients.open(store_config(tmp_path / f"d{len(clients)}", retention), cfg,
                                      config_file=config_file)
        yield start


async def register(c, token, ns=NS, status=200):
    r = await c.post("/v1/namespaces", json=ns.to_dict(), headers=auth(token))
    assert r.status == status, await r.text()
    return await r.json()


# ---------------------------------------------------------------- every token names a tenant
@pytest.mark.parametrize("make", [
    lambda: TokenInfo(CAROL, ""),
    lambda: TokenInfo(CAROL, "  "),
    lambda: ServerConfig.from_dict({"tokens": [{"token": CAROL}]}, env={}),
    lambda: ServerConfig.from_dict({"tokens": [{"token": CAROL, "tenant": ""}]}, env={}),
    lambda: ServerConfig.from_dict({}, env={"KVCACHE_TOKENS": f"{CAROL}:"}),
    lambda: parse_env_tokens(f"{CAROL}::admin"),
])
def test_a_token_without_a_tenant_is_refused_at_start(make):
    with pytest.raises(ValueError, match="names no tenant"):
        make()


def test_token_kinds_and_their_rules():
    with pytest.raises(ValueError, match="metrics token"):
        TokenInfo(CAROL, "acme", metrics=True)      # a metrics token reaches no tenant's data
    with pytest.raises(ValueError, match="twice"):
        ServerConfig(tokens=(TokenInfo(CAROL, "a"), TokenInfo(CAROL, "b")))
    with pytest.raises(ValueError, match="unknown token fields"):
        ServerConfig.from_dict({"tokens": [{"token": CAROL, "tennant": "a"}]}, env={})
    [m] = parse_env_tokens(f"{PROM}::metrics")
    assert m.metrics and not m.tenant and not m.admin
    cfg = ServerConfig(tokens=TOKENS)
    for t in cfg.tokens:     # no token acts in the raw key space ("" keeps keys as they are)
        who = authenticate(cfg, f"Bearer {t.token}", "/v1/blocks/batch_put")
        assert (who is None) if t.metrics else who.tenant
    assert authenticate(cfg, f"Bearer {PROM}", "/metrics").metrics_only


async def test_a_tenant_less_token_is_refused_at_reconfigure(serve):
    c = await serve()
    body = {"server": {"tokens": [{"token": ALICE, "tenant": "alice"}, {"token": CAROL},
                                  {"token": ADMIN, "tenant": "ops", "admin": True}]}}
    r = await c.post("/v1/admin/reconfigure", json=body, headers=auth(ADMIN))
    assert r.status == 400 and "names no tenant" in (await r.json())["message"]
    assert (await c.post("/v1/lookup", json={"keys": []}, headers=auth(CAROL))).status == 401
    assert (await c.post("/v1/lookup", json={"keys": []}, headers=auth(BOB))).status == 200   # unchanged


async def test_no_other_token_reaches_alices_blocks(serve):
    c = await serve()
    await register(c, ALICE)
    assert (await put(c, 0, ALICE)).status == 200
    stored = tenant_key("alice", KEYS[0]).hex()       # what a token in the raw key space would compute
    for token in (BOB, ADMIN):
        await register(c, token)
        for k in (KEYS[0].hex(), stored):
            assert (await c.get(f"/v1/blocks/{k}", headers=auth(token))).status == 404
            r = await c.post("/v1/exists", json={"keys": [k]}, headers=auth(token))
            assert (await r.json())["exists"] == [False]
            r = await c.post("/v1/pin", json={"keys": [k]}, headers=auth(token))
            assert (await r.json())["changed"] == 0
        r = await c.put(f"/v1/blocks/{stored}", data=b"garbage",
                        headers={**auth(token), "X-KVCache-Namespace": NS.id.hex()})
        assert (await r.json())["stored"] == 1         # lands in the token's own space
    assert (await put(c, 1, ALICE)).status == 200
    r = await c.get(f"/v1/blocks/{KEYS[0].hex()}", headers=auth(ALICE))
    assert await r.read() == payload(0)
    assert c.server.app[STORE].index.get_many([tenant_key("alice", KEYS[0])])[0].hard_pins == 0


# ---------------------------------------------------------------- namespaces belong to tenants
async def test_another_tenant_cannot_rename_your_namespace_or_its_retention(serve):
    retention = RetentionPolicy(namespaces={"scratch": RetentionRule(ttl_s=0.05)})
    c = await serve(retention=retention)
    k = KEYS[0].hex()
    r = await c.put(f"/v1/blocks/{k}", data=b"x", headers={**auth(BOB), "X-KVCache-Namespace": NS.id.hex()})
    assert r.status == 422                              # before anyone registered
    scratch, prod = Namespace(**{**NS.to_dict(), "name": "scratch"}), Namespace(**{**NS.to_dict(), "name": "prod"})
    assert await register(c, BOB, scratch) == {"id": NS.id.hex()}      # the client's id, as ever
    assert await register(c, ALICE, prod) == {"id": NS.id.hex()}       # not bob's name: her own namespace
    store = c.server.app[STORE]
    assert store.namespaces[tenant_namespace_id("alice", NS.id)].name == "prod"
    assert store.namespaces[tenant_namespace_id("bob", NS.id)].name == "scratch"
    assert NS.id not in store.namespaces
    for token in (ALICE, BOB):
        assert (await put(c, 0, token)).status == 200
    time.sleep(0.1)                                     # past scratch's TTL, far within the default 72 h
    assert (await c.head(f"/v1/blocks/{k}", headers=auth(ALICE))).status == 200
    assert (await c.head(f"/v1/blocks/{k}", headers=auth(BOB))).status == 404
    r = await c.post("/v1/lookup", json={"keys": [k], "namespace": NS.id.hex()}, headers=auth(ALICE))
    assert (await r.json())["num_hits"] == 1


async def test_a_tenant_learns_nothing_of_others_namespaces(serve):
    c = await serve()
    other = Namespace("another-model@2", "raw/v1", 16)
    await register(c, ALICE, other)
    for ns in (NS, other):        # registered by alice or by nobody: the same answers for bob
        r = await c.put(f"/v1/blocks/{KEYS[0].hex()}", data=b"x",
                        headers={**auth(BOB), "X-KVCache-Namespace": ns.id.hex()})
        assert r.status == 422
        assert await register(c, BOB, ns) == {"id": ns.id.hex()}
    r = await c.post("/v1/namespaces", json={**NS.to_dict(), "owner": "alice"}, headers=auth(BOB))
    assert r.status == 400 and "owner" in (await r.json())["message"]


async def test_batch_put_frames_name_the_callers_own_namespace(serve):
    c = await serve()
    await register(c, ALICE)
    frames = [wire.stream_header(1)] + wire.encode_put_frame(wire.PutFrame(KEYS[0], NS.id, payload(0)))
    body = b"".join(bytes(f) for f in frames)
    r = await c.post("/v1/blocks/batch_put", data=body, headers=auth(BOB))
    assert r.status == 422                              # alice's registration is not bob's
    r = await c.post("/v1/blocks/batch_put", data=body, headers=auth(ALICE))
    assert (await r.json())["stored"] == 1
    [meta] = c.server.app[STORE].index.get_many([tenant_key("alice", KEYS[0])])
    assert meta.namespace_id == tenant_namespace_id("alice", NS.id)


def test_a_namespaces_owner_is_persisted(tmp_path):
    ns = Namespace(**{**NS.to_dict(), "owner": "alice", "name": "prod"})
    assert Namespace.from_dict(json.loads(json.dumps(ns.to_dict()))) == ns
    assert ns.id == tenant_namespace_id("alice", NS.id) != NS.id and ns.root == NS.root
    assert "owner" not in NS.to_dict()                  # unowned: the descriptor older builds read
    with BlockStore(store_config(tmp_path)) as s:
        s.register_namespace(ns)
    with BlockStore(store_config(tmp_path)) as s:
        assert s.namespaces[ns.id].owner == "alice"
    with open(tmp_path / "nvme" / "namespaces.json") as f:
        assert json.load(f)[ns.id.hex()]["owner"] == "alice"


# ---------------------------------------------------------------- tokens from the environment
async def test_an_environment_token_can_be_revoked(serve, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHE_TOKENS", f"{CAROL}:carol,{DAVE}:dave")
    file_tokens = [{"token": ALICE, "tenant": "alice"}, {"token": ADMIN, "tenant": "ops", "admin": True}]
    path = tmp_path / "kv.toml"
    path.write_text("".join(f'[[server.tokens]]\ntoken = "{t["token"]}"\ntenant = "{t["tenant"]}"\n'
                            f'admin = {str(t.get("admin", False)).lower()}\n' for t in file_tokens))
    c = await serve(ServerConfig.from_dict({"tokens": file_tokens}), config_file=str(path))
    lookup = {"keys": []}
    assert (await c.post("/v1/lookup", json=lookup, headers=auth(CAROL))).status == 200
    keep_dave = file_tokens + [{"token": DAVE, "tenant": "dave"}]
    r = await c.post("/v1/admin/reconfigure", json={"server": {"tokens": keep_dave}}, headers=auth(ADMIN))
    assert r.status == 200 and (await r.json())["applied"] == ["server.tokens"]
    assert (await c.post("/v1/lookup", json=lookup, headers=auth(CAROL))).status == 401
    r = await c.post("/v1/admin/reconfigure", headers=auth(ADMIN))       # the file again, as SIGHUP does
    assert r.status == 200 and (await r.json())["applied"] == []          # carol stays revoked
    assert (await c.post("/v1/lookup", json=lookup, headers=auth(CAROL))).status == 401
    assert (await c.post("/v1/lookup", json=lookup, headers=auth(DAVE))).status == 200


async def test_a_reconfigure_that_leaves_no_tokens_is_refused(serve):
    c = await serve()
    r = await c.post("/v1/admin/reconfigure", json={"server": {"tokens": []}}, headers=auth(ADMIN))
    assert r.status == 400 and "auth off" in (await r.json())["message"]
    assert (await c.post("/v1/lookup", json={"keys": []})).status == 401        # auth still on
    assert (await c.post("/v1/lookup", json={"keys": []}, headers=auth(ALICE))).status == 200


# ---------------------------------------------------------------- admins and metrics
async def test_an_admin_deletes_another_tenants_blocks_only_when_it_names_the_tenant(serve):
    c = await serve()
    await register(c, ALICE)
    await put(c, 0, ALICE)
    keys = {"keys": [KEYS[0].hex()]}
    r = await c.post("/v1/delete", json=keys, headers=auth(ADMIN))
    assert (await r.json())["deleted"] == 0                           # its own tenant's keys
    r = await c.post("/v1/delete", json={**keys, "tenant": "alice"}, headers=auth(ALICE))
    assert r.status == 403
    r = await c.post("/v1/delete", json={**keys, "tenant": ""}, headers=auth(ADMIN))
    assert r.status == 400                                            # never the raw key space
    r = await c.post("/v1/delete", json={**keys, "tenant": "alice"}, headers=auth(ADMIN))
    assert (await r.json())["deleted"] == 1
    assert (await c.get(f"/v1/blocks/{KEYS[0].hex()}", headers=auth(ALICE))).status == 404


async def test_a_metrics_token_reads_metrics_and_nothing_else(serve):
    c = await serve()
    assert (await c.get("/metrics", headers=auth(PROM))).status == 200
    assert (await c.get("/metrics", headers=auth(ADMIN))).status == 200
    assert (await c.get("/metrics", headers=auth(ALICE))).status == 403
    assert (await c.get("/healthz", headers=auth(PROM))).status == 200
    k = KEYS[0].hex()
    for method, path, kw in (("get", "/v1/stats", {}), ("post", "/v1/lookup", {"json": {"keys": [k]}}),
                             ("get", f"/v1/blocks/{k}", {}), ("post", "/v1/namespaces", {"json": NS.to_dict()}),
                             ("post", "/v1/delete", {"json": {"keys": [k]}}), ("get", "/v1/shm", {}),
                             ("post", "/v1/admin/reconfigure", {"json": {}}), ("post", "/v1/gc", {})):
        r = await getattr(c, method)(path, headers=auth(PROM), **kw)
        assert r.status == 403 and "metrics" in (await r.json())["message"], path


async def test_a_metrics_token_gets_no_shared_memory(serve):
    c = await serve()
    session = ControlSession(c.server.app)
    assert session.hello(PROM.encode())[0] == 403 and session.tenant is None
    assert session.hello(ALICE.encode())[0] == 403                  # no shared_memory flag either
    assert session.hello(ADMIN.encode()) == (0, b"ops")            # an admin leases in its own tenant's keys


def test_healthz_without_a_token_acts_as_nobody():
    """/healthz answers anyone, so what it runs as must hold no rights at all (not the
    open, admin principal of a daemon without auth)."""
    from kvcache.server.request_state import identify
    cfg = ServerConfig(tokens=(TokenInfo(ALICE, "alice"),))
    who = identify(cfg, "", "/healthz")
    assert who is not None and not who.admin and not who.shm and who.metrics_only
    assert identify(ServerConfig(), "", "/healthz").admin      # no auth: one trusted tenant


@pytest.mark.parametrize("flag, value", [("admin", "false"), ("shared_memory", "no"), ("metrics", "false"),
                                         ("admin", 1), ("shared_memory", "0")])
def test_a_token_flag_that_is_no_boolean_is_refused(flag, value):
    """bool("false") is True: a flag written as a string must be refused, never read as a grant."""
    with pytest.raises(ValueError, match=f"{flag} must be true or false"):
        ServerConfig.from_dict({"tokens": [{"token": CAROL, "tenant": "carol", flag: value}]}, env={})


async def test_a_reconfigure_with_a_string_flag_changes_nothing(serve):
    c = await serve()
    body = {"server": {"tokens": [{"token": ALICE, "tenant": "alice", "admin": "false"},
                                  {"token": ADMIN, "tenant": "ops", "admin": True}]}}
    r = await c.post("/v1/admin/reconfigure", json=body, headers=auth(ADMIN))
    assert r.status == 400 and "admin must be true or false" in (await r.json())["message"]
    assert (await c.get("/v1/stats", headers=auth(ALICE))).status == 403


def test_a_token_listed_in_the_file_and_the_environment_is_named_so():
    with pytest.raises(ValueError, match="KVCACHE_TOKENS together"):
        ServerConfig.from_dict({"tokens": [{"token": CAROL, "tenant": "carol"}]}, env={"KVCACHE_TOKENS": f"{CAROL}:c"})


@pytest.mark.parametrize("name", ["shm_lease_s", "request_timeout_s", "header_timeout_s", "keepalive_s"])
def test_a_timeout_too_large_for_the_timers_is_refused(name):
    """10**400 is below float('inf') as an int, and then every timer built from it overflows."""
    with pytest.raises(ValueError, match=f"server.{name} must be a positive number of seconds up to"):
        ServerConfig(**{name: 10 ** 400})
