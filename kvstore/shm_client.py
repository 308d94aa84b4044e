"""The client half of the same-host shared-memory path: map the daemon's DRAM arena read-only
and copy leased blocks out of it (server half and protocol: cli/server_shm.py, docs/api.md).

    client                                   daemon
    GET /v1/shm (HTTP) ──────────────────>  {pid, fd, size, inode, lease_s, control_socket}
    open /proc/<pid>/fd/<fd>, check inode and size, mmap read-only      (once per client)
    connect control_socket, HELLO token ─>  ok                          (once per client)
    LEASE keys ──────────────────────────>  (offset, nbytes) | miss | socket, per key
    memcpy arena[offset:offset+nbytes] -> caller's buffer               (payload never on a socket)
    FORGET lease (no answer awaited)     or RELEASE lease -> valid? (copies that took long)

Mapping fails on another host, in another container or across users: the client then reads over
the socket (shared_memory="auto") or raises (shared_memory="on").
"""

from __future__ import annotations

import asyncio
import mmap
import os
import time
from dataclasses import dataclass

from kvcache.kvstore import shm_wire as w


class ArenaUnavailable(OSError):
    """The daemon's arena cannot be mapped from here (says why)."""


@dataclass
class LocalArena:
    """A read-only mapping of the daemon's DRAM arena."""
    path: str
    size: int
    _map: mmap.mmap
    view: memoryview

    @classmethod
    def attach(cls, info: dict) -> "LocalArena":
        path = f"/proc/{int(info['pid'])}/fd/{int(info['fd'])}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise ArenaUnavailable(f"cannot open the daemon's arena at {path}: {e.strerror} (another host, "
                                   "container or user?)") from e
        try:
            st = os.fstat(fd)
            if st.st_ino != info["inode"] or st.st_size != info["size"]:
                raise ArenaUnavailable(f"{path} is not the daemon's arena (inode {st.st_ino}, {st.st_size} bytes; "
                                       f"expected {info['inode']}, {info['size']}): a pid from another namespace?")
            mapping = mmap.mmap(fd, info["size"], mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(path, info["size"], mapping, memoryview(mapping))

    def slice(self, offset: int, nbytes: int) -> memoryview:
        if not (0 <= offset and nbytes >= 0 and offset + nbytes <= self.size):
            raise ArenaUnavailable(f"the daemon leased bytes {offset}+{nbytes} outside its {self.size}-byte arena")
        return self.view[offset: offset + nbytes]

    def close(self) -> None:
        self.view.release()
        try:
            self._map.close()
        except BufferError:   # a caller's slice is still alive; the GC unmaps it later
            pass


class ShmControl:
    """The client end of the control socket (kvstore/shm_wire.py): one connection, calls in turn."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, path: str, token: str) -> "ShmControl":
        try:
            reader, writer = await asyncio.open_unix_connection(path)
        except OSError as e:
            raise ArenaUnavailable(f"cannot connect to the daemon's control socket {path}: {e}") from e
        ctl = cls(reader, writer)
        status, body = await ctl.call(w.HELLO, token.encode())
        if status:
            await ctl.close()
            raise ArenaUnavailable(f"the daemon refused the shared-memory path ({status}): {body.decode()}")
        return ctl

    async def call(self, op: int, body: bytes) -> tuple[int, bytes]:
        async with self._lock:
            self._writer.write(w.frame(op, body))
            n, status = w.split_head(await self._reader.readexactly(w.HEAD_BYTES))
            return status, await self._reader.readexactly(n)

    async def lease(self, keys: list[bytes]) -> tuple[int, list]:
        status, body = await self.call(w.LEASE, w.encode_keys(keys))
        if status:
            raise ArenaUnavailable(f"shared-memory lease refused ({status}): {body.decode()}")
        return w.decode_slots(body)

    async def release(self, lease_id: int) -> bool:
        """Release and learn whether the lease still held (False: it had expired)."""
        status, body = await self.call(w.RELEASE, w.encode_u64(lease_id))
        return status == 0 and body == b"\x01"

    def forget(self, lease_id: int) -> None:
        """Release without waiting for an answer (none comes); the frame is queued in order."""
        self._writer.write(w.frame(w.FORGET, w.encode_u64(lease_id)))

    async def close(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass


async def read_leased(ctl: ShmControl, arena: LocalArena, keys: list[bytes], max_keys: int, take,
                      lease_s: float):
    """Lease `keys` in chunks and call `take(i, view)` for each leased block (`view` is valid only
    during the call). Returns ({i: take's result}, [indices to read over HTTP]); misses are in neither.

    Validity: the daemon honours a lease for `lease_s` from when it granted it, which is after we
    sent the request. Copies that end within half that time of the send are good without asking
    (CLOCK_MONOTONIC is one clock for the host, and only durations are compared), so the release
    needs no answer and a read costs one round trip. Slower copies wait for the release's answer;
    when the lease had expired they move to the HTTP list."""
    got: dict[int, object] = {}
    rest: list[int] = []
    for base in range(0, len(keys), max_keys):
        chunk = keys[base: base + max_keys]
        sent = time.monotonic()
        lease_id, slots = await ctl.lease(chunk)
        if len(slots) != len(chunk):
            raise ArenaUnavailable(f"shm lease answered {len(slots)} slots for {len(chunk)} keys")
        done: list[int] = []
        try:
            for j, slot in enumerate(slots):
                if slot is None:
                    continue
                if slot == "socket":
                    rest.append(base + j)
                    continue
                got[base + j] = take(base + j, arena.slice(slot[0], slot[1]))
                done.append(base + j)
        except BaseException:
            ctl.forget(lease_id)
            raise
        if time.monotonic() - sent < lease_s / 2:
            ctl.forget(lease_id)
        elif not await ctl.release(lease_id):   # expired while we copied: the bytes may be another block's
            for i in done:
                del got[i]
            rest += done
    return got, sorted(rest)
