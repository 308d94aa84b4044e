"""The native batch_put: a KVB1 upload received by a thread of its own on a FrontConnection
(cli/http_front.py) that lends it the socket.

Same contract as the aiohttp handler (docs/api.md: auth, tenant keys, quota per chunk, limits,
the same JSON reply and errors) and the same chunking (cli/put_batch.py); what differs is who
moves the bytes and where they land:

    event loop: head parsed ──lend socket (reading paused)──> upload thread ──reply, give back──> loop
    upload thread:  socket ──recv_into──> free DRAM chunk (store.reserve_payload) ──put_many──> adopted
                      one kernel copy, the only one         (write-through: NVMe written from it first)
                    no free chunk ──recv_into──> staging buffer (reused) ──put_many──> copied into DRAM

Why a thread: on the event loop a 256 KiB payload arrives in several TCP bursts and each burst
costs a loop turn (selector, callbacks, a future): more Python than the copy itself. A thread
blocked in recv_into wakes once per burst with nothing else to run, and releases the GIL while
waiting. The socket is a dup() of the connection's, with a timeout (poll + recv): the shared
file flags never change, and the loop does not touch the connection until it is given back.

An error reply keeps the connection when the rest of the body can be skipped (Content-Length
says how much); a truncated body or a lost client closes it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus

from aiohttp import web

from kvcache.cli.http_front import HEAD_LIMIT, FrontConnection, Head, parse_head
from kvcache.cli.put_batch import ingest_puts_blocking
from kvcache.cli.server import CONFIG, METRICS, STORE, UNAUTHORIZED, authenticate, error_for
from kvcache.kvstore import wire
from kvcache.kvstore.errors import BlockFormatError

log = logging.getLogger(__name__)
BULK_PATH = "/v1/blocks/batch_put"
CHUNK_BYTES = 4 << 20          # stored per put_many call on this path (in the upload thread, before the next)
DRAIN_LIMIT = 64 << 20        # an error reply skips at most this much unread body, else closes
UPLOAD_THREADS = 32           # uploads received at once; more wait for a thread
WINDOW = 4096                 # one recv for frame headers (and the first bytes of their payload)
HOLD_S = 0.25                 # an upload thread waits this long for the connection's next upload


def _is_count(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes "²" and other digits int() refuses."""
    return text.isascii() and text.isdigit()


def wants(head: Head) -> bool:
    """Requests this path serves; everything else (chunked bodies, Expect, HTTP/1.0) is aiohttp's."""
    h = head.headers
    return (head.method == "POST" and head.target == BULK_PATH and head.version == "HTTP/1.1"
            and "transfer-encoding" not in h and "expect" not in h and _is_count(h.get("content-length", "x")))


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


STAGING = web.AppKey("staging", StagingPool)
UPLOADS = web.AppKey("upload_threads", ThreadPoolExecutor)


class Body:
    """The request body read from the lent socket, never past Content-Length. Frame headers come
    through a small read-ahead buffer; payloads go to DRAM landings, else to a staging buffer
    reused per chunk (a chunk is stored before the next one is received); a chunk holds less
    than CHUNK_BYTES before its last payload, so a payload of up to CHUNK_BYTES always fits there."""

    def __init__(self, sock: socket.socket, length: int, early: bytes, store=None):
        self.sock, self.store = sock, store
        self.buf = bytearray(max(64 << 10, len(early)))
        self.buf[: len(early)] = early
        self.start, self.end = 0, len(early)
        self.remaining = length         # body bytes not yet consumed by the parser
        self.staging: memoryview | None = None
        self.pos = 0
        self.landed: list[memoryview] = []   # DRAM landings read since the last chunk went to the store

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
            got = self.sock.recv_into(memoryview(self.buf)[self.end: self.end + want])
            if not got:
                raise ConnectionError("the client closed the connection mid-body")
            self.end += got

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
        dst = self.store.reserve_payload(n) if self.store is not None else None
        st = self.staging
        if dst is not None:
            self.landed.append(dst)
        elif st is not None and self.pos + n <= len(st):
            dst, self.pos = st[self.pos: self.pos + n], self.pos + n
        else:
            dst = memoryview(bytearray(n))
        have = min(n, self.end - self.start)
        dst[:have] = self.buf[self.start: self.start + have]
        self._consume(have)
        self._recv_into(dst[have:])
        self.remaining -= n - have
        return dst

    def _recv_into(self, view: memoryview) -> None:
        while view.nbytes:
            got = self.sock.recv_into(view)
            if not got:
                raise ConnectionError("the client closed the connection mid-body")
            view = view[got:]

    def next_chunk(self) -> None:
        """The chunk so far is stored: its staging bytes may be overwritten, and its store call
        released the landings it did not adopt."""
        self.pos = 0
        self.landed = []

    def skip_rest(self) -> bool:
        if self.remaining > DRAIN_LIMIT:
            return False
        try:
            buffered = min(self.remaining, self.end - self.start)
            self._consume(buffered)
            scratch = memoryview(bytearray(min(self.remaining, 1 << 20) or 1))
            while self.remaining:
                n = min(self.remaining, len(scratch))
                self._recv_into(scratch[:n])
                self.remaining -= n
        except (OSError, BlockFormatError):
            return False
        return True


def _respond(sock: socket.socket, status: int, body: bytes, close: bool) -> None:
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n")
    sock.sendall(head.encode() + body)


def serve_blocking(app: web.Application, sock: socket.socket, head: Head, early: bytes) -> tuple[bool, bytes]:
    """Serve one batch_put on the lent socket: (keep the connection?, bytes read past the body)."""
    t0 = time.perf_counter()
    store = app[STORE]
    body = Body(sock, int(head.headers["content-length"]), early, store)
    keep = head.headers.get("connection", "").lower() != "close"
    who = authenticate(app[CONFIG], head.headers.get("authorization", ""), BULK_PATH)
    if who is None:
        status, reply = UNAUTHORIZED[0], {"error": UNAUTHORIZED[1], "message": UNAUTHORIZED[2]}
    else:
        pool = app[STAGING]
        body.staging = pool.acquire()
        try:
            reply = ingest_puts_blocking(app, who, body.read, body.next_frame, body.next_chunk, CHUNK_BYTES)
            if body.remaining:
                raise BlockFormatError(f"{body.remaining} bytes follow the last frame of the batch")
            status = 200
        except (ConnectionError, TimeoutError):
            raise                       # nobody to answer
        except Exception as e:
            known = error_for(e)
            if known is None:
                log.exception("unhandled error on POST %s", BULK_PATH)
                known = (500, "internal", "internal error; see the daemon log")
            status, reply = known[0], {"error": known[1], "message": known[2]}
        finally:
            pool.release(body.staging)
            if body.landed:             # read but never handed to the store (an error): free their chunks
                store.release_payloads(body.landed)
    if status != 200 and body.remaining:
        keep = keep and body.skip_rest()
    app[METRICS].observe_request(BULK_PATH, status, time.perf_counter() - t0)
    _respond(sock, status, json.dumps(reply).encode(), close=not keep)
    return keep, body.leftover() if keep else b""


def serve_lent(app: web.Application, sock: socket.socket, head: Head, early: bytes, closing) -> tuple[bool, bytes]:
    """Serve batch_puts on the lent connection while they keep coming (a client streaming uploads
    never goes back through the loop); (keep the connection?, bytes read past the last one)."""
    while True:
        keep, rest = serve_blocking(app, sock, head, early)
        if not keep or closing():
            return keep, rest
        head, early, keep = _next_head(sock, rest)
        if head is None:
            return keep, early


def _next_head(sock: socket.socket, buf: bytes) -> tuple[Head | None, bytes, bool]:
    """The next request, if it is a batch_put that arrives within HOLD_S: (head, bytes after it,
    True); else (None, the bytes read, whether the connection is still open) for the loop."""
    timeout = sock.gettimeout()
    sock.settimeout(HOLD_S)
    try:
        while True:
            at = buf.find(b"\r\n\r\n")
            if at >= 0:
                head = parse_head(buf[: at + 4])
                return (head, buf[at + 4:], True) if head is not None and wants(head) else (None, buf, True)
            if len(buf) > HEAD_LIMIT:
                return None, buf, True
            more = sock.recv(WINDOW)
            if not more:
                return None, buf, False
            buf += more
    except TimeoutError:
        return None, buf, True
    finally:
        sock.settimeout(timeout)


async def serve_bulk_put(conn: FrontConnection, head: Head, app: web.Application) -> bool:
    """Serve batch_puts on an upload thread; True when the connection can take another request."""
    sock, early = conn.lend()
    keep, extra = False, b""
    try:
        keep, extra = await asyncio.get_running_loop().run_in_executor(
            app[UPLOADS], serve_lent, app, sock, head, early, lambda: conn.front.closing)
    except (OSError, asyncio.IncompleteReadError) as e:
        log.debug("bulk upload connection dropped: %s", e)
    finally:
        conn.give_back(sock, extra)
    return keep
