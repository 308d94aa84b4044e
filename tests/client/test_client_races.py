"""The clients under concurrency and partial failure: a busy daemon refusing leases, one
thread dropping the shared-memory attachment while another copies out of it, close() while
other threads are mid-call, and a batch_get retried after a half-read answer."""

import asyncio
import socket
import threading
import time

import pytest

from kvcache.server.app import build_app
from kvcache.server.config import ServerConfig
from kvcache.client import shm_client, sync_client
from kvcache.kvstore import wire
from kvcache.client.async_client import AsyncKVClient, DaemonError
from kvcache.client.sync_client import KVClient
from kvcache.kvstore.shm_wire import HELLO, LEASE, encode_keys, frame, split_head
from kvcache.kvstore.types import Tier
from tests.conftest import NS, make_keys, payload_for
from tests.client.test_client import ServerThread
from tests.client.test_shm import ADMIN, TOKENS, _item, shm_store


@pytest.fixture
def daemon(tmp_path):
    """A daemon with shared memory whose lease table holds at most one outstanding lease."""
    store = shm_store(tmp_path / "d")
    srv = ServerThread(build_app(store, ServerConfig(tokens=TOKENS, max_shm_leases=1)))
    yield srv.url, store
    srv.close()
    store.close()


def hold_the_only_lease(url: str, key: bytes) -> socket.socket:
    """A raw control connection that takes a lease and never releases it."""
    import json
    import urllib.request
    req = urllib.request.Request(url + "/v1/shm", headers={"Authorization": f"Bearer {ADMIN}"})
    path = json.loads(urllib.request.urlopen(req).read())["control_socket"]
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    for op, body in ((HELLO, ADMIN.encode()), (LEASE, encode_keys([key]))):
        s.sendall(frame(op, body))
        n, status = split_head(s.recv(6, socket.MSG_WAITALL))
        s.recv(n, socket.MSG_WAITALL)
        assert status == 0
    return s


def test_a_busy_daemon_refusing_leases_costs_a_socket_read_not_the_attachment(daemon, monkeypatch):
    monkeypatch.setattr(shm_client, "DIRECT_READS", False)     # every read leases
    url, store = daemon
    keys = make_keys(5)
    with KVClient(url, ADMIN, shared_memory="on") as c:
        c.register_namespace(NS)
        c.put_many([_item(k) for k in keys])
        assert c.get_many(keys) == [payload_for(k) for k in keys]
        att = c._shared()
        holder = hold_the_only_lease(url, keys[0])              # the table is now full: LEASE gets 503
        try:
            assert c.get_many(keys) == [payload_for(k) for k in keys]
            assert c._att is att                                # the same attachment, not a reconnect
        finally:
            holder.close()

    async def run():                                            # the async client likewise
        async with AsyncKVClient(url, ADMIN, shared_memory="on") as a:
            await a.get_many(keys)
            arena, holder = a._arena, hold_the_only_lease(url, keys[0])
            try:
                assert await a.get_many(keys) == [payload_for(k) for k in keys]
                assert a._arena is arena
            finally:
                holder.close()
    asyncio.run(run())


def test_another_thread_dropping_the_attachment_mid_copy_degrades_to_http(daemon, monkeypatch):
    """A thread whose read fails drops the attachment while this thread is copying out of it:
    this read must still answer right (the mapping stays valid; the control socket fails over)."""
    url, store = daemon
    keys = make_keys(8)
    real = sync_client.read_shared_blocking
    with KVClient(url, ADMIN, shared_memory="on") as c:
        c.register_namespace(NS)
        c.put_many([_item(k) for k in keys])
        errors = []

        def drop():
            try:
                c._drop_shm()
            except Exception as e:                              # noqa: BLE001 (the assertion below says)
                errors.append(e)
        dropper = threading.Thread(target=drop)

        def racing(ctl, arena, directory, keys, max_keys, take, lease_s, into=None):
            def take_while_dropped(i, view):
                if i == 0 and dropper.ident is None:
                    dropper.start()
                    time.sleep(0.2)                             # the other thread runs its drop now
                return take(i, view)
            return real(ctl, arena, None, keys, max_keys, take_while_dropped, lease_s, into)
        monkeypatch.setattr(sync_client, "read_shared_blocking", racing)
        assert c.get_many(keys) == [payload_for(k) for k in keys]
        dropper.join(10)
        assert not dropper.is_alive() and errors == []
        att = c._shared()                                        # a fresh attachment ...
        stale = sync_client._Attachment(att.ctl, att.arena, None, 1.0)
        c._drop_shm(stale)                                       # ... a failed read on an old one leaves alone
        assert c._att is att
        monkeypatch.setattr(sync_client, "read_shared_blocking", real)
        assert c.get_many(keys) == [payload_for(k) for k in keys]


def test_close_while_another_thread_waits_ends_its_call(daemon):
    url, _ = daemon
    c = KVClient(url, ADMIN)
    started, outcome = threading.Event(), []

    async def stuck(*args, **kwargs):
        started.set()
        await asyncio.sleep(60)                                  # a daemon that never answers
    c._client._json = stuck

    def call():
        try:
            c.stats()
        except DaemonError as e:
            outcome.append(str(e))
    t = threading.Thread(target=call)
    t.start()
    assert started.wait(10)
    c.close()
    t.join(10)
    assert not t.is_alive() and outcome and "closed" in outcome[0]
    with pytest.raises(DaemonError, match="closed"):
        c.healthz()


class ScriptedBatchGet:
    """An HTTP server answering each request with the next scripted (body, declared length),
    then closing: a body shorter than its declared length is a connection dropped mid-answer."""

    def __init__(self, script):
        self.script, self.sock = list(script), socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while self.script:
            conn, _ = self.sock.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                body, declared = self.script.pop(0)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                             b"Connection: close\r\nContent-Length: %d\r\n\r\n" % declared + body)


def answer(keys, payloads) -> bytes:
    out = wire.stream_header(len(keys))
    for k, p in zip(keys, payloads):
        out += b"".join(bytes(x) for x in wire.encode_get_frame(k, p, Tier.DRAM))
    return out


def cut(body: bytes, missing: int) -> tuple[bytes, int]:
    return body[:-missing], len(body)


@pytest.mark.parametrize("flavour", ["blocking", "async"])
def test_a_retried_batch_get_keeps_nothing_from_its_failed_attempts(flavour):
    """Attempt 1 reads block 0 whole and dies in block 1; attempt 2 dies half-way through a
    different copy of block 0 (recomputed after an eviction); attempt 3 finds both gone: two
    misses, not a hit whose buffer is half one copy and half the other."""
    keys = make_keys(2)
    script = [cut(answer(keys, [b"a" * 64, b"c" * 64]), 32), cut(answer(keys, [b"b" * 64, b"c" * 64]), 96),
              (answer(keys, [None, None]), len(answer(keys, [None, None])))]
    srv = ScriptedBatchGet(script)
    bufs = [bytearray(64), bytearray(64)]
    if flavour == "blocking":
        with KVClient(srv.url, shared_memory="off", retries=3, backoff_s=0.001) as c:
            assert c.get_many_into(keys, bufs) == [None, None]
    else:
        async def run():
            async with AsyncKVClient(srv.url, shared_memory="off", retries=3, backoff_s=0.001) as c:
                return await c.get_many_into(keys, bufs)
        assert asyncio.run(run()) == [None, None]
    assert not srv.script                                        # all three attempts were made
