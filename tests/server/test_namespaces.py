"""Namespaces through the real app and the real store: the owner renames its namespace by
registering it under another name (persisted through a restart and an index rebuild, retention
following the name), a tenant registers at most server.max_namespaces_per_tenant, and an
unknown namespace's 422 names the id the client sent."""

import shutil
import time

import pytest

from kvcache.server.request_state import STORE
from kvcache.server.config import ServerConfig
from kvcache.kvstore import Namespace, NamespaceLimitError, wire
from kvcache.client.common import error_from
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.errors import TierFullError
from kvcache.kvstore.hashing import tenant_namespace_id
from kvcache.kvstore.shm_directory import DirectoryReader
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.retention import RetentionPolicy, RetentionRule
from kvcache.tiering.config import DramConfig, NvmeConfig
from tests.server.test_server import ADMIN, ALICE, BOB, KEYS, NS, auth, payload, put
from tests.server.test_tenancy import TOKENS, register, serve, store_config  # noqa: F401 (fixture)


def named(name: str, ns: Namespace = NS) -> Namespace:
    return Namespace(**{**ns.to_dict(), "name": name})


SCRATCH = RetentionPolicy(namespaces={"scratch": RetentionRule(ttl_s=0.05)})


# ---------------------------------------------------------------- renaming, through the daemon
async def test_the_owner_renames_its_namespace_and_retention_follows(serve):
    c = await serve(retention=SCRATCH)
    store = c.server.app[STORE]
    assert await register(c, ALICE, named("prod")) == {"id": NS.id.hex()}
    assert await register(c, BOB, named("prod")) == {"id": NS.id.hex()}
    assert (await put(c, 0, ALICE)).status == 200 and (await put(c, 0, BOB)).status == 200
    assert await register(c, ALICE, named("prod")) == {"id": NS.id.hex()}          # same name: nothing to do
    assert await register(c, ALICE, named("scratch")) == {"id": NS.id.hex(), "renamed_from": "prod"}
    assert await register(c, ALICE, named("")) == {"id": NS.id.hex()}              # no name keeps the name
    assert store.namespaces[tenant_namespace_id("alice", NS.id)].name == "scratch"
    assert store.namespaces[tenant_namespace_id("bob", NS.id)].name == "prod"      # bob's own, untouched
    time.sleep(0.1)                       # past scratch's TTL: alice's block goes, bob's stays (72 h)
    k = KEYS[0].hex()
    assert (await c.head(f"/v1/blocks/{k}", headers=auth(ALICE))).status == 404
    assert (await c.head(f"/v1/blocks/{k}", headers=auth(BOB))).status == 200


async def test_a_rename_survives_a_restart_and_an_index_rebuild(tmp_path):
    from aiohttp.test_utils import TestClient, TestServer
    from kvcache.server.app import build_app
    data, stored = tmp_path / "d", tenant_namespace_id("alice", NS.id)
    for name, before in (("prod", None), ("scratch", "prod")):
        store = BlockStore(store_config(data))
        c = TestClient(TestServer(build_app(store, ServerConfig(tokens=TOKENS))))
        await c.start_server()
        try:
            reply = await register(c, ALICE, named(name))
            assert reply.get("renamed_from") == before
            assert (await put(c, 0, ALICE)).status == 200     # a segment: what a rebuild starts from
        finally:
            await c.close()
            store.close()
    with BlockStore(store_config(data)) as s:                   # the index
        assert s.namespaces[stored].name == "scratch"
    shutil.rmtree(data / "index")
    with BlockStore(store_config(data)) as s:                   # namespaces.json, through a rebuild
        assert s.namespaces[stored].name == "scratch" and s.namespaces[stored].owner == "alice"


# ---------------------------------------------------------------- renaming, in the store itself
def test_the_store_renames_and_keeps_the_old_name_when_the_disk_refuses(tmp_path):
    with BlockStore(store_config(tmp_path)) as s:
        assert s.register_namespace(named("prod")) == NS.id
        s.put(KEYS[0], payload(0), NS.id)
        assert s.register_namespace(named("scratch")) == NS.id
        assert s.namespaces[NS.id].name == "scratch"

        def full(descriptors):
            raise TierFullError("no space left on device")
        s.nvme.save_namespaces = full
        with pytest.raises(TierFullError):
            s.register_namespace(named("prod"))
        assert s.namespaces[NS.id].name == "scratch" and s.index.namespaces()[NS.id].name == "scratch"
        del s.nvme.save_namespaces
        assert s.save_namespace(named("prod")).name == "scratch"      # the registration it replaced
        assert s.save_namespace(named("")).name == "prod" and s.namespaces[NS.id].name == "prod"
    with BlockStore(store_config(tmp_path)) as s:
        assert s.namespaces[NS.id].name == "prod"
    shutil.rmtree(tmp_path / "index")
    with BlockStore(store_config(tmp_path)) as s:
        assert s.namespaces[NS.id].name == "prod"


def test_a_rename_that_changes_the_rule_withdraws_published_deadlines(tmp_path):
    """The read directory lets local clients read without asking; its entries carry the old
    rule's deadlines, which a shorter rule would outlive."""
    retention = RetentionPolicy(namespaces={"scratch": RetentionRule(ttl_s=60.0),
                                            "also-72h": RetentionRule()})
    cfg = StoreConfig(str(tmp_path), dram=DramConfig(capacity_bytes=4 << 20, page_bytes=64 << 10, prefault=False,
                                                     pin_memory="off", shared_memory=True),
                      nvme=NvmeConfig(segment_bytes=1 << 20), retention=retention)
    with BlockStore(cfg) as s:
        s.register_namespace(named("prod"))
        s.put(KEYS[0], payload(0), NS.id)
        reader = DirectoryReader(s.dram.directory_arena.view)     # what a local client reads
        published = lambda: reader.find(KEYS[0], time.time()) is not None   # noqa: E731
        assert published()
        s.register_namespace(named("also-72h"))        # the same rule: the deadlines still hold
        assert published()
        s.register_namespace(named("scratch"))
        assert not published()
        assert s.get(KEYS[0]) == payload(0)             # still stored: only the directory forgot it


def test_a_rename_withdraws_only_its_own_namespaces_entries_and_only_when_its_rule_gets_shorter(tmp_path):
    """The read directory is shared by every tenant: bob renaming his namespace back and forth
    between a long and a short rule must not cost alice her published entries."""
    retention = RetentionPolicy(namespaces={"scratch": RetentionRule(ttl_s=60.0)})
    cfg = StoreConfig(str(tmp_path), dram=DramConfig(capacity_bytes=4 << 20, page_bytes=64 << 10, prefault=False,
                                                     pin_memory="off", shared_memory=True),
                      nvme=NvmeConfig(segment_bytes=1 << 20), retention=retention)
    bobs = Namespace(**{**NS.to_dict(), "model_fingerprint": "other@1", "name": "x", "owner": "bob"})
    with BlockStore(cfg) as s:
        s.register_namespace(named("prod"))
        s.register_namespace(bobs)
        s.put(KEYS[0], payload(0), NS.id, tenant="alice")
        s.put(KEYS[1], payload(1), bobs.id, tenant="bob")
        reader = DirectoryReader(s.dram.directory_arena.view)
        published = lambda key: reader.find(key, time.time()) is not None   # noqa: E731
        assert published(KEYS[0]) and published(KEYS[1])
        for _ in range(3):
            s.save_namespace(Namespace(**{**bobs.to_dict(), "name": "scratch"}), 256)    # shorter: withdrawn
            assert published(KEYS[0]) and not published(KEYS[1])
            s.dram.publish([KEYS[1]], [time.time() + 60.0])          # a lease publishes the new deadline
            s.save_namespace(bobs, 256)                                      # longer: still safe
            assert published(KEYS[0]) and published(KEYS[1])
        assert s.get(KEYS[0]) == payload(0) and s.get(KEYS[1]) == payload(1)


# ---------------------------------------------------------------- how many a tenant registers
async def test_a_tenant_registers_at_most_max_namespaces_per_tenant(serve):
    c = await serve(ServerConfig(tokens=TOKENS, max_namespaces_per_tenant=2))
    models = [Namespace(f"model-{i}@1", "raw/v1", 16, name=f"m{i}") for i in range(3)]
    for ns in models[:2]:
        await register(c, ALICE, ns)
    body = await register(c, ALICE, models[2], status=429)
    assert body["error"] == "too_many_namespaces"
    assert "server.max_namespaces_per_tenant" in body["message"] and "rename" in body["message"]
    assert await register(c, ALICE, named("again", models[0])) == {"id": models[0].id.hex(), "renamed_from": "m0"}
    assert await register(c, ALICE, models[1]) == {"id": models[1].id.hex()}       # known ones still answer
    for ns in models[1:]:                                                          # bob's count is his own
        await register(c, BOB, ns)
    assert len(c.server.app[STORE].namespaces) == 4
    r = await c.post("/v1/admin/reconfigure", json={"server": {"max_namespaces_per_tenant": 3}}, headers=auth(ADMIN))
    assert (await r.json())["applied"] == ["server.max_namespaces_per_tenant"]
    assert await register(c, ALICE, models[2]) == {"id": models[2].id.hex()}      # the new limit, at once
    err = error_from(429, "Too Many Requests", "POST", "/v1/namespaces",
                     b'{"error": "too_many_namespaces", "message": "m"}')
    assert isinstance(err, NamespaceLimitError) and err.status == 429


def test_the_store_checks_the_limit_under_its_lock(tmp_path):
    with BlockStore(store_config(tmp_path)) as s:
        s.save_namespace(named("a"), max_per_owner=1)
        with pytest.raises(NamespaceLimitError):
            s.save_namespace(Namespace("other@1", "raw/v1", 16), max_per_owner=1)
        s.save_namespace(Namespace(**{**NS.to_dict(), "owner": "bob"}), max_per_owner=1)   # another owner
        s.register_namespace(Namespace("other@1", "raw/v1", 16))     # the store alone has no limit
        assert len(s.namespaces) == 3


# ---------------------------------------------------------------- 422 in the client's terms
async def test_an_unknown_namespace_is_named_by_the_id_the_client_sent(serve):
    c = await serve()
    stored = tenant_namespace_id("alice", NS.id).hex()
    r = await put(c, 0, ALICE)
    body = await r.json()
    assert r.status == 422 and NS.id.hex() in body["message"] and stored not in body["message"]
    frames = [wire.stream_header(1)] + wire.encode_put_frame(wire.PutFrame(KEYS[0], NS.id, payload(0)))
    r = await c.post("/v1/blocks/batch_put", data=b"".join(bytes(f) for f in frames), headers=auth(ALICE))
    body = await r.json()
    assert r.status == 422 and NS.id.hex() in body["message"] and stored not in body["message"]


async def test_a_daemon_without_tokens_has_no_namespace_limit(serve):
    """One trust domain: the per-tenant limit would only stop its one tenant."""
    c = await serve(ServerConfig(max_namespaces_per_tenant=1))
    for i in range(3):
        r = await c.post("/v1/namespaces", json=Namespace(f"model-{i}@1", "raw/v1", 16).to_dict())
        assert r.status == 200, await r.text()
