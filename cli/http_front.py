"""The daemon's listening sockets: a front protocol per connection that serves bulk uploads
natively and hands every other request, with the bytes read so far, to aiohttp.

    accept ─> FrontConnection: read one request head ─┬─ POST /v1/blocks/batch_put, HTTP/1.1,
              (peek, nothing consumed yet)            │  Content-Length body: served here
                                                      │  (cli/bulk_put.py); payloads are received
                                                      │  straight into staging buffers (recv_into),
                                                      │  then the next head on the same connection
                                                      └─ anything else: transport.set_protocol(aiohttp's
                                                         RequestHandler), which owns it from then on

Why: on uploads aiohttp's receive path (socket read -> parser -> StreamReader chunks -> our
copy) was most of the daemon's CPU: three copies and a Python object per chunk. Here the kernel
copies each payload once, into memory the store then copies into its DRAM tier. Clients keep
bulk uploads on connections of their own (KVClient does), so they stay on this path; a connection
that has served anything else belongs to aiohttp, which serves batch_put as well (slower).

Flow control: the head/frame buffer pauses the transport when full (e.g. while a chunk is being
stored), so a fast client never makes the daemon buffer more than the staging memory.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field

from aiohttp import web

log = logging.getLogger(__name__)
HEAD_LIMIT = 16 << 10          # request line + headers; larger heads go to aiohttp (which answers 431)
BUFFER_BYTES = 256 << 10       # head and frame-header buffer per connection
WINDOW = 4096                  # what one recv into that buffer asks for (see get_buffer)


@dataclass
class Head:
    method: str
    target: str
    version: str
    headers: dict[str, str]
    size: int                  # bytes of the head, blank line included


def parse_head(raw: bytes) -> Head | None:
    """The request line and headers (names lowercased); None when malformed or ambiguous, so
    that aiohttp, which answers such requests properly, gets them."""
    try:
        text = raw.decode("latin-1")
    except UnicodeDecodeError:
        return None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            break
        name, sep, value = line.partition(":")
        name = name.strip().lower()
        if not sep or not name or name != name.strip() or name in headers and name in ("content-length", "host"):
            return None
        headers[name] = value.strip()
    return Head(parts[0], parts[1], parts[2], headers, len(raw))


class FrontConnection(asyncio.BufferedProtocol):
    """One client connection until it is handed to aiohttp. Reads go either into the small
    buffer (heads, frame headers) or, while `read_into` waits, straight into its target."""

    def __init__(self, front: "Front"):
        self.front = front
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray(BUFFER_BYTES)
        self._start = self._end = 0
        self._window = WINDOW
        self._target: memoryview | None = None
        self._tpos = 0
        self._wake: asyncio.Future | None = None
        self._eof = self._lost = self._paused = self._handed = False
        self.busy = False       # inside a request (shutdown waits for it)
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------ transport callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.front.connections.add(self)
        self._task = asyncio.get_running_loop().create_task(self._serve())

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._tpos:]
        if self._end == len(self._buf) and self._start:
            self._compact()
        # A small window: a large recv here would pull the next payload into this buffer and
        # cost a second copy; small ones leave it in the socket for read_into's target.
        return memoryview(self._buf)[self._end: self._end + self._window]

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is not None:
            self._tpos += nbytes
            if self._tpos == len(self._target):
                self._target = None
                self._wakeup()
            return
        self._end += nbytes
        if self._end == len(self._buf) and not self._start:
            self._pause()
        self._wakeup()

    def eof_received(self) -> bool:
        self._eof = True
        self._wakeup()
        return True             # keep the transport: a reply may still be due

    def connection_lost(self, exc) -> None:
        self._lost = True
        self.front.connections.discard(self)
        self._wakeup()

    # ------------------------------------------------------------ reading
    async def read_exactly(self, n: int) -> bytes:
        while self._end - self._start < n:
            if n > len(self._buf) - self._start:
                self._compact()
                if n > len(self._buf):
                    self._buf.extend(bytes(n - len(self._buf)))
            await self._more(n)
        out = bytes(self._buf[self._start: self._start + n])
        self._consume(n)
        return out

    async def read_into(self, dst: memoryview) -> None:
        """Fill dst: first from what is buffered, then the kernel writes straight into it."""
        n = len(dst)
        have = min(n, self._end - self._start)
        if have:
            dst[:have] = self._buf[self._start: self._start + have]
            self._consume(have)
        if have < n:
            self._target, self._tpos = dst, have
            self._resume()
            while self._target is not None:
                await self._more(n)

    async def read_head(self) -> bytes | None:
        """The next request head, peeked (not consumed); None when the client closed or idled out."""
        timer = asyncio.get_running_loop().call_later(self.front.keepalive_s, self._idle_out)
        try:
            while True:
                at = self._buf.find(b"\r\n\r\n", self._start, self._end)
                if at >= 0:
                    return bytes(self._buf[self._start: at + 4])
                if self._end - self._start > HEAD_LIMIT:
                    return b""          # too large: aiohttp answers it
                if self._eof or self._lost:
                    return None
                await self._more(0, timeout=None)
        except asyncio.IncompleteReadError:
            return None
        finally:
            timer.cancel()

    def buffered(self) -> memoryview:
        """What has been received and not read yet (valid until the next read)."""
        return memoryview(self._buf)[self._start: self._end]

    def consume(self, n: int) -> None:
        self._consume(n)

    def _consume(self, n: int) -> None:
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
        self._resume()

    def _compact(self) -> None:
        rest = self._end - self._start
        self._buf[:rest] = self._buf[self._start: self._end]
        self._start, self._end = 0, rest

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
        if self._paused and not self._lost:
            self._paused = False
            self.transport.resume_reading()

    def _idle_out(self) -> None:
        if not self.busy and self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------ writing
    def respond(self, status: int, reason: str, body: bytes, close: bool) -> None:
        if self._lost:
            return
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json; charset=utf-8\r\n"
                f"Content-Length: {len(body)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n")
        self.transport.write(head.encode() + body)

    # ------------------------------------------------------------ the request loop
    async def _serve(self) -> None:
        from kvcache.cli.bulk_put import serve_bulk_put, wants
        try:
            while not self.front.closing:
                raw = await self.read_head()
                if raw is None:
                    break
                head = parse_head(raw) if raw else None
                if head is None or not wants(head):
                    self._hand_over()
                    return
                self.busy = True
                self._consume(head.size)
                keep = await serve_bulk_put(self, head, self.front.app)
                self.busy = False
                if not keep:
                    break
        except Exception:
            log.exception("bulk connection failed")
        finally:
            self.busy = False
            if not self._handed and self.transport is not None:
                self.transport.close()

    def _hand_over(self) -> None:
        """aiohttp takes the connection for good, with every byte read so far."""
        if self._lost:
            return
        self._handed = True
        self.front.connections.discard(self)
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
    """What every FrontConnection of one daemon shares."""
    app: web.Application
    aiohttp_factory: object
    keepalive_s: float = 75.0
    read_timeout_s: float = 60.0
    closing: bool = False
    connections: set = field(default_factory=set)

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


class FrontSite(web.BaseSite):
    """A TCP or unix listening socket whose connections start as FrontConnections."""
    __slots__ = ("_front", "_host", "_port", "_path")

    def __init__(self, runner: web.AppRunner, front: Front, *, host: str = "", port: int = 0, path: str = ""):
        super().__init__(runner)
        self._front, self._host, self._port, self._path = front, host, port, path

    @property
    def name(self) -> str:
        return f"http://unix:{self._path}:" if self._path else f"http://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        """The bound port (the one asked for, or the kernel's pick for 0)."""
        return self._server.sockets[0].getsockname()[1] if self._server and not self._path else self._port

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        factory = lambda: FrontConnection(self._front)  # noqa: E731
        if self._path:
            self._server = await loop.create_unix_server(factory, self._path)
        else:
            self._server = await loop.create_server(factory, self._host, self._port, reuse_address=True)


def run(app: web.Application, host: str, port: int, unix_socket: str, shutdown_timeout_s: float) -> None:
    """Serve until SIGTERM/SIGINT, then drain: bulk requests finish, aiohttp's requests finish
    (up to the timeout), the app's cleanup hooks run (flush and close the store)."""
    async def main() -> None:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout_s)
        await runner.setup()
        front = Front(app, runner.server)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            sites = [FrontSite(runner, front, **kw) for kw in
                     [{"host": host, "port": port}] + ([{"path": unix_socket}] if unix_socket else [])]
            for site in sites:
                await site.start()
            await stop.wait()
            for site in sites:          # no new connections while draining
                await site.stop()
            await front.drain(shutdown_timeout_s)
        finally:
            await runner.cleanup()
    asyncio.run(main())
