"""The same-host shared-memory read path of `kvcache serve` (docs/api.md, "Shared memory").

    GET /v1/shm (HTTP, authenticated)  -> {pid, fd, size, inode, lease_s, control_socket}
    control socket (kvstore/shm_wire.py): HELLO token, then LEASE keys -> slots, RELEASE / FORGET lease

The control channel is a bare unix socket, not HTTP: a lease round trip must cost far less than
copying the blocks, and HTTP's per-request overhead is several times a 16 MiB memcpy budget.
A lease pins the chunks (BlockStore.lease_dram) until released, until its connection closes, or
until `server.shm_lease_s` passes; an expired lease is released by the daemon, its chunks may be
reused, and a late RELEASE answers valid=0, so the client throws its copy away and reads over
HTTP instead. Clients also know the lease length, so copies that end well inside it need no answer.

Who may use it: the arena holds every tenant's blocks, so a token needs `admin` or
`shared_memory = true` (or auth is off, which means loopback only and one trust domain).
"""

from __future__ import annotations

import asyncio
import heapq
import hmac
import itertools
import logging
import os
import secrets
import tempfile
import threading
import time
from typing import Callable

from aiohttp import web

from kvcache.cli import server as srv
from kvcache.kvstore import shm_wire as w
from kvcache.kvstore.hashing import tenant_key
from kvcache.kvstore.leases import SOCKET, DramLease
from kvcache.kvstore.types import Tier

log = logging.getLogger(__name__)


class LeaseTable:
    """Outstanding shared-memory leases, each void after `lease_s` seconds. Thread-safe."""

    def __init__(self, release: Callable[[DramLease], None], lease_s: float, max_leases: int,
                 clock: Callable[[], float] = time.monotonic):
        self._release, self.lease_s, self.max_leases, self._clock = release, lease_s, max_leases, clock
        self._leases: dict[int, DramLease] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.expired = 0

    def add(self, lease: DramLease, owner: set | None = None) -> int | None:
        """The lease's id, or None (and the lease given back) when the table is full. `owner`
        collects the ids of one connection, so that drop_owner can end them when it closes."""
        self.sweep()
        with self._lock:
            if len(self._leases) >= self.max_leases:
                full = True
            else:
                full, lease_id = False, next(self._ids)
                self._leases[lease_id] = lease
                if owner is not None:
                    owner.add(lease_id)
                heapq.heappush(self._deadlines, (self._clock() + self.lease_s, lease_id))
        if full:
            self._release(lease)
            return None
        return lease_id

    def pop(self, lease_id: int) -> bool:
        """Release a lease: True if it was still held (the copies made under it are good)."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._release(lease)
        self.sweep()
        return True

    def drop_owner(self, owner: set) -> None:
        for lease_id in list(owner):
            self.pop(lease_id)
        owner.clear()

    def sweep(self) -> int:
        now, gone = self._clock(), []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                _, lease_id = heapq.heappop(self._deadlines)
                lease = self._leases.pop(lease_id, None)
                if lease is not None:
                    gone.append(lease)
            self.expired += len(gone)
        for lease in gone:
            self._release(lease)
        return len(gone)

    def release_all(self) -> None:
        with self._lock:
            leases, self._leases, self._deadlines = list(self._leases.values()), {}, []
        for lease in leases:
            self._release(lease)

    def __len__(self) -> int:
        return len(self._leases)


LEASES = web.AppKey("shm_leases", LeaseTable)
CONTROL_PATH = web.AppKey("shm_control_path", str)
DENIED = ("the shared-memory path needs an admin token or one with shared_memory = true "
          "(the arena holds every tenant's blocks)")


def _arena_info(store):
    return store.dram.arena.info() if store.dram is not None else None


async def shm_info(request: web.Request) -> web.Response:
    if not request[srv.SHM]:
        raise web.HTTPForbidden(text=DENIED)
    info = _arena_info(request.app[srv.STORE])
    if info is None:
        raise web.HTTPNotFound(text="this daemon's DRAM tier is not in shared memory "
                                    "(set [dram] shared_memory = true); read over the socket")
    return web.json_response({"pid": info.pid, "fd": info.fd, "size": info.size, "inode": info.inode,
                              "lease_s": request.app[LEASES].lease_s, "control_socket": request.app[CONTROL_PATH]})


class ControlSession:
    """One control connection: HELLO first (the token decides tenant and permission), then leases."""

    def __init__(self, app: web.Application):
        self.app, self.store, self.config = app, app[srv.STORE], app[srv.CONFIG]
        self.tenant: str | None = None
        self.owned: set[int] = set()

    def hello(self, body: bytes) -> tuple[int, bytes]:
        token = body.decode("utf-8", "replace")
        if not self.config.auth_required:
            self.tenant = ""
            return 0, b""
        match = None
        for t in self.config.tokens:  # constant time, like the HTTP auth
            if hmac.compare_digest(t.token.encode(), token.encode()):
                match = t
        if match is None:
            return 401, b"missing or unknown token"
        if not (match.admin or match.shared_memory):
            return 403, DENIED.encode()
        self.tenant = match.tenant
        return 0, b""

    async def lease(self, body: bytes) -> tuple[int, bytes]:
        t0 = time.perf_counter()
        keys = [tenant_key(self.tenant, k) for k in w.decode_keys(body, self.config.max_batch_blocks)]
        dram = self.store.dram
        if all(dram.contains(k) for k in keys):   # memory only: cheaper inline than a thread hop
            slots, lease = self.store.lease_dram(keys)
        else:                                     # some come from NVMe or object storage
            loop = asyncio.get_running_loop()
            slots, lease = await loop.run_in_executor(self.app[srv.POOL], self.store.lease_dram, keys)
        lease_id = self.app[LEASES].add(lease, self.owned)
        if lease_id is None:
            return 503, (f"{self.app[LEASES].max_leases} shared-memory leases are outstanding; release leases "
                         "or raise server.max_shm_leases").encode()
        m = self.app[srv.METRICS]
        hits = sum(1 for s in slots if isinstance(s, tuple))
        m.count_hits("get", Tier.DRAM, hits, lease.nbytes, slots.count(None))
        m.observe_request("shm:lease", 200, time.perf_counter() - t0)
        return 0, w.encode_slots(lease_id, slots)

    async def handle(self, op: int, body: bytes) -> tuple[int, bytes] | None:
        if op == w.HELLO:
            return self.hello(body)
        if self.tenant is None:
            return 401, b"send HELLO with a token first"
        if op == w.LEASE:
            return await self.lease(body)
        if op in (w.RELEASE, w.FORGET):
            lease_id = w.decode_u64(body)
            valid = lease_id in self.owned and self.app[LEASES].pop(lease_id)
            self.owned.discard(lease_id)
            return None if op == w.FORGET else (0, bytes((int(valid),)))
        return 400, f"unknown control op {op}".encode()


async def _serve_connection(app: web.Application, reader, writer) -> None:
    session = ControlSession(app)
    try:
        while True:
            n, op = w.split_head(await reader.readexactly(w.HEAD_BYTES))
            try:
                reply = await session.handle(op, await reader.readexactly(n))
            except (w.ShmProtocolError, ValueError) as e:
                reply = (400, str(e).encode())
            if reply is not None:
                writer.write(w.frame(*reply))
    except (asyncio.IncompleteReadError, ConnectionError, w.ShmProtocolError):
        pass   # the client went away, or spoke garbage: drop the connection
    except Exception:
        log.exception("shared-memory control connection failed")
    finally:
        app[LEASES].drop_owner(session.owned)   # a dead client's leases end now, not at expiry
        writer.close()


def control_path(config) -> str:
    if config.shm_socket:
        return config.shm_socket
    if config.unix_socket:
        return config.unix_socket + ".shm"
    return os.path.join(tempfile.gettempdir(), f"kvcache-shm-{os.getpid()}-{secrets.token_hex(4)}.sock")


def add_routes(app: web.Application, config) -> None:
    store = app[srv.STORE]
    app[LEASES] = LeaseTable(store.release_dram, config.shm_lease_s, config.max_shm_leases)
    app[CONTROL_PATH] = control_path(config)
    app.router.add_get("/v1/shm", shm_info)

    async def control(app: web.Application):
        """The control socket while the app runs, and a sweeper for abandoned leases."""
        server, path = None, app[CONTROL_PATH]
        if _arena_info(store) is not None:
            if os.path.exists(path):
                os.unlink(path)    # a stale socket from a killed daemon
            old = os.umask(0o177)  # 0600: only this user connects (the arena is readable by it anyway)
            try:
                server = await asyncio.start_unix_server(lambda r, wr: _serve_connection(app, r, wr), path)
            finally:
                os.umask(old)

        async def sweep():
            while True:
                await asyncio.sleep(app[LEASES].lease_s / 2)
                app[LEASES].sweep()
        task = asyncio.get_running_loop().create_task(sweep())
        yield
        task.cancel()
        if server is not None:
            server.close()
            if os.path.exists(path):
                os.unlink(path)
        app[LEASES].release_all()
    app.cleanup_ctx.append(control)
