"""The daemon's connections: a front protocol per connection (accepted by server/front/site.py)
that serves bulk uploads natively and hands every other request, with the bytes read so far,
to aiohttp.

    accept ─> FrontConnection: read one request head ─┬─ POST /v1/blocks/batch_put, HTTP/1.1,
              (peek, nothing consumed yet)            │  Content-Length body: the connection is
                                                      │  lent to an upload thread (server/front/bulk_put.py)
                                                      │  that receives payloads straight into DRAM,
                                                      │  replies and gives it back; then the next head
                                                      └─ anything else: transport.set_protocol(aiohttp's
                                                         RequestHandler), which owns it from then on

Why: on uploads aiohttp's receive path (socket read -> parser -> StreamReader chunks -> our
copy) was most of the daemon's CPU: three copies and a Python object per chunk, and a loop turn
per TCP burst. On the native path the kernel copies each payload once, into the DRAM chunk that
becomes the block. Clients keep bulk uploads on connections of their own (KVClient does), so
they stay on this path; a connection that has served anything else belongs to aiohttp, which
serves batch_put as well (slower).

Flow control: the head buffer pauses the transport when full, and a lent connection is not read
by the loop at all, so a fast client never makes the daemon buffer more than it chose to.

What a connection costs the daemon before it has shown a token: an 8 KiB head buffer (grown
to HEAD_LIMIT only while a long head arrives, shrunk after), for at most header_timeout_s per
head; a batch_put head is admitted on the loop (server/front/bulk_put.py `admit`) and a stranger gets
its 401 there, the body unread. At server.max_connections a new connection closes the oldest
that has completed no request and is idle, or is closed at once when there is none.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from aiohttp import web

from kvcache.server.front.head import (LINGER_S, NOT_PLAIN, WINDOW, Head, head_end, parse_head,  # noqa: F401
                                   reply_head)                       # (parse_head: the front's API)
from kvcache.server.request_state import CONFIG, TOKENED

log = logging.getLogger(__name__)
HEAD_LIMIT = 16 << 10          # request line + headers; larger heads go to aiohttp (which answers 431)
BUFFER_BYTES = 2 * WINDOW      # the head buffer a connection starts (and shrinks back) to
MAX_BUFFER_BYTES = HEAD_LIMIT + 2 * WINDOW   # what it grows to while a head is incomplete
REFUSED = object()             # UploadPath.admit: answered on the loop, the connection closes


@dataclass(frozen=True)
class UploadPath:
    """The requests a front serves itself instead of handing them to aiohttp (the daemon's: bulk
    uploads, server/front/bulk_put.py), as callbacks, so that the front imports no handler."""
    wants: Callable[[Head], bool]                            # a head this path serves
    admit: Callable[["FrontConnection", Head], object]       # its principal; REFUSED; None: aiohttp's
    serve: Callable[["FrontConnection", Head, web.Application, object], Awaitable[bool]]  # keep it open?


class FrontConnection(asyncio.BufferedProtocol):
    """One client connection until it is handed to aiohttp: reads request heads into a small
    buffer; bulk uploads are lent, socket and all, to an upload thread (server/front/bulk_put.py)."""

    def __init__(self, front: "Front"):
        self.front = front
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray(BUFFER_BYTES)   # small: an idle connection costs little; grows for a long head
        self._start = self._end = 0
        self._window = WINDOW
        self._wake: asyncio.Future | None = None
        self._eof = self._lost = self._paused = self._handed = self._lent = self._refused = False
        self.served = False     # has completed a request (idle timeout: keepalive_s, else header_timeout_s)
        self.busy = False       # inside a request (shutdown waits for it)
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------ transport callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.front.full() and not self.front.drop_oldest_idle():
            self.front.warn_full()   # refused before anything is read or allocated for it
            transport.abort()
            return
        self.front.connections[self] = None
        self._task = asyncio.get_running_loop().create_task(self._serve())

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._end == len(self._buf):
            if self._start:
                self._compact()
            elif len(self._buf) < MAX_BUFFER_BYTES:
                self._resize(min(MAX_BUFFER_BYTES, 2 * len(self._buf)))
        # A small window: a large recv here would pull the body's first payload into this
        # buffer, and the upload thread would copy it out again.
        return memoryview(self._buf)[self._end: self._end + self._window]

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        if self._end == len(self._buf) and not self._start and len(self._buf) >= MAX_BUFFER_BYTES:
            self._pause()
        self._wakeup()

    def eof_received(self) -> bool:
        self._eof = True
        self._wakeup()
        return True             # keep the transport: a reply may still be due

    def connection_lost(self, exc) -> None:
        self._lost = True
        self.front.connections.pop(self, None)
        self._wakeup()

    # ------------------------------------------------------------ reading
    async def read_head(self) -> bytes | None:
        """The next request head, peeked (not consumed); None when the client closed or idled out.
        A connection waits keepalive_s for a next request once it has served one; a head, once
        begun (or on a connection that never completed a request), must be whole within
        header_timeout_s: a client trickling a head byte by byte is cut off then."""
        loop, front = asyncio.get_running_loop(), self.front
        waiting = self.served and self._end == self._start
        timer = loop.call_later(front.keepalive_s if waiting else front.header_timeout_s, self._idle_out)
        try:
            while True:
                end = head_end(self._buf, self._start, self._end)
                if end == NOT_PLAIN:
                    return b""          # not a plain CRLF head: aiohttp answers it
                if end > 0:
                    return bytes(self._buf[self._start: end])
                if self._end - self._start > HEAD_LIMIT:
                    return b""          # too large: aiohttp answers it
                if self._eof or self._lost:
                    return None
                if waiting and self._end > self._start:     # a head began: it has header_timeout_s
                    waiting = False
                    timer.cancel()
                    timer = loop.call_later(front.header_timeout_s, self._idle_out)
                await self._more(0, timeout=None)
        except asyncio.IncompleteReadError:
            return None
        finally:
            timer.cancel()

    def _consume(self, n: int) -> None:
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
            if len(self._buf) > BUFFER_BYTES:   # a long head grew it: idle connections stay small
                self._buf = bytearray(BUFFER_BYTES)
        self._resume()

    def _compact(self) -> None:
        rest = self._end - self._start
        self._buf[:rest] = self._buf[self._start: self._end]
        self._start, self._end = 0, rest

    def _resize(self, size: int) -> None:
        """A new buffer (never resized in place: the transport may hold a view of the old one)."""
        rest = self._end - self._start
        buf = bytearray(max(size, rest))
        buf[:rest] = self._buf[self._start: self._end]
        self._buf, self._start, self._end = buf, 0, rest

    async def _more(self, want: int, timeout: float | None = -1.0) -> None:
        """Wait for more bytes (`want`: how many the caller needs in all, a window hint)."""
        if self._lost or self._eof:
            raise asyncio.IncompleteReadError(b"", want)
        loop = asyncio.get_running_loop()
        self._wake = wake = loop.create_future()
        self._window = max(WINDOW, want - (self._end - self._start))
        self._resume()
        t = self.front.read_timeout_s if timeout == -1.0 else timeout
        timer = loop.call_later(t, self._timed_out, wake) if t else None
        try:
            await wake
        finally:
            self._wake, self._window = None, WINDOW
            if timer is not None:
                timer.cancel()

    @staticmethod
    def _timed_out(wake: asyncio.Future) -> None:
        if not wake.done():
            wake.set_exception(asyncio.IncompleteReadError(b"", 0))

    def _wakeup(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        if self._paused and not self._lost and not self._lent:
            self._paused = False
            self.transport.resume_reading()

    def droppable(self) -> bool:
        """Idle and yet to complete a request: what a flood of connections is made of."""
        return not (self.served or self.busy or self._lent or self._handed or self._refused or self._lost)

    def _idle_out(self) -> None:
        if not self.busy and self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------ lending to a thread
    def lend(self) -> tuple[socket.socket, bytes]:
        """The connection for a blocking thread (server/front/bulk_put.py): reading paused here, a dup()
        of the socket with the read timeout (poll + recv: the shared O_NONBLOCK flag stays as
        the loop wants it), and the bytes already read past the head. The loop neither reads
        nor writes the connection until give_back."""
        self._pause()
        self._lent = True
        sock = socket.socket(fileno=os.dup(self.transport.get_extra_info("socket").fileno()))
        sock.settimeout(self.front.read_timeout_s)
        early = bytes(self._buf[self._start: self._end])
        self._start = self._end = 0
        if len(self._buf) > BUFFER_BYTES:
            self._buf = bytearray(BUFFER_BYTES)
        return sock, early

    def give_back(self, sock: socket.socket, extra: bytes) -> None:
        """Back from the thread, with the bytes it read past its request."""
        sock.close()                  # the dup only
        self._lent = False
        self.served = True
        if extra:
            self._buf = bytearray(max(BUFFER_BYTES, len(extra)))
            self._buf[: len(extra)] = extra
            self._start, self._end = 0, len(extra)
        self._resume()

    def refuse(self, status: int, code: str, message: str) -> None:
        """Answer from the event loop and close, reading nothing more: the reply and a FIN go
        out now; the socket closes after LINGER_S (a client still sending its body then gets a
        reset, and finds the reply in its receive buffer)."""
        body = json.dumps({"error": code, "message": message}).encode()
        self._pause()
        self.transport.write(reply_head(status, len(body), close=True) + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)
        self._refused = True          # _serve's exit leaves the closing to the timer

    # ------------------------------------------------------------ the request loop
    async def _serve(self) -> None:
        upload = self.front.upload
        try:
            while not self.front.closing:
                raw = await self.read_head()
                if raw is None:
                    break
                head = parse_head(raw) if raw else None
                if head is None or upload is None or not upload.wants(head):
                    self._hand_over()
                    return
                who = upload.admit(self, head)
                if who is REFUSED:
                    return
                if who is None:                 # no upload thread for it: all in use, or its tenant's share
                    self._hand_over()
                    return
                self.busy = True
                self._consume(head.size)
                keep = await upload.serve(self, head, self.front.app, who)
                self.busy = False
                if not keep:
                    break
        except (OSError, asyncio.IncompleteReadError) as e:   # the client's doing (a reset): no ERROR
            log.debug("bulk connection failed: %r", e)
        except Exception:
            log.exception("bulk connection failed")
        finally:
            self.busy = False
            if not self._handed and not self._refused and self.transport is not None:
                self.transport.close()

    def _hand_over(self) -> None:
        """aiohttp takes the connection for good, with every byte read so far."""
        if self._lost:
            return
        self._handed = True
        self.front.connections.pop(self, None)
        data = bytes(self._buf[self._start: self._end])
        self._resume()
        proto = self.front.aiohttp_factory()
        self.transport.set_protocol(proto)
        proto.connection_made(self.transport)
        if data:
            proto.data_received(data)
        if self._eof:
            proto.eof_received()


@dataclass
class Front:
    """What every FrontConnection of one daemon shares. Timeouts and limits left None come from
    the app's [server] settings when the front is made."""
    app: web.Application
    aiohttp_factory: object
    upload: UploadPath | None = None         # None: every request goes to aiohttp
    keepalive_s: float | None = None         # an idle connection, between requests
    read_timeout_s: float | None = None      # one socket read of an upload
    header_timeout_s: float | None = None    # a request head, from its first byte
    max_connections: int | None = None
    max_uploads_per_tenant: int | None = None
    closing: bool = False
    connections: dict = field(default_factory=dict)   # front-owned, oldest first (values unused)
    uploads: Counter = field(default_factory=Counter)   # upload threads in use, per tenant
    warned_full_at: float = float("-inf")

    def __post_init__(self) -> None:
        cfg = self.app[CONFIG]
        for name in ("keepalive_s", "header_timeout_s", "max_connections",
                     "max_uploads_per_tenant"):
            if getattr(self, name) is None:
                setattr(self, name, getattr(cfg, name))
        if self.read_timeout_s is None:
            self.read_timeout_s = cfg.request_timeout_s

    def open_count(self) -> int:
        """Connections open: front-owned ones and those aiohttp serves."""
        return len(self.connections) + len(getattr(self.aiohttp_factory, "connections", ()))

    def full(self) -> bool:
        return self.open_count() >= self.max_connections

    def drop_oldest_idle(self) -> bool:
        """Make room at max_connections by closing the oldest front-owned connection that has
        completed no request and is not inside one (as the shared-memory socket drops its oldest
        connection without HELLO): a peer holding idle connections cannot lock others out.
        Next, the oldest connection aiohttp serves that sits between requests and has shown no
        valid token (a /healthz needs none, so a stranger can make those too; a tenant's pooled
        connections are not torn down for a stranger's). False when there is neither."""
        for c in self.connections:
            if c.droppable():
                del self.connections[c]
                c.transport.abort()
                return True
        for handler in getattr(self.aiohttp_factory, "connections", ()):
            # aiohttp's RequestHandler: no handler running, no request queued. Read defensively
            # (private fields): where they are missing, nothing is dropped.
            if getattr(handler, "transport", None) in self.app[TOKENED]:
                continue
            if not getattr(handler, "_request_in_progress", True) and not getattr(handler, "_messages", True):
                handler.force_close()
                return True
        return False

    def warn_full(self) -> None:
        """Once a minute at most: a flood of connections must not flood the log as well."""
        now = time.monotonic()
        if now - self.warned_full_at >= 60:
            self.warned_full_at = now
            log.warning("refusing connections: %d open (server.max_connections)", self.open_count())

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests: idle connections close now, busy ones after their reply."""
        self.closing = True
        tasks = []
        for c in list(self.connections):
            if c.busy and c._task is not None:
                tasks.append(c._task)
            elif c.transport is not None:
                c.transport.close()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
