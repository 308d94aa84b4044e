"""The shared-memory path against local adversaries: nobody but the daemon writes the arena,
its fds go only to an accepted HELLO, tenants stay in their own key space on the control
socket, and connections without a token cost a bounded number of threads for a bounded time
(that nobody opens the arena through the daemon's /proc entries: test_shm_undumpable.py)."""

import fcntl
import json
import logging
import mmap
import os
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache.server import shm_control
from kvcache.server.app import build_app
from kvcache.server.config import ServerConfig, TokenInfo
from kvcache.kvstore import shm_wire as w
from kvcache.client.async_client import DaemonError
from kvcache.client.sync_client import KVClient
from kvcache.kvstore.hashing import tenant_key
from kvcache.tiering import arena as arena_mod
from kvcache.tiering.arena import Arena
from tests.conftest import NS, make_keys, payload_for, put_blocks
from tests.client.test_client import ServerThread
from tests.client.test_shm import shm_store, wait_released

ALICE, BOB, PLAIN = "alice-shm-token-0123456789", "bob-shm-token-0123456789", "plain-token-0123456789"
TOKENS = (TokenInfo(ALICE, "alice", shared_memory=True), TokenInfo(BOB, "bob", shared_memory=True),
          TokenInfo(PLAIN, "carol"))


@pytest.fixture
def daemon(tmp_path):
    """A daemon in a thread: (url, store, control socket path)."""
    store = shm_store(tmp_path / "d")
    srv = ServerThread(build_app(store, ServerConfig(tokens=TOKENS)))
    try:
        yield srv.url, store, shm_json(srv.url, ALICE)["control_socket"]
    finally:
        srv.close()
        store.close()


def shm_json(url: str, token: str | None) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/shm", headers=headers)) as r:
        return json.loads(r.read())


def http_status(url: str, token: str | None) -> int:
    try:
        shm_json(url, token)
        return 200
    except urllib.error.HTTPError as e:
        return e.code


def raw_hello(path: str, token: bytes) -> tuple[int, bytes, list[int]]:
    """HELLO by hand, collecting whatever fds arrive with any byte of the answer."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(w.frame(w.HELLO, token))
        data, fds = b"", []
        while len(data) < w.HEAD_BYTES or len(data) < w.HEAD_BYTES + w.split_head(data[:w.HEAD_BYTES])[0]:
            got, more, _, _ = socket.recv_fds(s, 1 << 16, 8)
            if not got:
                break
            data, fds = data + got, fds + more
    n, status = w.split_head(data[:w.HEAD_BYTES])
    return status, data[w.HEAD_BYTES:], fds


def call(sock: socket.socket, op: int, body: bytes) -> tuple[int, bytes]:
    sock.sendall(w.frame(op, body))
    n, status = w.split_head(sock.recv(w.HEAD_BYTES, socket.MSG_WAITALL))
    return status, sock.recv(n, socket.MSG_WAITALL) if n else b""


def connected(path: str, token: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(path)
    assert call(s, w.HELLO, token.encode())[0] == 0
    return s


# ---------------------------------------------------------------- the seal
def test_the_shared_arena_is_sealed_against_every_writer_but_the_daemons_mapping():
    a = Arena(1 << 20, shared=True, prefault=False)
    try:
        seals = fcntl.fcntl(a.fd, fcntl.F_GET_SEALS)
        assert seals & arena_mod.SEALS == arena_mod.SEALS
        rw = os.open(f"/proc/self/fd/{a.fd}", os.O_RDWR)       # reopening read-write is allowed...
        try:
            with pytest.raises(PermissionError):                # ...but nothing written through it
                os.pwrite(rw, b"forged", 0)
            with pytest.raises(PermissionError):
                mmap.mmap(rw, 1 << 20, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.ftruncate(rw, 0)
            with pytest.raises(PermissionError):                # the seals cannot be lifted or changed
                fcntl.fcntl(rw, fcntl.F_ADD_SEALS, 0)
        finally:
            os.close(rw)
        assert fcntl.fcntl(a.read_fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        a.view[:6] = b"daemon"                                  # the daemon's own mapping still writes
        ro = mmap.mmap(a.read_fd, 1 << 20, mmap.MAP_SHARED, mmap.PROT_READ)
        assert ro[:6] == b"daemon"
        ro.close()
    finally:
        a.close()


def test_a_kernel_that_cannot_seal_refuses_shared_memory(monkeypatch):
    real = fcntl.fcntl

    def old_kernel(fd, cmd, arg=0):
        if cmd == fcntl.F_ADD_SEALS:
            raise OSError(22, "Invalid argument")     # what Linux < 5.1 answers F_SEAL_FUTURE_WRITE
        return real(fd, cmd, arg)
    monkeypatch.setattr(arena_mod.fcntl, "fcntl", old_kernel)
    with pytest.raises(arena_mod.StoreError, match="shared_memory = false"):
        Arena(1 << 20, shared=True, prefault=False)


def test_a_local_process_cannot_forge_a_block_that_get_serves(daemon):
    """The arena located from GET /v1/shm, reopened read-write and written where the block is:
    the write fails, and the owner's get still answers her bytes."""
    url, store, _ = daemon
    with KVClient(url, ALICE, shared_memory="off") as alice:
        alice.register_namespace(NS)
        key = make_keys(1)[0]
        put_blocks(alice, [key])
        info = shm_json(url, BOB)
        [(offset, nbytes)], lease = store.lease_dram([tenant_key("alice", key)])
        store.release_dram(lease)
        fd = os.open(f"/proc/{info['pid']}/fd/{info['fd']}", os.O_RDWR)   # this process is the daemon's
        try:
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"\x00" * nbytes, offset)
            with pytest.raises(PermissionError):
                mmap.mmap(fd, info["size"], mmap.MAP_SHARED, mmap.PROT_WRITE)
        finally:
            os.close(fd)
        assert alice.get(key) == payload_for(key)


# ---------------------------------------------------------------- who receives the fds
def test_fds_go_only_to_an_accepted_hello_and_are_read_only(daemon):
    url, store, path = daemon
    assert http_status(url, PLAIN) == 403 and http_status(url, None) == 401
    for token, status in ((b"", 401), (b"not-a-token-0123456789", 401), (PLAIN.encode(), 403)):
        got, body, fds = raw_hello(path, token)
        assert (got, fds) == (status, []), body
    status, tenant, fds = raw_hello(path, ALICE.encode())
    try:
        assert (status, tenant, len(fds)) == (0, b"alice", 2)   # the arena and the read directory
        info = shm_json(url, ALICE)
        assert [os.fstat(fd).st_ino for fd in fds] == [info["inode"], info["directory"]["inode"]]
        for fd in fds:
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            with pytest.raises(OSError):
                os.pwrite(fd, b"x", 0)
            mine = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)   # a client may reopen its own fd...
            try:
                with pytest.raises(PermissionError):             # ...and still cannot write
                    os.pwrite(mine, b"x", 0)
            finally:
                os.close(mine)
    finally:
        w.close_fds(fds)


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_client_that_receives_no_fds_reads_over_http(daemon, monkeypatch, mode):
    url, store, _ = daemon
    monkeypatch.setattr(shm_control.ControlSession, "shared_fds", lambda self: [])
    with KVClient(url, ALICE, shared_memory=mode) as c:
        c.register_namespace(NS)
        keys = make_keys(2)
        put_blocks(c, keys)
        if mode == "on":
            with pytest.raises(DaemonError, match="no arena fd"):
                c.get_many(keys)
        else:
            assert c.get_many(keys) == [payload_for(k) for k in keys] and c._client._arena is None


# ---------------------------------------------------------------- tenants on the control socket
def test_lease_and_touch_of_another_tenants_key_are_misses(daemon):
    url, store, path = daemon
    with KVClient(url, ALICE, shared_memory="off") as alice:
        alice.register_namespace(NS)
        keys = make_keys(3)
        put_blocks(alice, keys)
    with connected(path, BOB) as bob:
        status, body = call(bob, w.LEASE, w.encode_keys(keys))
        assert status == 0 and w.decode_slots(body)[1] == [None] * 3
        hits = store.stats_counters["hits_dram"]
        bob.sendall(w.touch_frames(keys, 100))
        assert call(bob, w.RELEASE, w.encode_u64(1 << 40)) == (0, b"\x00")   # in order: TOUCH was handled
        assert store.stats_counters["hits_dram"] == hits
    with connected(path, ALICE) as alice:                       # her own keys are there
        status, body = call(alice, w.LEASE, w.encode_keys(keys))
        lease_id, slots = w.decode_slots(body)
        assert all(isinstance(s, tuple) for s in slots)
        assert call(alice, w.RELEASE, w.encode_u64(lease_id)) == (0, b"\x01")


def test_a_connection_cannot_release_another_connections_lease(daemon):
    url, store, path = daemon
    with KVClient(url, ALICE, shared_memory="off") as alice:
        alice.register_namespace(NS)
        key = make_keys(1)[0]
        put_blocks(alice, [key])
    with connected(path, ALICE) as owner, connected(path, BOB) as bob, connected(path, ALICE) as twin:
        lease_id, slots = w.decode_slots(call(owner, w.LEASE, w.encode_keys([key]))[1])
        assert isinstance(slots[0], tuple)
        for other in (bob, twin):                     # another tenant, or the same tenant's other connection
            for guess in range(max(0, lease_id - 2), lease_id + 3):
                assert call(other, w.RELEASE, w.encode_u64(guess)) == (0, b"\x00")
                other.sendall(w.frame(w.FORGET, w.encode_u64(guess)))
        assert any(e.leases for e in store.dram._entries.values())   # still held for its owner
        assert call(owner, w.RELEASE, w.encode_u64(lease_id)) == (0, b"\x01")
    wait_released(store)


# ---------------------------------------------------------------- what a connection without a token costs
def test_connections_without_hello_are_bounded_and_cannot_lock_clients_out(daemon, monkeypatch):
    monkeypatch.setattr(shm_control, "HELLO_S", 60.0)      # only the pending bound frees slots here
    url, store, path = daemon
    threads = threading.active_count()
    idle = []
    try:
        for _ in range(shm_control.MAX_PENDING * 3):
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            idle.append(s)
        t0 = time.monotonic()
        with KVClient(url, ALICE, shared_memory="on") as c:      # HELLO at once: admitted despite the flood
            c.register_namespace(NS)
            keys = make_keys(2)
            put_blocks(c, keys)
            assert c.get_many(keys) == [payload_for(k) for k in keys] and c._client._arena is not None
        assert time.monotonic() - t0 < 10
        time.sleep(0.3)
        assert threading.active_count() - threads <= shm_control.MAX_PENDING + 4
        dropped = sum(1 for s in idle if _closed_by_peer(s, wait_s=0.01))
        assert dropped >= len(idle) - shm_control.MAX_PENDING - 1
    finally:
        for s in idle:
            s.close()


def test_a_silent_or_slow_hello_is_dropped_at_its_deadline(daemon, monkeypatch):
    monkeypatch.setattr(shm_control, "HELLO_S", 0.3)
    url, store, path = daemon
    silent, trickle = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    with silent, trickle:
        silent.connect(path)
        trickle.connect(path)
        t0 = time.monotonic()
        frame = w.frame(w.HELLO, ALICE.encode())
        for b in frame[:8]:                           # a byte at a time, never finishing within HELLO_S
            try:
                trickle.send(bytes((b,)))
            except OSError:
                break
            time.sleep(0.1)
        assert _closed_by_peer(silent, wait_s=3) and _closed_by_peer(trickle, wait_s=3)
        assert time.monotonic() - t0 < 3


def test_a_large_frame_before_hello_is_refused_unread(daemon):
    url, store, path = daemon
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(struct.pack("<IH", 1 << 20, w.HELLO))     # a 1 MiB "token": not read, not allocated
        assert _closed_by_peer(s, wait_s=3)


def test_an_accepted_connection_that_stalls_mid_frame_is_dropped(daemon, monkeypatch):
    monkeypatch.setattr(shm_control, "FRAME_S", 0.3)
    url, store, path = daemon
    with connected(path, ALICE) as s:
        time.sleep(0.5)                               # idle between frames: fine
        assert call(s, w.RELEASE, w.encode_u64(1)) == (0, b"\x00")
        s.sendall(w.frame(w.LEASE, w.encode_keys([b"k" * 16]))[:9])   # a head and part of its body
        assert _closed_by_peer(s, wait_s=3)


def _closed_by_peer(s: socket.socket, wait_s: float = 1.0) -> bool:
    s.settimeout(wait_s)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


# ---------------------------------------------------------------- any frames at all
_KEYS = st.lists(st.binary(min_size=1, max_size=64), max_size=6)
_BODIES = st.one_of(st.binary(max_size=96), _KEYS.map(w.encode_keys), st.integers(0, 2**64 - 1).map(w.encode_u64),
                    st.sampled_from([ALICE.encode(), BOB.encode(), PLAIN.encode(), b"\xff\xfe"]))
_FRAMES = st.lists(st.tuples(st.sampled_from([w.HELLO, w.LEASE, w.RELEASE, w.FORGET, w.TOUCH, 0, 6, 65535]), _BODIES),
                   max_size=8)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=_FRAMES, hello=st.sampled_from([None, ALICE, PLAIN]), cut=st.integers(0, 7))
def test_any_frames_leave_no_error_and_the_daemon_serving(daemon, caplog, frames, hello, cut):
    """Whatever a local process sends, with or without a token, and wherever it hangs up: no
    traceback at ERROR, no lease left behind, and the next client is served."""
    url, store, path = daemon
    caplog.clear()
    data = (w.frame(w.HELLO, hello.encode()) if hello else b"") + b"".join(w.frame(op, body) for op, body in frames)
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(data[: len(data) - cut] if cut < len(data) else data)
        s.shutdown(socket.SHUT_WR)
        while True:                        # the daemon closes once it has read everything
            try:
                got, fds, _, _ = socket.recv_fds(s, 1 << 16, 8)
            except ConnectionResetError:
                break
            w.close_fds(fds)
            if not got:
                break
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    wait_released(store)
    with connected(path, BOB) as bob:
        assert call(bob, w.LEASE, w.encode_keys([b"k" * 16]))[0] == 0
