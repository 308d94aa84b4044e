"""The client end of the shared-memory control socket (framing: kvstore/shm_wire.py): HELLO,
which brings the arena's fds, then leases, releases and touches, one call at a time.

    _hello (blocking)   connect, HELLO token, the answer and the fds on its first bytes
    ShmControl          the async client's connection: HELLO in a thread (asyncio streams
                        cannot receive fds), then the same socket as a stream
    BlockingShmControl  the blocking client's own connection (its fds are closed at once)
"""

from __future__ import annotations

import asyncio
import select
import socket
import threading

from kvcache.kvstore import shm_wire as w


class ArenaUnavailable(OSError):
    """The daemon's arena cannot be mapped from here (says why)."""


class LeaseRefused(ArenaUnavailable):
    """The daemon has too many leases outstanding (503): this read's remaining blocks go over
    HTTP, and the attachment stays (the next read leases again)."""


BUSY = 503


def _refused(status: int, body: bytes) -> ArenaUnavailable:
    cls = LeaseRefused if status == BUSY else ArenaUnavailable
    return cls(f"shared-memory lease refused ({status}): {body.decode(errors='replace')}")


def _hello(path: str, token: str, timeout_s: float) -> tuple[socket.socket, str, list[int]]:
    """Connect and say HELLO (blocking): the socket, the tenant's name and the fds that came with
    the answer (the caller owns them). ArenaUnavailable when refused or unanswered. `token` is
    HELLO's body: the bearer token, optionally followed by a newline and the client's name (the
    daemon's metrics label: server/metrics.py)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(path)
    except OSError as e:
        sock.close()
        raise ArenaUnavailable(f"cannot connect to the daemon's control socket {path}: {e!r}") from e
    fds: list[int] = []
    try:
        sock.sendall(w.frame(w.HELLO, token.encode()))
        head, fds = w.recv_head_with_fds(sock)
        n, status = w.split_head(head)
        body = w.recv_exact(sock, n)
    except (OSError, w.ShmProtocolError) as e:      # a timeout, a reset, a malformed answer
        w.close_fds(fds)
        sock.close()
        raise ArenaUnavailable(f"the daemon's control socket {path} did not answer: {e!r}") from e
    if status:
        w.close_fds(fds)
        sock.close()
        raise ArenaUnavailable(f"the daemon refused the shared-memory path ({status}): {body.decode(errors='replace')}")
    return sock, body.decode(errors="replace"), fds


class ShmControl:
    """The client end of the control socket (kvstore/shm_wire.py): one connection, calls in turn."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout_s: float = 30.0):
        self._reader, self._writer = reader, writer
        self._lock = asyncio.Lock()
        self.timeout_s = timeout_s   # a call's bound: a stopped daemon must not hang its readers
        self.tenant = ""     # from HELLO's answer: directory entries are under the tenant's keys
        self.fds: list[int] = []     # HELLO's: the arena, then the read directory (attach_shared takes them)

    @classmethod
    async def connect(cls, path: str, token: str, timeout_s: float = 30.0) -> "ShmControl":
        """HELLO on a blocking socket in a thread (asyncio streams cannot receive fds), then
        the same socket as a stream."""
        sock, tenant, fds = await asyncio.to_thread(_hello, path, token, timeout_s)
        try:
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        except BaseException as e:
            w.close_fds(fds)
            sock.close()
            if isinstance(e, OSError):
                raise ArenaUnavailable(f"cannot use the daemon's control socket {path}: {e!r}") from e
            raise
        ctl = cls(reader, writer, timeout_s)
        ctl.tenant, ctl.fds = tenant, fds
        return ctl

    async def call(self, op: int, body: bytes) -> tuple[int, bytes]:
        """One request and its answer, within timeout_s (TimeoutError, an OSError). A call that does
        not complete (timed out, cancelled, failed) closes the connection: the next call fails
        over to HTTP instead of reading this call's late answer as its own."""
        async with self._lock:
            try:
                return await asyncio.wait_for(self._exchange(op, body), self.timeout_s)
            except BaseException:    # a timeout, a cancelled caller, a broken frame: the answer may
                self._writer.close()   # still come, and the next call would read it as its own
                raise

    async def _exchange(self, op: int, body: bytes) -> tuple[int, bytes]:
        self._writer.write(w.frame(op, body))
        n, status = w.split_head(await self._reader.readexactly(w.HEAD_BYTES))
        return status, await self._reader.readexactly(n)

    async def lease(self, keys: list[bytes]) -> tuple[int, list]:
        status, body = await self.call(w.LEASE, w.encode_keys(keys))
        if status:
            raise _refused(status, body)
        return w.decode_slots(body)

    async def release(self, lease_id: int) -> bool:
        """Release and learn whether the lease still held (False: it had expired)."""
        status, body = await self.call(w.RELEASE, w.encode_u64(lease_id))
        return status == 0 and body == b"\x01"

    def forget(self, lease_id: int) -> None:
        """Release without waiting for an answer (none comes); the frame is queued in order."""
        self._writer.write(w.frame(w.FORGET, w.encode_u64(lease_id)))

    def alive(self) -> bool:
        """False once the daemon closed the connection (see BlockingShmControl.alive)."""
        return not (self._reader.at_eof() or self._writer.is_closing())

    async def touch(self, keys: list[bytes], max_keys: int) -> None:
        """Tell the daemon about blocks read through the directory (no answer comes). Drained:
        a client that only ever reads through the directory awaits nothing else on this socket."""
        self._writer.write(w.touch_frames(keys, max_keys))
        await self._writer.drain()

    async def close(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass


class BlockingShmControl:
    """ShmControl for the blocking client: the same frames over a blocking socket, one call at a
    time (the copies run outside the lock, so threads only queue for the round trips)."""

    def __init__(self, sock: socket.socket):
        self._sock, self.lock = sock, threading.Lock()   # held across pipelined calls
        self.tenant = ""

    @classmethod
    def connect(cls, path: str, token: str, timeout_s: float) -> "BlockingShmControl":
        """A second control connection beside the async client's: that one mapped the arena,
        so the fds this HELLO brings are closed at once."""
        sock, tenant, fds = _hello(path, token, timeout_s)
        w.close_fds(fds)
        ctl = cls(sock)
        ctl.tenant = tenant
        return ctl

    def call(self, op: int, body: bytes) -> tuple[int, bytes]:
        with self.lock:
            self._sock.sendall(w.frame(op, body))
            return self._reply()

    def _reply(self) -> tuple[int, bytes]:
        n, status = w.split_head(w.recv_exact(self._sock, w.HEAD_BYTES))
        return status, w.recv_exact(self._sock, n)

    # pipelined leases (the caller holds `self.lock` across them: replies come back in order)
    def send_lease(self, keys: list[bytes], files: bool = False) -> None:
        """LEASE, or with `files` LEASE_FILES (blocks only on NVMe may come as file slots)."""
        self._sock.sendall(w.frame(w.LEASE_FILES if files else w.LEASE, w.encode_keys(keys)))

    def recv_lease(self, files: bool = False) -> tuple[int, list, list[int]]:
        """A lease's id, slots and the segment descriptors it brought (the caller closes them)."""
        if not files:
            status, body = self._reply()
            fds: list[int] = []
        else:
            head, fds = w.recv_head_with_fds(self._sock, w.MAX_LEASE_FDS)
            try:
                n, status = w.split_head(head)
                body = w.recv_exact(self._sock, n)
            except BaseException:
                w.close_fds(fds)
                raise
        if status:
            w.close_fds(fds)
            raise _refused(status, body)
        try:
            lease_id, slots = w.decode_slots(body, files, len(fds))
        except w.ShmProtocolError:
            w.close_fds(fds)
            raise
        return lease_id, slots, fds

    def release(self, lease_id: int) -> bool:
        """Under the caller's lock (see read_leased_blocking)."""
        self._sock.sendall(w.frame(w.RELEASE, w.encode_u64(lease_id)))
        status, body = self._reply()
        return status == 0 and body == b"\x01"

    def forget(self, lease_id: int) -> None:
        """Under the caller's lock."""
        self._sock.sendall(w.frame(w.FORGET, w.encode_u64(lease_id)))

    def alive(self) -> bool:
        """False once the daemon closed the connection (it died, or dropped the session): its
        table and arena then stay mapped here but must not be read. No wait: a zero-timeout poll."""
        with self.lock:
            poller = select.poll()       # not select(): engines may hold more than 1,024 fds
            poller.register(self._sock, select.POLLIN)
            if not poller.poll(0):
                return True
            try:
                return self._sock.recv(1, socket.MSG_PEEK) != b""
            except OSError:
                return False

    def touch(self, keys: list[bytes], max_keys: int) -> None:
        with self.lock:
            self._sock.sendall(w.touch_frames(keys, max_keys))

    def close(self) -> None:
        """Safe while another thread is mid-call: shutdown wakes its recv/send (it then fails
        over to HTTP), and the fd is closed only once it let go of the lock, so it never reads
        a reused fd number."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass                     # never connected, or already shut
        with self.lock:
            self._sock.close()
