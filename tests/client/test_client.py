"""The daemon client: the same conformance checks for BlockStore and KVClient (over build_app on
an aiohttp TestServer running in a thread of its own), errors, tenant isolation (retries:
test_client_retries.py)."""

import asyncio
import threading

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvcache.server.app import build_app
from kvcache.server.config import ServerConfig, TokenInfo
from kvcache.kvstore import Namespace, Tier
from kvcache.client.async_client import AsyncKVClient, AuthError, QuotaExceededError, _split_puts
from kvcache.client.sync_client import KVClient
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.errors import BlockFormatError, TierFullError, UnknownNamespaceError
from kvcache.client.open_store import open_store
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.types import PutItem
from kvcache.kvstore.types import TensorSpec
from kvcache.tiering.config import DramConfig, NvmeConfig
from tests.conftest import NS, make_keys, payload_for, put_blocks

TOKEN_A, TOKEN_B, TOKEN_C = "tenant-a-token-0123456789", "tenant-b-token-0123456789", "tenant-c-token-0123456789"
TOKEN_Q = "tenant-q-token-0123456789"   # a tenant with a 10 KiB quota
TOKENS = (TokenInfo(TOKEN_A, "a", admin=True), TokenInfo(TOKEN_B, "b", admin=True), TokenInfo(TOKEN_C, "c"),
          TokenInfo(TOKEN_Q, "q", quota_bytes=10 << 10))
MAX_BATCH = 128  # the daemon's limit in these tests, so a 300-block put_many must be split
FAST = dict(retries=2, backoff_s=0.01, max_batch_blocks=MAX_BATCH, max_batch_bytes=4 << 20, timeout_s=20)


class ServerThread:
    """An aiohttp app served on 127.0.0.1 (TestServer) or a Unix socket, from its own loop and thread."""

    def __init__(self, app: web.Application, unix_path: str | None = None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        if unix_path:
            self.runner = web.AppRunner(app)
            self._run(self.runner.setup())
            self._run(web.UnixSite(self.runner, unix_path).start())
            self.url = f"unix://{unix_path}"
        else:
            self.runner = TestServer(app, host="127.0.0.1")
            self._run(self.runner.start_server())
            self.url = f"http://127.0.0.1:{self.runner.port}"

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self._run(self.runner.cleanup() if isinstance(self.runner, web.AppRunner) else self.runner.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def store_config(path) -> StoreConfig:
    return StoreConfig(str(path), dram=DramConfig(capacity_bytes=1 << 20, page_bytes=1 << 20, prefault=False),
                       nvme=NvmeConfig(segment_bytes=4 << 20))


@pytest.fixture
def daemon(tmp_path):
    """A real BlockStore behind build_app; yields (url, server-side store)."""
    store = BlockStore(store_config(tmp_path / "daemon"))
    srv = ServerThread(build_app(store, ServerConfig(tokens=TOKENS, max_batch_blocks=MAX_BATCH)))
    yield srv.url, store
    srv.close()
    store.close()


@pytest.fixture
def connect(daemon):
    clients = []

    def factory(token=TOKEN_A, **kw):
        c = KVClient(daemon[0], token, **{**FAST, **kw})
        clients.append(c)
        return c
    yield factory
    for c in clients:
        c.close()


@pytest.fixture(params=["inproc", "http"])
def store(request, tmp_path):
    """The conformance subject: a BlockStore, or a KVClient of a daemon over one."""
    if request.param == "inproc":
        s = BlockStore(store_config(tmp_path / "inproc"))
        s.register_namespace(NS)
        yield s
        s.close()
    else:
        connect = request.getfixturevalue("connect")
        c = connect()
        assert c.register_namespace(NS) == NS.id
        yield c


# ---------------------------------------------------------------- conformance (both backends)
def test_put_get_roundtrip_and_dedupe(store):
    keys = make_keys(5)
    r = put_blocks(store, keys)
    assert (r.stored, r.already_present, r.durable) == (5, 0, True)
    r = put_blocks(store, keys + keys[:1])
    assert (r.stored, r.already_present) == (0, 6)
    for k in keys:
        assert store.get(k) == payload_for(k)
    miss = make_keys(1, start=999)[0]
    assert store.get(miss) is None
    assert store.contains(keys[0]) and not store.contains(miss)
    assert store.get_many([keys[1], miss, keys[2]]) == [payload_for(keys[1]), None, payload_for(keys[2])]


def test_single_put_with_layout_and_ttl(store):
    key = make_keys(1, start=50)[0]
    layout = (TensorSpec("k", "float16", (2, 512)), TensorSpec("v", "float16", (2, 512)))
    r = store.put(key, payload_for(key, 4096), NS.id, layout=layout, ttl_s=3600)
    assert (r.stored, r.already_present) == (1, 0)
    assert store.put(key, payload_for(key, 4096), NS.id).already_present == 1
    assert store.get(key) == payload_for(key, 4096)


def test_get_into_and_get_many_into(store):
    keys = make_keys(4)
    put_blocks(store, keys)
    out = bytearray(5000)
    assert store.get_into(keys[0], out) == 4096 and bytes(out[:4096]) == payload_for(keys[0])
    assert store.get_into(make_keys(1, start=999)[0], out) is None
    with pytest.raises(ValueError):
        store.get_into(keys[0], bytearray(100))
    miss = make_keys(1, start=777)[0]
    outs = [np.zeros(4096, np.uint8) for _ in range(5)]
    got = store.get_many_into(keys[:2] + [miss] + keys[2:], outs)
    assert got == [4096, 4096, None, 4096, 4096]
    for k, o in zip(keys[:2] + [None] + keys[2:], outs):
        assert o.tobytes() == (payload_for(k) if k else bytes(4096))
    with pytest.raises(ValueError):
        store.get_many_into(keys, outs[:2])


def test_lookup_prefix_and_tiers(store):
    keys = make_keys(10)
    put_blocks(store, keys[:4] + keys[5:])
    r = store.lookup(keys)
    assert r.num_hits == 4 and len(r.tiers) == 4
    assert store.lookup(keys[5:]).num_hits == 5 and store.lookup([]).num_hits == 0
    many = make_keys(400, start=10_000)   # 1.6 MiB through a 1 MiB DRAM tier: the oldest are on NVMe only
    put_blocks(store, many)
    r = store.lookup(many)
    assert r.num_hits == 400 and r.tiers[0] == Tier.NVME and r.tiers[-1] == Tier.DRAM
    assert set(r.tiers) == {Tier.NVME, Tier.DRAM}


def test_pin_unpin_delete(store):
    keys, miss = make_keys(3), make_keys(1, start=999)[0]
    put_blocks(store, keys)
    assert store.pin(keys[:2]) == 2
    assert store.pin(keys[:2] + [miss], ttl_s=60) == 2
    assert store.unpin(keys[:2]) == 2     # drops the hard pins
    assert store.unpin(keys[:2]) == 2     # then the soft pins
    assert store.unpin(keys[:2]) == 0     # nothing left to drop
    assert store.delete(keys[:2] + [miss]) == 2
    assert store.get(keys[0]) is None and store.get(keys[2]) == payload_for(keys[2])
    assert store.lookup(keys).num_hits == 0


def test_stats(store):
    put_blocks(store, make_keys(7))
    st = store.stats()
    assert st.index_blocks == 7 and st.namespaces >= 1 and st.counters["puts"] == 7
    assert {t.tier for t in st.tiers} == {"dram", "nvme"} and st.to_dict()["index_blocks"] == 7


def test_errors(store):
    key = make_keys(1)[0]
    other = Namespace("other-model", "raw/v1", 16)
    with pytest.raises(UnknownNamespaceError):
        store.put(key, b"x" * 64, other.id)
    with pytest.raises(UnknownNamespaceError):
        store.put_many([PutItem(key, b"x" * 64, other.id)])
    with pytest.raises(BlockFormatError):
        store.put(key, b"x" * 64, NS.id, layout=(TensorSpec("k", "float16", (64,)),))
    with pytest.raises(BlockFormatError):
        store.put_many([PutItem(key, b"x" * 64, NS.id, ttl_s=0)])
    with pytest.raises(BlockFormatError):
        store.put(key[:8], b"x" * 64, NS.id)     # wrong key size for xxh3-128
    assert store.register_namespace(other) == other.id
    assert store.put(key, b"x" * 64, other.id).stored == 1


def test_large_batch_is_split(store):
    keys = make_keys(300, start=20_000)
    items = [PutItem(k, payload_for(k, 64 << 10), NS.id) for k in keys]
    r = store.put_many(items)
    assert (r.stored, r.already_present) == (300, 0)
    got = store.get_many(keys)
    assert all(g == it.payload for g, it in zip(got, items))
    outs = [bytearray(64 << 10) for _ in keys]
    assert store.get_many_into(keys, outs) == [64 << 10] * 300
    assert all(bytes(o) == it.payload for o, it in zip(outs, items))
    assert store.lookup(keys).num_hits == 300 and store.put_many(items).already_present == 300


# ---------------------------------------------------------------- daemon only
def test_split_puts_respects_blocks_and_bytes():
    items = [PutItem(b"k" * 16, b"x" * 1000, b"n" * 16)] * 10
    assert [len(c) for c in _split_puts(items, 4, 1 << 20)] == [4, 4, 2]
    assert [len(c) for c in _split_puts(items, 100, 2500)] == [2, 2, 2, 2, 2]
    assert [len(c) for c in _split_puts(items, 100, 10)] == [1] * 10   # an oversized block goes alone
    assert _split_puts([], 4, 10) == []


def test_daemon_enforces_the_batch_limit_the_client_splits_for(connect):
    c = connect(max_batch_blocks=4096)
    c.register_namespace(NS)
    with pytest.raises(BlockFormatError, match="exceeds the limit"):
        put_blocks(c, make_keys(MAX_BATCH + 1), n=64)


def test_one_client_shared_by_threads(connect):
    c = connect()
    c.register_namespace(NS)
    errors = []

    def work(i):
        try:
            keys = make_keys(20, start=1000 * i)
            assert put_blocks(c, keys).stored == 20
            assert c.get_many(keys) == [payload_for(k) for k in keys] and c.lookup(keys).num_hits == 20
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and c.stats().index_blocks == 160


def test_auth_errors(connect):
    for c in (connect(token="not-a-valid-token-at-all"), connect(token="")):
        with pytest.raises(AuthError) as e:
            c.lookup(make_keys(1))
        assert e.value.status == 401
    assert connect(token="").healthz() == {"status": "ok"}
    c = connect(token=TOKEN_C)   # a valid token without the admin flag
    c.register_namespace(NS)
    put_blocks(c, make_keys(1))
    with pytest.raises(AuthError) as e:
        c.delete(make_keys(1))
    assert e.value.status == 403
    with pytest.raises(AuthError):
        c.gc()
    assert connect().gc(max_steps=2)["expired"] == 0


def test_quota_exceeded(connect):
    c = connect(token=TOKEN_Q)
    c.register_namespace(NS)
    keys = make_keys(3)
    assert put_blocks(c, keys[:2]).stored == 2      # 8 KiB of a 10 KiB quota
    with pytest.raises(QuotaExceededError) as e:
        put_blocks(c, keys[2:])
    assert isinstance(e.value, TierFullError) and (e.value.status, e.value.code) == (507, "quota_exceeded")


def test_token_from_environment(daemon, monkeypatch):
    monkeypatch.setenv("KVCACHE_TOKEN", TOKEN_A)
    with open_store(daemon[0], **FAST) as c:
        assert c.register_namespace(NS) == NS.id and c.lookup(make_keys(2)).num_hits == 0


def test_tenant_isolation(connect, daemon):
    a, b = connect(TOKEN_A), connect(TOKEN_B)
    a.register_namespace(NS)
    keys = make_keys(3)
    assert put_blocks(a, keys).stored == 3
    assert b.get(keys[0]) is None and b.get_many(keys) == [None] * 3
    assert b.lookup(keys).num_hits == 0
    assert b.exists(keys) == [False] * 3 and not b.contains(keys[0])
    assert b.get_many_into(keys[:1], [bytearray(4096)]) == [None]
    assert b.pin(keys) == 0 and b.unpin(keys) == 0
    assert b.delete(keys) == 0
    b.register_namespace(NS)                         # namespaces are per tenant, like keys
    r = b.put(keys[0], b"tenant b's own bytes", NS.id)
    assert (r.stored, r.already_present) == (1, 0)
    assert b.get(keys[0]) == b"tenant b's own bytes" and a.get(keys[0]) == payload_for(keys[0])
    assert put_blocks(b, keys).stored == 2          # keys[1:] are new for tenant b
    assert a.lookup(keys).num_hits == 3 and a.exists(keys) == [True] * 3
    with pytest.raises(ValueError, match="tenant"):
        a.put(keys[0], b"x", NS.id, tenant="b")
    assert daemon[1].stats().index_blocks == 6
    assert b.delete(keys[:1], tenant="a") == 1      # an admin naming the tenant: a's block, not b's own
    assert a.get(keys[0]) is None and b.get(keys[0]) == b"tenant b's own bytes"


def test_unix_socket(tmp_path):
    store = BlockStore(store_config(tmp_path / "d"))
    srv = ServerThread(build_app(store, ServerConfig()), unix_path=str(tmp_path / "kv.sock"))
    try:
        with open_store(srv.url, **FAST) as c:
            c.register_namespace(NS)
            keys = make_keys(3)
            assert put_blocks(c, keys).stored == 3 and c.get_many(keys) == [payload_for(k) for k in keys]
    finally:
        srv.close()
        store.close()


@pytest.mark.asyncio
async def test_async_client(daemon):
    async with AsyncKVClient(daemon[0], TOKEN_A, **FAST) as c:
        await c.register_namespace(NS)
        keys = make_keys(3)
        r = await c.put_many([PutItem(k, payload_for(k), NS.id) for k in keys])
        assert r.stored == 3
        got = await asyncio.gather(*(c.get(k) for k in keys))
        assert got == [payload_for(k) for k in keys]


def test_open_store_local_forms(tmp_path):
    small = dict(dram=DramConfig(capacity_bytes=1 << 20, page_bytes=1 << 20, prefault=False))
    for spec in (str(tmp_path / "a"), f"file://{tmp_path / 'b'}"):
        with open_store(spec, **small) as s:
            assert isinstance(s, BlockStore)
            s.register_namespace(NS)
            put_blocks(s, make_keys(1))
    toml = tmp_path / "store.toml"
    toml.write_text(f'[store]\ndata_dir = "{tmp_path / "c"}"\n[dram]\ncapacity_mib = 1\npage_mib = 1\n'
                    'prefault = false\n')
    with open_store(str(toml)) as s:
        assert isinstance(s, BlockStore) and s.config.data_dir == str(tmp_path / "c")
    with pytest.raises(ValueError):
        open_store("ftp://nowhere")
