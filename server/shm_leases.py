"""The same-host shared-memory read path of `kvcache serve` (docs/api.md, "Shared memory").

    GET /v1/shm (HTTP, authenticated)  -> {pid, fd, size, inode, lease_s, control_socket,
                                           directory: {pid, fd, size, inode} | null}
    control socket (server/shm_control.py, framing in kvstore/shm_wire.py):
        HELLO token -> the arena's and the directory's fds (SCM_RIGHTS, read-only, sealed)
        then LEASE keys -> slots, RELEASE / FORGET lease, TOUCH keys
    read directory (kvstore/shm_directory.py): leased blocks' places, read again without asking

This module holds the lease table; server/shm_routes.py adds the route and runs the control
socket and the lease sweeper while the app runs.

The control channel is a bare unix socket served by threads of its own, not HTTP on the event
loop: a lease round trip must cost far less than copying the blocks, and an HTTP request costs
several times what a 16 MiB memcpy does.
A lease pins the chunks (BlockStore.lease_dram) until released, until its connection closes, or
until `server.shm_lease_s` passes; an expired lease is released by the daemon, its chunks may be
reused, and a late RELEASE answers valid=0, so the client throws its copy away and reads over
HTTP instead. Clients also know the lease length, so copies that end well inside it need no answer.

Who may use it: the arena holds every tenant's blocks, so a token needs `admin` or
`shared_memory = true` (or auth is off, which means loopback only and one trust domain).
Clients get the memory only from an accepted HELLO: the daemon is not dumpable, so its
/proc/<pid>/fd is closed to processes of its user; pid and fd in the JSON are for people (and
ps/lsof as root), inode and size let a client check what it received. Nobody but the daemon can
write the memory (tiering/arena.py seals it), so what a client copies is what the daemon wrote.
"""

from __future__ import annotations

import heapq
import itertools
import os
import secrets
import tempfile
import threading
import time
from typing import Callable

from aiohttp import web

from kvcache.kvstore.leases import DramLease


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


def control_path(config) -> str:
    if config.shm_socket:
        return config.shm_socket
    if config.unix_socket:
        return config.unix_socket + ".shm"
    return os.path.join(tempfile.gettempdir(), f"kvcache-shm-{os.getpid()}-{secrets.token_hex(4)}.sock")

