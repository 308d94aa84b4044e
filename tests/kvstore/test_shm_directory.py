"""The read directory (kvstore/shm_directory.py): the table, the DRAM tier that keeps it true, and
local clients reading through it without a round trip (over build_app in a thread and the real
`kvcache serve` process, with chunks reused under a reader's feet)."""

import contextlib
import os
import threading
import time

import pytest

from kvcache.client import shm_client
from kvcache.kvstore import shm_directory as sd
from kvcache.client.async_client import DaemonError
from kvcache.client.sync_client import KVClient
from kvcache.kvstore.hashing import tenant_key
from kvcache.kvstore.types import PutItem
from kvcache.tiering.base import BlockWrite
from kvcache.tiering.config import DramConfig
from kvcache.tiering.dram import DramTier
from tests.conftest import NS, ListSink, make_keys, payload_for, put_blocks
from tests.client.test_shm import ADMIN, SHARER, no_socket_reads, served  # noqa: F401  (fixture)

KB = 1 << 10
FAR = time.time() + 3600


def table(buckets: int = 1, search: bool = False) -> tuple[sd.Directory, sd.DirectoryReader]:
    """A table and a reader of it; with `search`, the reader's misses go through the bytes' own
    find() first, as a client's do over the mapped table."""
    raw = bytearray(sd.HEADER_BYTES + buckets * sd.WAYS * sd.ENTRY_BYTES)
    buf = memoryview(raw)
    return sd.Directory(buf), sd.DirectoryReader(buf.toreadonly(), raw if search else None)


searching = pytest.mark.parametrize("search", [False, True], ids=["ways", "find-first"])


# ---------------------------------------------------------------- the table
@searching
def test_published_entries_are_found_until_removed_or_stale(search):
    w, r = table(buckets=4, search=search)
    w.publish(b"k" * 16, 4096, 100, FAR)
    pos, seq, off, n = r.find(b"k" * 16, time.time())
    assert (off, n) == (4096, 100) and seq % 2 == 0 and r.unchanged(pos, seq)
    assert r.find(b"k" * 15, time.time()) is None and r.find(b"j" * 16, time.time()) is None
    assert r.find(b"k" * 16, FAR + 1) is None                     # past valid_until
    w.publish(b"k" * 16, 8192, 200, FAR)                          # moved: same entry, new seq
    assert not r.unchanged(pos, seq) and r.find(b"k" * 16, time.time())[2:] == (8192, 200)
    _, seq2, _, _ = r.find(b"k" * 16, time.time())
    w.remove(b"k" * 16)
    assert r.find(b"k" * 16, time.time()) is None and not r.unchanged(pos, seq2) and len(w) == 0


@searching
def test_a_full_bucket_overwrites_a_way_and_forgets_its_key(search):
    w, r = table(buckets=1, search=search)
    keys = [bytes([i]) * 16 for i in range(sd.WAYS + 2)]
    for i, k in enumerate(keys):
        w.publish(k, i * 4096, 10, FAR)
    found = [k for k in keys if r.find(k, time.time()) is not None]
    assert len(found) == sd.WAYS == len(w) and keys[-1] in found
    for k in keys:                                                # removing an overwritten key is harmless
        w.remove(k)
    assert all(r.find(k, time.time()) is None for k in keys) and len(w) == 0


@searching
def test_a_half_written_entry_is_skipped(search):
    w, r = table(search=search)
    w.publish(b"a" * 16, 0, 10, FAR)
    pos = r.find(b"a" * 16, time.time())[0]
    seq = int.from_bytes(w.buf[pos: pos + 8], "little")
    w.buf[pos: pos + 8] = (seq + 1).to_bytes(8, "little")        # a writer stopped between its two bumps
    assert r.find(b"a" * 16, time.time()) is None


def _found(r, keys, now):
    """find_many's answer as find's: {i: (position, seq, offset, nbytes)}."""
    idx, rows, seqs, offs, sizes = r.find_many(keys, now)
    pos = (rows * sd.ENTRY_BYTES + sd.HEADER_BYTES).tolist()
    return {i: (p, int(q), o, n) for i, p, q, o, n in zip(idx, pos, seqs.tolist(), offs, sizes)}


@pytest.mark.parametrize("key_len", [16, 32, "mixed"])
def test_find_many_answers_as_find_does(key_len):
    """Random publishes, moves, removes and stale deadlines in a small table (full buckets,
    overwritten ways, entries that kept a removed key's bytes): for every batch, find_many finds
    what find finds, and unchanged_many agrees with unchanged."""
    import random
    rng = random.Random(7)
    w, r = table(buckets=8, search=True)
    lens = [16, 24, 32, 8] if key_len == "mixed" else [key_len]
    pool = [rng.randbytes(rng.choice(lens)) for _ in range(80)]
    now = time.time()
    for step in range(400):
        k = rng.choice(pool)
        if rng.random() < 0.7:
            w.publish(k, rng.randrange(1 << 40), rng.randrange(1, 1 << 20), now + rng.choice([-1, 60]))
        else:
            w.remove(k)
        if step % 20 == 0:
            batch = rng.sample(pool, rng.randint(1, 40))
            want = {i: h for i, h in enumerate(r.find(k, now) for k in batch) if h is not None}
            assert _found(r, batch, now) == want
            idx, rows, seqs, _, _ = r.find_many(batch, now)
            assert r.unchanged_many(rows, seqs).all()
    batch = [k for k in pool if r.find(k, now) is not None][:20]
    if len(batch) >= sd.BATCH_FROM:
        idx, rows, seqs, _, _ = r.find_many(batch, now)
        w.publish(batch[idx[0]], 0, 1, now + 60)                 # moved: its entry's seq moves on
        assert r.unchanged_many(rows, seqs).tolist() == [j != 0 for j in range(len(idx))]


def test_find_many_skips_a_half_written_entry():
    w, r = table(buckets=1, search=True)
    keys = [bytes([i]) * 16 for i in range(sd.BATCH_FROM)]
    for i, k in enumerate(keys[: sd.WAYS]):
        w.publish(k, i * 4096, 10, FAR)
    pos = r.find(keys[0], time.time())[0]
    seq = int.from_bytes(w.buf[pos: pos + 8], "little")
    w.buf[pos: pos + 8] = (seq + 1).to_bytes(8, "little")        # a writer stopped between its two bumps
    assert sorted(_found(r, keys, time.time())) == list(range(1, sd.WAYS))


def test_reader_refuses_a_table_it_does_not_know():
    w, _ = table()
    bad = bytearray(w.buf)
    bad[:8] = b"KVCDIR99"
    with pytest.raises(sd.DirectoryError, match="layout"):
        sd.DirectoryReader(bad)
    with pytest.raises(sd.DirectoryError, match="shorter"):
        sd.DirectoryReader(b"x")
    assert sd.table_bytes(1 << 30) == sd.HEADER_BYTES + 8192 * sd.WAYS * sd.ENTRY_BYTES
    assert sd.table_bytes(1 << 50) == sd.HEADER_BYTES + sd.MAX_BUCKETS * sd.WAYS * sd.ENTRY_BYTES


# ---------------------------------------------------------------- the DRAM tier keeps it true
def tier(**kw) -> DramTier:
    return DramTier(DramConfig(capacity_bytes=1 << 20, page_bytes=256 * KB, prefault=False, shared_memory=True,
                               **kw))


def put(t: DramTier, key: bytes, fill: int) -> None:
    t.put([BlockWrite(key, NS.id, bytes([fill]) * (256 * KB), None, 0.0)])


def test_dram_unpublishes_before_a_chunk_can_be_reused():
    t = tier()
    r = sd.DirectoryReader(t.directory_arena.view)
    for i, k in enumerate([b"a", b"b", b"c"]):
        put(t, k, i)
    assert t.publish([b"a", b"b", b"c", b"zz"], [FAR] * 4) == 3
    t.delete(b"a")
    assert r.find(b"a", time.time()) is None
    t.set_pin(b"b", 1, 0.0)
    assert r.find(b"b", time.time()) is not None                  # pinning keeps the entry
    t.set_pin(b"b", 0, 0.0)
    assert r.find(b"b", time.time()) is None                      # unpinning may shorten its life
    for i in range(8):                                            # churn evicts c
        put(t, bytes([100 + i]), i)
    assert not t.contains(b"c") and r.find(b"c", time.time()) is None
    t.unpublish_all()
    assert len(t.directory) == 0
    t.close()


def test_a_block_deleted_while_held_is_never_published():
    t = tier()
    put(t, b"a", 1)
    held = t.acquire([b"a"])
    t.delete(b"a")                                                # doomed: freed when released
    assert t.publish([b"a"], [FAR]) == 0 and len(t.directory) == 0
    t.release(held)
    t.close()


def test_touch_refreshes_recency_and_reports_sizes():
    t = tier(eviction="lru")
    put(t, b"a", 1)
    put(t, b"b", 2)
    assert t.touch([b"a", b"x"]) == [256 * KB, None]
    assert next(t._ordered().victims()) == b"b"                        # a was read: b goes first
    t.close()


def test_no_table_without_shared_memory_or_when_turned_off():
    assert DramTier(DramConfig(capacity_bytes=1 << 20, page_bytes=256 * KB, prefault=False)).directory is None
    t = tier(read_directory=False)
    assert t.directory is None and t.publish([b"a"], [FAR]) == 0
    t.close()


# ---------------------------------------------------------------- clients over a daemon
def counting_leases(store) -> list:
    calls, real = [], store.lease_shared

    def lease_shared(keys, max_files):
        calls.append(len(keys))
        return real(keys, max_files)
    store.lease_shared = lease_shared
    return calls


def wait_for(cond, what: str) -> None:
    for _ in range(200):
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(what)


@contextlib.contextmanager
def client_with_blocks(served, token: str, n: int):  # noqa: F811
    """A daemon whose leases are counted, a shared-memory client, and n blocks it put."""
    url, store = served()
    leases = counting_leases(store)
    with KVClient(url, token, shared_memory="on") as c:
        c.register_namespace(NS)
        keys = make_keys(n)
        put_blocks(c, keys)
        yield c, store, leases, keys, url


def test_reads_after_a_put_need_no_lease_and_are_accounted(served):  # noqa: F811
    with client_with_blocks(served, SHARER, 6) as (c, store, leases, keys, url):
        no_socket_reads(c)
        hits = store.stats_counters["hits_dram"]
        outs = [bytearray(4096) for _ in keys]
        assert c.get_many_into(keys, outs) == [4096] * 6 and leases == []
        assert [bytes(o) for o in outs] == [payload_for(k) for k in keys]
        wait_for(lambda: store.stats_counters["hits_dram"] == hits + 6, "TOUCH did not count the reads")
        assert store.dram.keys()[-6:] == [tenant_key("s", k) for k in keys]   # and refreshed their recency
        miss = make_keys(1, start=500)[0]
        assert c.get_many([keys[0], miss]) == [payload_for(keys[0]), None] and leases == [1]   # the miss asks
        assert scrape(url, "kvcache_shm_directory_entries") == 6
        store.delete([tenant_key("s", keys[1])])                 # (deletes need an admin token)
        assert c.get(keys[1]) is None                             # not served stale from the table
        assert scrape(url, "kvcache_shm_directory_entries") == 5
        assert scrape(url, 'kvcache_requests_total{endpoint="shm:touch",status="200"}') >= 1


def scrape(url: str, series: str) -> float:
    import urllib.request
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    for line in urllib.request.urlopen(req).read().decode().splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} is not in /metrics")


def test_other_tenants_keys_are_not_found_in_the_table(served):  # noqa: F811
    url, store = served()
    with KVClient(url, ADMIN) as a, KVClient(url, SHARER, shared_memory="on") as s:
        a.register_namespace(NS)
        keys = make_keys(3)
        put_blocks(a, keys)                                       # published under tenant "ops"
        leases = counting_leases(store)
        assert s.get_many(keys) == [None] * 3 and leases == [3]


def test_without_direct_reads_clients_lease_every_time(served, monkeypatch):  # noqa: F811
    monkeypatch.setattr(shm_client, "DIRECT_READS", False)       # e.g. an Arm host
    with client_with_blocks(served, ADMIN, 4) as (c, store, leases, keys, url):
        for _ in range(2):
            assert c.get_many(keys) == [payload_for(k) for k in keys]
        assert c._client.directory is None and leases == [4, 4]


def test_real_daemon_readers_never_see_a_reused_chunk(tmp_path):
    """A writer churns a small DRAM tier (evictions free and reuse chunks) while a reader in
    another thread reads published blocks through the table: every byte read must be right."""
    from tests.server.test_serve_process import Daemon
    cfg = tmp_path / "serve.toml"
    cfg.write_text("[dram]\ncapacity_bytes = 4194304\npage_bytes = 1048576\nprefault = false\n"
                   'eviction = "fifo"\n')   # reads do not save the hot blocks: they are evicted too
    sock = tmp_path / "kv.sock"
    d = Daemon(tmp_path / "data", "--unix-socket", str(sock), "--config", str(cfg))
    errors, stop = [], threading.Event()
    try:
        d.wait_ready()
        wait_for(sock.exists, "no unix socket")
        hot, size = make_keys(32), 64 * KB      # half of DRAM
        with KVClient("http://x", unix_socket=str(sock), shared_memory="on") as c:
            c.register_namespace(NS)
            c.put_many([PutItem(k, payload_for(k, size), NS.id) for k in hot])

            def churn():
                with KVClient("http://x", unix_socket=str(sock)) as w:
                    i = 1000
                    while not stop.is_set():
                        batch = make_keys(16, start=i)
                        w.put_many([PutItem(k, payload_for(k, size), NS.id) for k in batch])
                        w.delete(batch[:8])
                        i += 16
            writer = threading.Thread(target=churn)
            writer.start()
            direct, outs = 0, [bytearray(size) for _ in hot]
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                got = c.get_many_into(hot, outs)
                for k, n, o in zip(hot, got, outs):
                    if n is not None and bytes(o[:n]) != payload_for(k, size):
                        errors.append(k)
                direct += c._client.directory is not None
            stop.set()
            writer.join()
        assert direct and not errors
    finally:
        stop.set()
        d.stop()
    assert os.path.exists(tmp_path / "data")


def test_async_client_reads_through_the_table_too(served):  # noqa: F811
    import asyncio
    from kvcache.client.async_client import AsyncKVClient
    url, store = served()
    leases = counting_leases(store)

    async def run():
        async with AsyncKVClient(url, ADMIN, shared_memory="on") as c:
            await c.register_namespace(NS)
            keys = make_keys(5)
            await c.put_many([PutItem(k, payload_for(k), NS.id) for k in keys])
            assert await c.get_many(keys) == [payload_for(k) for k in keys]
            assert c.directory is not None and leases == []
    asyncio.run(run())


def test_a_malformed_touch_drops_the_connection_without_an_answer(served):  # noqa: F811
    import json
    import socket
    import urllib.request
    from kvcache.kvstore import shm_wire as w
    url, _ = served()
    req = urllib.request.Request(url + "/v1/shm", headers={"Authorization": f"Bearer {ADMIN}"})
    info = json.loads(urllib.request.urlopen(req).read())
    assert info["directory"]["size"] == sd.table_bytes(2 << 20)
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(info["control_socket"])
        s.sendall(w.frame(w.HELLO, ADMIN.encode()))
        n, status = w.split_head(s.recv(w.HEAD_BYTES, socket.MSG_WAITALL))
        assert status == 0 and s.recv(n, socket.MSG_WAITALL) == b"ops"
        s.sendall(w.frame(w.TOUCH, b"\x01\x00\x00\x00\x99"))     # one key, cut short
        assert s.recv(1) == b""                                   # closed: an answer would be out of step


def test_a_dead_daemons_table_is_never_read(tmp_path, monkeypatch):
    """SIGKILL the daemon: its memfds live on in the client's mappings, but the client must not
    serve blocks out of them (a restarted daemon may have lost or deleted them)."""
    import signal
    monkeypatch.setattr(shm_client.BlockingShmControl, "touch", lambda *a: None)   # the check, not TOUCH's EPIPE
    from tests.server.test_serve_process import Daemon
    sock = tmp_path / "kv.sock"
    d = Daemon(tmp_path / "data", "--unix-socket", str(sock))
    try:
        d.wait_ready()
        wait_for(sock.exists, "no unix socket")
        keys = make_keys(4)
        with KVClient("http://x", unix_socket=str(sock), shared_memory="on", retries=0) as c:
            c.register_namespace(NS)
            put_blocks(c, keys)
            assert c.get_many(keys) == [payload_for(k) for k in keys] and c._client.directory is not None
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait()
            with pytest.raises(DaemonError):                # not the dead daemon's bytes
                c.get_many(keys)
    finally:
        if d.proc.poll() is None:
            d.stop()


def test_leases_and_touches_record_labelled_get_events(tmp_path):
    from kvcache.kvstore.config import StoreConfig
    from kvcache.kvstore.store import BlockStore
    from kvcache.tiering.config import NvmeConfig

    sink = ListSink()
    cfg = StoreConfig(str(tmp_path), dram=DramConfig(capacity_bytes=2 << 20, page_bytes=1 << 20, prefault=False,
                                                     shared_memory=True), nvme=NvmeConfig(segment_bytes=4 << 20))
    with BlockStore(cfg, events=sink) as store:
        store.register_namespace(NS)
        keys = make_keys(3)
        put_blocks(store, keys)
        slots, lease = store.lease_dram(keys + make_keys(1, start=900))
        store.release_dram(lease)
        assert store.touch_dram(keys[:2]) == (2, 2 * 4096)
        leased, touched = [e for e in sink.events if e.kind == "get"]
        assert (leased.blocks, leased.hit_blocks, leased.hits_dram, leased.namespace) == (4, 3, 3, NS.id.hex())
        assert (touched.blocks, touched.hits_dram, touched.nbytes, touched.namespace) == (2, 2, 8192, NS.id.hex())
        assert touched.tokens == 2 * NS.block_size
