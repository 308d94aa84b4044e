"""The request body of a native batch_put (server/front/bulk_put.py), read by its upload thread from the
lent socket, and the staging memory payloads land in when no DRAM chunk is free.

    socket ──recv_into──> read-ahead buffer (frame headers) ──> parser
           ──recv_into──> payload: a DRAM landing, else staging room, else memory of its own
                          that grows as the bytes arrive (all counted as pending first, server/quota.py)

Every read is bounded by the socket's read timeout and by the request's deadline
(server.request_timeout_s): a client trickling bytes is cut off at the deadline, whatever the
pace of each read.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

from kvcache.server.front.head import LINGER_S, WINDOW
from kvcache.server.put_batch import GrowingPayload
from kvcache.server.quota import PendingBytes
from kvcache.kvstore import wire
from kvcache.kvstore.errors import BlockFormatError

CHUNK_BYTES = 4 << 20          # stored per put_many call on this path (in the upload thread, before the next)
DRAIN_LIMIT = 64 << 20        # an error reply skips at most this much unread body, else closes


class RequestDeadline(TimeoutError):
    """The upload ran past server.request_timeout_s (HTTP 408)."""


class StagingPool:
    """A few reusable staging buffers, so uploads neither allocate nor fault in fresh pages per
    request; when all are in use, payloads get buffers of their own (bounded memory either way)."""

    def __init__(self, count: int = 16, nbytes: int = 2 * CHUNK_BYTES):
        self.nbytes, self._left, self._free, self._lock = nbytes, count, [], threading.Lock()

    def acquire(self) -> memoryview | None:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._left:
                self._left -= 1
                return memoryview(bytearray(self.nbytes))
        return None

    def release(self, buf: memoryview | None) -> None:
        if buf is not None:
            with self._lock:
                self._free.append(buf)


class Body:
    """The request body read from the lent socket, never past Content-Length. Frame headers come
    through a small read-ahead buffer; payloads go to DRAM landings, else to a staging buffer
    reused per chunk (a chunk is stored before the next one is received); a chunk holds less
    than CHUNK_BYTES before its last payload, so a payload of up to CHUNK_BYTES always fits there."""

    def __init__(self, sock: socket.socket, length: int, early: bytes, store=None,
                 pending: PendingBytes | None = None, deadline: float = float("inf")):
        self.sock, self.store, self.pending, self.deadline = sock, store, pending, deadline
        self.read_timeout = sock.gettimeout()
        self.buf = bytearray(max(64 << 10, len(early)))
        self.buf[: len(early)] = early
        self.start, self.end = 0, len(early)
        self.remaining = length         # body bytes not yet consumed by the parser
        self.pool: StagingPool | None = None      # staging taken from it at the first payload that needs it
        self.staging: memoryview | None = None
        self.pos = 0
        self.landed: list[memoryview] = []   # DRAM landings read since the last chunk went to the store

    def _recv(self, view: memoryview) -> int:
        """One recv_into, within the read timeout and the request's deadline."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RequestDeadline("the upload took longer than server.request_timeout_s")
        if self.read_timeout is None or left < self.read_timeout:
            self.sock.settimeout(left)
        try:
            got = self.sock.recv_into(view)
        except TimeoutError:
            if time.monotonic() >= self.deadline:
                raise RequestDeadline("the upload took longer than server.request_timeout_s") from None
            raise
        if not got:
            raise ConnectionError("the client closed the connection mid-body")
        return got

    # ---------------------------------------------------------------- the read-ahead buffer
    def _fill(self, n: int) -> None:
        """At least n body bytes buffered; reads never go past the body (the early bytes may)."""
        if n > self.remaining:
            raise BlockFormatError("the body ends inside a frame")
        while self.end - self.start < n:
            have = self.end - self.start
            if self.start and self.end + WINDOW > len(self.buf):
                self.buf[:have] = self.buf[self.start: self.end]
                self.start, self.end = 0, have
            if self.start + n > len(self.buf):
                self.buf.extend(bytes(self.start + n - len(self.buf)))
            want = min(max(WINDOW, n - have), len(self.buf) - self.end, self.remaining - have)
            self.end += self._recv(memoryview(self.buf)[self.end: self.end + want])

    def _consume(self, n: int) -> None:
        if n > self.remaining:
            raise BlockFormatError(f"a frame runs {n - self.remaining} bytes past the Content-Length")
        self.start += n
        self.remaining -= n
        if self.start == self.end:
            self.start = self.end = 0

    def read(self, n: int) -> bytes:
        if n > self.remaining:
            raise BlockFormatError(f"a frame runs {n - self.remaining} bytes past the Content-Length")
        self._fill(n)
        out = bytes(self.buf[self.start: self.start + n])
        self._consume(n)
        return out

    def leftover(self) -> bytes:
        """Bytes read past this body (a pipelined next request), for the event loop."""
        return bytes(self.buf[self.start: self.end]) if not self.remaining else b""

    # ---------------------------------------------------------------- frames and payloads
    def next_frame(self, max_payload: int) -> wire.PutFrame:
        while True:
            got = wire.parse_put_head(memoryview(self.buf)[self.start: self.end], max_payload)
            if got is not None:
                break
            self._fill(self.end - self.start + 1)
        frame, plen, used = got
        self._consume(used)
        return dataclasses.replace(frame, payload=self.read_payload(plen))

    def read_payload(self, n: int) -> memoryview:
        if n > self.remaining:
            raise BlockFormatError(f"a frame runs {n - self.remaining} bytes past the Content-Length")
        dst = self._landing(n)
        if dst is None:
            return self._receive_growing(n)
        have = min(n, self.end - self.start)
        dst[:have] = self.buf[self.start: self.start + have]
        self._consume(have)
        self._recv_into(dst[have:])
        self.remaining -= n - have
        return dst

    def _landing(self, n: int) -> memoryview | None:
        """A DRAM chunk or staging room for n bytes, counted as pending first; None when neither."""
        self._count(n)
        dst = self.store.reserve_payload(n) if self.store is not None else None
        if dst is None and self.staging is None and self.pool is not None and n <= self.pool.nbytes:
            self.staging = self.pool.acquire()
        st = self.staging
        if dst is not None:
            self.landed.append(dst)
        elif st is not None and self.pos + n <= len(st):
            dst, self.pos = st[self.pos: self.pos + n], self.pos + n
        elif self.pending is not None:
            self.pending.release(n)
        return dst

    def _count(self, n: int) -> None:
        if self.pending is not None:
            self.pending.add(n)

    def _receive_growing(self, n: int) -> memoryview:
        """n bytes into memory of their own that grows as they arrive (put_batch.GrowingPayload)."""
        payload = GrowingPayload(n, self._count)
        have = min(n, self.end - self.start)
        payload.write(self.buf[self.start: self.start + have])
        self._consume(have)
        while not payload.done:
            self.remaining -= payload.receive(self._recv)
        return memoryview(payload.buf)

    def _recv_into(self, view: memoryview) -> None:
        while view.nbytes:
            view = view[self._recv(view):]

    def next_chunk(self) -> None:
        """The chunk so far is stored: its staging bytes may be overwritten, and its store call
        released the landings it did not adopt."""
        self.pos = 0
        self.landed = []

    def skip_rest(self) -> bool:
        if self.remaining > DRAIN_LIMIT:
            return False
        try:
            self._drop(self.remaining)
        except (OSError, BlockFormatError):
            return False
        return True

    def _drop(self, n: int) -> None:
        """Read and discard n body bytes."""
        buffered = min(n, self.end - self.start)
        self._consume(buffered)
        n -= buffered
        scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
        while n:
            k = min(n, len(scratch))
            self._recv_into(scratch[:k])
            self.remaining -= k
            n -= k

    def linger(self) -> None:
        """After a reply with Connection: close and the write side shut: drop what the client
        still sends of its body, for up to LINGER_S, so that closing does not reset the
        connection before it has read the reply. A deadline of its own: after a 408 the
        request's has passed."""
        self.deadline = time.monotonic() + LINGER_S
        try:
            self._drop(self.remaining)
            self._recv(memoryview(bytearray(1)))   # the client's close, once it has read the reply
        except (OSError, BlockFormatError):
            pass
