"""The shared-memory control socket of `kvcache serve`: one thread per connection, blocking I/O.

    accept thread ── conn ──> session thread:  HELLO token ─> tenant, permission,
                                                            the arena's fds (SCM_RIGHTS)
                                               LEASE keys  ─> BlockStore.lease_dram ─> slots
                                               RELEASE / FORGET lease_id
                                               TOUCH keys  ─> BlockStore.touch_dram (no answer)
                              connection closed ─> its leases end at once (not at expiry)

Threads, not the aiohttp event loop: a lease is a few microseconds of dict work per key plus
one round trip, and a blocking recv in its own thread wakes faster than a loop shared with HTTP
traffic; blocks that must first come from NVMe or object storage are read right here, so one
slow client never stalls the loop. The socket is created with mode 0600.

What a connection without a token costs, bounded (any process of the daemon's user can connect):

    pending (no HELLO yet)   at most MAX_PENDING; a new one drops the oldest, so a flood of idle
                             connections cannot lock out a client that says HELLO at once
                             HELLO_S for the whole HELLO, a body of at most MAX_HELLO_BODY bytes
    accepted                 at most MAX_CONNECTIONS; may idle between frames for as long as it
                             likes, but a frame's body and our answer move within FRAME_S

The arena's file descriptors go only to an accepted HELLO: the daemon is not dumpable (server/daemon.py),
so a process without a token cannot take them from /proc/<pid>/fd either.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from kvcache.server.metrics import client_label
from kvcache.server.request_state import CONFIG, METRICS, STORE
from kvcache.server.shm_leases import DENIED, LEASES
from kvcache.kvstore import shm_wire as w
from kvcache.kvstore.hashing import tenant_key
from kvcache.kvstore.types import Tier

log = logging.getLogger(__name__)
MAX_CONNECTIONS = 256
MAX_PENDING = 32
HELLO_S = 5.0
FRAME_S = 10.0
MAX_HELLO_BODY = 4096       # a token; anything longer is not one
NO_ANSWER = (w.FORGET, w.TOUCH)


class ControlSession:
    """One control connection: HELLO first (the token decides tenant and permission), then leases."""

    def __init__(self, app):
        self.app, self.store, self.config = app, app[STORE], app[CONFIG]
        self.leases = app[LEASES]
        self.tenant: str | None = None
        self.client = ""              # the metrics label HELLO named (server/metrics.py: client_label)
        self.owned: set[int] = set()
        self.fds: list[int] = []      # sent with the next answer: HELLO's arena, a lease's segments
        self.owns_fds = False         # the segments' are ours to close once sent

    def shared_fds(self) -> list[int]:
        """Read-only descriptions of the arena and the read directory (tiering/arena.py)."""
        dram = self.store.dram
        return [a.read_fd for a in (dram.arena, dram.directory_arena) if a is not None and a.read_fd is not None]

    def hello(self, body: bytes) -> tuple[int, bytes]:
        token, _, name = body.decode("utf-8", "replace").partition("\n")     # token [LF client name]
        self.client = client_label(name)
        if not self.config.auth_required:
            self.tenant = ""
            return 0, b""              # the tenant's name: the client looks up its stored keys
        match = self.config.match_token(token)      # constant time, like the HTTP auth
        if match is None:
            return 401, b"missing or unknown token"
        if not (match.admin or match.shared_memory):    # a metrics token included: it has no tenant
            return 403, DENIED.encode()
        self.tenant = match.tenant
        return 0, match.tenant.encode()

    def lease(self, body: bytes, files: bool = False) -> tuple[int, bytes]:
        """LEASE, or LEASE_FILES: blocks only on NVMe may come as file slots, whose segments'
        descriptors go with the reply (self.fds, closed once sent: self.owns_fds)."""
        t0 = time.perf_counter()
        keys = [tenant_key(self.tenant, k) for k in w.decode_keys(body, self.config.max_batch_blocks)]
        slots, lease, fds = self.store.lease_shared(keys, w.MAX_LEASE_FDS if files else 0)
        lease_id = self.leases.add(lease, self.owned)
        if lease_id is None:
            w.close_fds(fds)
            return 503, (f"{self.leases.max_leases} shared-memory leases are outstanding; release leases "
                         "or raise server.max_shm_leases").encode()
        self.fds, self.owns_fds = fds, True
        m = self.app[METRICS]
        leased = [s for s in slots if isinstance(s, tuple) and not isinstance(s, w.FileSlot)]
        from_files = [s for s in slots if isinstance(s, w.FileSlot)]
        m.count_hits("get", Tier.DRAM, len(leased), sum(s[1] for s in leased), slots.count(None), self.client)
        if from_files:
            m.count_hits("get", Tier.NVME, len(from_files), sum(s.nbytes for s in from_files), 0, self.client)
        dt = time.perf_counter() - t0
        m.observe_request("shm:lease_files" if files else "shm:lease", 200, dt)
        m.observe_read(self.client, [Tier.NVME] if from_files else [Tier.DRAM] if leased else [], dt)
        return 0, w.encode_slots(lease_id, slots, files)

    def touch(self, body: bytes) -> None:
        t0 = time.perf_counter()
        keys = [tenant_key(self.tenant, k) for k in w.decode_keys(body, self.config.max_batch_blocks)]
        hits, nbytes = self.store.touch_dram(keys)
        m = self.app[METRICS]
        m.count_hits("get", Tier.DRAM, hits, nbytes, 0, self.client)
        m.observe_request("shm:touch", 200, time.perf_counter() - t0)

    def handle(self, op: int, body: bytes) -> tuple[int, bytes] | None:
        if op == w.HELLO:
            reply = self.hello(body)
            self.fds = self.shared_fds() if reply[0] == 0 else []
            return reply
        if self.tenant is None:
            return 401, b"send HELLO with a token first"
        if op in (w.LEASE, w.LEASE_FILES):
            return self.lease(body, files=op == w.LEASE_FILES)
        if op == w.TOUCH:
            return self.touch(body)
        if op in (w.RELEASE, w.FORGET):
            lease_id = w.decode_u64(body)
            valid = lease_id in self.owned and self.leases.pop(lease_id)
            self.owned.discard(lease_id)
            return None if op == w.FORGET else (0, bytes((int(valid),)))
        return 400, f"unknown control op {op}".encode()

    def close(self) -> None:
        self.leases.drop_owner(self.owned)   # a dead client's leases end now, not at expiry


class ControlServer:
    def __init__(self, app, path: str):
        self.app, self.path = app, path
        if os.path.exists(path):
            os.unlink(path)            # a stale socket from a killed daemon
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)          # 0600: only this user connects
        try:
            self._sock.bind(path)
        finally:
            os.umask(old)
        self._sock.listen(64)
        self._pending: dict[socket.socket, None] = {}   # insertion order: the oldest first
        self._conns: set[socket.socket] = set()         # accepted (said HELLO)
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kvcache-shm-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return                 # closed
            with self._lock:
                self._pending[conn] = None
                oldest = next(iter(self._pending)) if len(self._pending) > MAX_PENDING else None
                if oldest is not None:
                    del self._pending[oldest]
            if oldest is not None:     # its thread wakes, fails its recv and lets the slot go
                log.debug("dropping the oldest of %d shared-memory connections without HELLO", MAX_PENDING)
                _shutdown(oldest)
            threading.Thread(target=self._serve, args=(conn,), name="kvcache-shm-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        session = ControlSession(self.app)
        try:
            self._converse(conn, session)
        except (ConnectionError, OSError, w.ShmProtocolError):
            pass   # the client went away, timed out, or spoke garbage: drop the connection
        except Exception:
            log.exception("shared-memory control connection failed")
        finally:
            session.close()
            with self._lock:
                self._pending.pop(conn, None)
                self._conns.discard(conn)
            conn.close()

    def _converse(self, conn: socket.socket, session: ControlSession) -> None:
        hello_by = time.monotonic() + HELLO_S
        while True:
            accepted = session.tenant is not None
            conn.settimeout(None if accepted else max(1e-3, hello_by - time.monotonic()))
            n, op = w.split_head(w.recv_exact(conn, w.HEAD_BYTES))
            if not accepted and n > MAX_HELLO_BODY:
                raise w.ShmProtocolError(f"a {n}-byte frame before HELLO")
            if accepted:
                conn.settimeout(FRAME_S)   # the body and our answer: a stalled peer is dropped
            body = w.recv_exact(conn, n)
            try:
                reply = session.handle(op, body)
            except (w.ShmProtocolError, ValueError) as e:
                if op in NO_ANSWER:    # an answer would fall out of step: drop the connection
                    raise w.ShmProtocolError(str(e)) from e
                reply = (400, str(e).encode())
            full = session.tenant is not None and not accepted and not self._admit(conn)
            if full:
                reply, session.fds = (503, f"{MAX_CONNECTIONS} shared-memory connections are open; "
                                           "close some or read over HTTP".encode()), []
            try:
                if reply is not None:
                    w.send_with_fds(conn, w.frame(*reply), session.fds)
            finally:
                if session.owns_fds:       # a lease's segment descriptors: the client has its own now
                    w.close_fds(session.fds)
                session.fds, session.owns_fds = [], False
            if full:
                return

    def _admit(self, conn: socket.socket) -> bool:
        """Move a connection that said HELLO out of the pending set, if there is room."""
        with self._lock:
            self._pending.pop(conn, None)
            if len(self._conns) >= MAX_CONNECTIONS:
                log.warning("refusing a shared-memory control connection: %d open", MAX_CONNECTIONS)
                return False
            self._conns.add(conn)
            return True

    def close(self) -> None:
        self._closed = True
        _shutdown(self._sock)
        self._sock.close()
        with self._lock:
            conns = list(self._conns) + list(self._pending)
        for c in conns:                # wakes their threads, which release their leases
            _shutdown(c)
        self._thread.join(timeout=5)
        if os.path.exists(self.path):
            os.unlink(self.path)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
