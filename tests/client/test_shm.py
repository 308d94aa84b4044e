"""The same-host shared-memory read path: DRAM leases, the daemon's lease table, and the client
that maps the arena (over build_app in a thread, and the real `kvcache serve` process)."""

import asyncio
import time
import os

import pytest

from kvcache.server.app import build_app
from kvcache.server.config import ServerConfig, TokenInfo
from kvcache.server.shm_leases import LeaseTable
from kvcache.client.async_client import AsyncKVClient, DaemonError
from kvcache.client.sync_client import KVClient
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.leases import SOCKET
from kvcache.client.shm_client import ArenaUnavailable, LocalArena, read_leased
from kvcache.kvstore.store import BlockStore
from kvcache.tiering.config import DramConfig, NvmeConfig
from kvcache.tiering.dram import DramTier
from tests.conftest import NS, FakeClock, make_keys, payload_for, put_blocks
from tests.client.test_client import ServerThread

ADMIN, SHARER, PLAIN = "admin-token-0123456789", "sharer-token-0123456789", "plain-token-0123456789"
TOKENS = (TokenInfo(ADMIN, "ops", admin=True), TokenInfo(SHARER, "s", shared_memory=True), TokenInfo(PLAIN, "p"))
KB = 1 << 10


def shm_store(path, dram_bytes=2 << 20, **dram) -> BlockStore:
    return BlockStore(StoreConfig(str(path), dram=DramConfig(capacity_bytes=dram_bytes, page_bytes=1 << 20,
                                                             prefault=False, shared_memory=True, **dram),
                                  nvme=NvmeConfig(segment_bytes=4 << 20)))


@pytest.fixture
def served(tmp_path):
    made = []

    def start(lease_s=30.0, store=None, **store_kw):
        """A server over a new store (or over `store`, which it then closes too)."""
        store = store or shm_store(tmp_path / f"d{len(made)}", **store_kw)
        srv = ServerThread(build_app(store, ServerConfig(tokens=TOKENS, shm_lease_s=lease_s)))
        made.append((srv, store))
        return srv.url, store
    yield start
    for srv, store in made:
        srv.close()
        store.close()


def no_socket_reads(client: KVClient) -> None:
    """Fail any payload read over HTTP: the asyncio client's and the blocking reads' own."""
    async def refuse(*a, **kw):
        raise AssertionError("a payload was read over the socket")

    def refuse_blocking(*a, **kw):
        raise AssertionError("a payload was read over the socket")
    client._client._batch_get = refuse
    client._batch_get = refuse_blocking


# ---------------------------------------------------------------- the DRAM tier and the store
def test_acquired_blocks_survive_eviction_and_delete_until_released():
    t = DramTier(DramConfig(capacity_bytes=1 << 20, page_bytes=256 * KB, prefault=False, shared_memory=True))
    assert t.arena.shared and t.arena.info().size == 1 << 20
    t.put([_write(b"a", b"\x01" * (256 * KB))])
    [e] = t.acquire([b"a"])
    t.delete(b"a")
    for i in range(8):     # churn: the leased chunk must not be handed out again
        t.put([_write(bytes([i + 10]), bytes([i + 10]) * (256 * KB))])
    assert bytes(t.arena.view[e.offset: e.offset + 4]) == b"\x01" * 4
    t.release([e])
    assert t.acquire([b"a"]) == [None]
    t.close()


def _write(key, payload):
    from kvcache.tiering.base import BlockWrite
    return BlockWrite(key, NS.id, payload, None, 0.0)


def test_lease_dram_promotes_cold_blocks_and_reports_misses(tmp_path):
    store = shm_store(tmp_path / "s")
    store.register_namespace(NS)
    keys = make_keys(3)
    put_blocks(store, keys)
    store.close()
    store = shm_store(tmp_path / "s")      # reopened: DRAM is empty, the blocks are on NVMe only
    miss = make_keys(1, start=900)[0]
    slots, lease = store.lease_dram(keys + [miss])
    assert slots[3] is None and all(isinstance(s, tuple) for s in slots[:3])
    for k, (off, n) in zip(keys, slots[:3]):
        assert bytes(store.dram.arena.view[off: off + n]) == payload_for(k)
    assert store.stats_counters["hits_nvme"] == 3 and store.stats_counters["misses"] == 1
    store.release_dram(lease)
    slots, lease = store.lease_dram(keys)   # now warm
    assert store.stats_counters["hits_dram"] == 3
    store.release_dram(lease)
    store.close()


def test_lease_dram_says_socket_when_dram_cannot_take_the_block(tmp_path):
    store = shm_store(tmp_path / "s", dram_bytes=1 << 20, high_watermark=1.0, low_watermark=1.0)
    store.register_namespace(NS)
    big, small = make_keys(2)
    store.put(big, b"x" * (1 << 20), NS.id)
    store.pin([big])                        # DRAM is full of a pinned block
    assert store.dram.contains(big)
    store.dram.delete(small)
    store.put(small, payload_for(small), NS.id)   # fits nowhere in DRAM: NVMe only
    slots, lease = store.lease_dram([small])
    assert slots == [SOCKET]
    store.release_dram(lease)
    store.close()


def test_lease_table_expires_and_late_release_is_void():
    released, clock = [], FakeClock(0.0)
    table = LeaseTable(released.append, lease_s=5, max_leases=2, clock=clock)
    a, b = table.add("A"), table.add("B")
    assert table.add("C") is None and released == ["C"]          # full: given straight back
    assert table.pop(a) and released == ["C", "A"]
    clock.advance(seconds=6)
    assert table.sweep() == 1 and released[-1] == "B" and table.expired == 1
    assert not table.pop(b)                                       # too late: the copies are void
    assert released.count("B") == 1


# ---------------------------------------------------------------- the client over a daemon
def test_local_reads_go_through_shared_memory(served):
    url, store = served()
    with KVClient(url, ADMIN, shared_memory="on") as c:
        c.register_namespace(NS)
        keys = make_keys(20)
        put_blocks(c, keys)
        no_socket_reads(c)
        outs = [bytearray(4096) for _ in keys]
        miss = make_keys(1, start=700)[0]
        assert c.get_many_into(keys + [miss], outs + [bytearray(1)]) == [4096] * 20 + [None]
        assert all(bytes(o) == payload_for(k) for o, k in zip(outs, keys))
        assert c.get_many(keys[:2]) == [payload_for(k) for k in keys[:2]]
        assert c.get(keys[3]) == payload_for(keys[3]) and c.get(miss) is None
        with pytest.raises(ValueError, match="output buffer"):
            c.get_into(keys[0], bytearray(10))
    wait_released(store)


def build_leases(store):
    """Every lease was released: each DRAM entry is back to zero leases."""
    return [e for e in store.dram._entries.values() if e.leases]


def test_tenants_see_only_their_blocks_and_need_permission(served):
    url, store = served()
    with KVClient(url, SHARER, shared_memory="on") as s, KVClient(url, ADMIN) as a:
        a.register_namespace(NS)
        keys = make_keys(3)
        put_blocks(a, keys)
        assert s.get_many(keys) == [None] * 3          # another tenant's exact keys: misses
        s.register_namespace(NS)                       # namespaces are per tenant too
        put_blocks(s, keys)
        assert s.get_many(keys) == [payload_for(k) for k in keys]
    with KVClient(url, PLAIN, shared_memory="auto") as p:   # not allowed: falls back to the socket
        p.register_namespace(NS)
        put_blocks(p, keys)
        assert p.get_many(keys) == [payload_for(k) for k in keys] and p._client._arena is None
    with KVClient(url, PLAIN, shared_memory="on") as p, pytest.raises(DaemonError, match="shared_memory"):
        p.get(keys[0])


def test_an_expired_lease_voids_the_copy_and_the_client_rereads(served):
    url, store = served(lease_s=0.05)

    async def run():
        async with AsyncKVClient(url, ADMIN, shared_memory="on") as c:
            await c.register_namespace(NS)
            keys = make_keys(4)
            await c.put_many([_item(k) for k in keys])
            arena = await c._shared_arena()

            def slow_take(i, view):
                import time
                time.sleep(0.3)           # longer than the lease: the daemon voids it
                return bytes(view)
            got, rest = await read_leased(c._control, arena, keys, 100, slow_take, 0.05)
            assert got == {} and rest == [0, 1, 2, 3]
            assert await c.get_many(keys) == [payload_for(k) for k in keys]
    asyncio.run(run())
    wait_released(store)


def test_blocking_reads_pipeline_leases_and_stay_in_step(served, monkeypatch):
    """KVClient keeps one lease in flight ahead (PIPELINE_KEYS keys, then LATER_KEYS a lease):
    slow copies void their leases and are reread, a copy that fails leaves the channel usable,
    misses stay None."""
    from kvcache.client import shm_client
    monkeypatch.setattr(shm_client, "PIPELINE_KEYS", 3)
    monkeypatch.setattr(shm_client, "LATER_KEYS", 4)
    assert shm_client._lease_bases(10, 100) == [0, 3, 7] and shm_client._lease_bases(10, 2) == [0, 2, 4, 6, 8]
    assert shm_client._lease_bases(0, 100) == [] and shm_client._lease_bases(2, 100) == [0]
    url, store = served(lease_s=0.2)
    with KVClient(url, ADMIN, shared_memory="on") as c:
        c.register_namespace(NS)
        keys = make_keys(10)
        c.put_many([_item(k) for k in keys[:9]])
        assert c.get_many(keys) == [payload_for(k) for k in keys[:9]] + [None]
        att = c._shared()
        shm, arena = att.ctl, att.arena

        def slow_take(i, view):
            if i in (4, 7):
                time.sleep(0.15)          # past half the lease: its chunk waits for RELEASE's answer
            return bytes(view)
        got, rest = shm_client.read_leased_blocking(shm, arena, keys, 100, slow_take, 0.2)
        assert set(got) | set(rest) == set(range(9)) and not set(got) & set(rest)
        assert all(got[i] == payload_for(keys[i]) for i in got)

        def failing_take(i, view):
            if i == 4:
                raise ValueError("caller's buffer is too small")
            return bytes(view)
        with pytest.raises(ValueError):
            shm_client.read_leased_blocking(shm, arena, keys, 100, failing_take, 0.2)
        assert c.get_many(keys[:9]) == [payload_for(k) for k in keys[:9]]   # still in step
        assert c._att is att                                                   # and still shared memory
    wait_released(store)


def wait_released(store):
    """The daemon ends a closed connection's leases as soon as it sees the close."""
    import time
    for _ in range(100):
        if not build_leases(store):
            return
        time.sleep(0.02)
    assert build_leases(store) == []


def _item(k):
    from kvcache.kvstore.types import PutItem
    return PutItem(k, payload_for(k), NS.id)


def test_attach_refuses_a_mapping_that_is_not_the_arena(tmp_path):
    store = shm_store(tmp_path / "s")
    info = store.dram.arena.info()

    def received():                 # what HELLO would hand over: a read-only description
        return os.dup(store.dram.arena.read_fd)
    arena = LocalArena.attach(vars(info), received())
    assert arena.size == info.size
    with pytest.raises(ArenaUnavailable, match="not the daemon's memfd"):
        LocalArena.attach({**vars(info), "inode": info.inode + 1}, received())
    with pytest.raises(ArenaUnavailable, match="not the daemon's memfd"):
        LocalArena.attach({**vars(info), "size": info.size * 2}, received())
    with pytest.raises(OSError):
        LocalArena.attach(vars(info), 10_000)   # not an fd at all
    with pytest.raises(ArenaUnavailable, match="outside"):
        arena.slice(info.size - 10, 20)
    arena.close()
    store.close()


def test_daemon_without_shared_memory_falls_back(tmp_path):
    store = BlockStore(StoreConfig(str(tmp_path / "s"), dram=DramConfig(capacity_bytes=1 << 20, page_bytes=1 << 20,
                                                                        prefault=False)))
    srv = ServerThread(build_app(store, ServerConfig()))
    try:
        with KVClient(srv.url) as c:
            c.register_namespace(NS)
            keys = make_keys(2)
            put_blocks(c, keys)
            assert c.get_many(keys) == [payload_for(k) for k in keys] and c._client._arena is None
    finally:
        srv.close()
        store.close()


def test_real_daemon_serves_local_reads_from_shared_memory(tmp_path):
    from tests.server.test_serve_process import Daemon
    sock = tmp_path / "kv.sock"
    d = Daemon(tmp_path / "data", "--unix-socket", str(sock))
    try:
        d.wait_ready()
        for _ in range(100):       # the unix socket comes up just after the TCP port
            if sock.exists():
                break
            import time
            time.sleep(0.05)
        with KVClient("http://x", unix_socket=str(sock), shared_memory="on") as c:
            c.register_namespace(NS)
            keys = make_keys(8)
            put_blocks(c, keys, n=256 * KB)
            no_socket_reads(c)
            outs = [bytearray(256 * KB) for _ in keys]
            assert c.get_many_into(keys, outs) == [256 * KB] * 8
            assert [bytes(o) for o in outs] == [payload_for(k, 256 * KB) for k in keys]
            assert f"pid {d.proc.pid}," in c._client._arena.source
    finally:
        out = d.stop()
    assert "shared memory for local clients (with a read directory)" in out and "stopped cleanly" in out
    assert not os.path.exists(f"/proc/{d.proc.pid}")


def test_control_socket_rejects_bad_frames_and_unauthenticated_leases(served):
    import json
    import socket
    import urllib.request
    from kvcache.kvstore import shm_wire as w
    url, store = served()
    req = urllib.request.Request(url + "/v1/shm", headers={"Authorization": f"Bearer {ADMIN}"})
    path = json.loads(urllib.request.urlopen(req).read())["control_socket"]
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"

    def call(sock, op, body):
        sock.sendall(w.frame(op, body))
        n, status = w.split_head(sock.recv(w.HEAD_BYTES, socket.MSG_WAITALL))
        return status, sock.recv(n, socket.MSG_WAITALL) if n else b""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        assert call(s, w.LEASE, w.encode_keys([b"k" * 16]))[0] == 401          # no HELLO yet
        assert call(s, w.HELLO, PLAIN.encode())[0] == 403                      # not allowed to map
        assert call(s, w.HELLO, b"wrong-token-0123456789")[0] == 401
        assert call(s, w.HELLO, SHARER.encode()) == (0, b"s")                 # its tenant: directory keys
        status, msg = call(s, w.LEASE, b"\x05\x00\x00\x00\x10abc")            # 5 keys promised, 1 short one
        assert status == 400 and b"truncated" in msg
        assert call(s, 99, b"")[0] == 400
        status, body = call(s, w.LEASE, w.encode_keys([b"k" * 16]))           # still usable afterwards
        assert status == 0 and w.decode_slots(body)[1] == [None]
    with socket.socket(socket.AF_UNIX) as s:                                   # an absurd frame length: dropped
        s.connect(path)
        s.sendall(b"\xff\xff\xff\xff\x02\x00")
        assert s.recv(10) == b""
    with KVClient(url, ADMIN, shared_memory="on") as c:                        # the daemon is fine
        c.register_namespace(NS)
        put_blocks(c, make_keys(1))
        assert c.get(make_keys(1)[0]) == payload_for(make_keys(1)[0])
