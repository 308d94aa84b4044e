"""Blocking HTTP/1.1 for the bulk calls of the blocking client (client/sync_client.py).

Why not the async client's aiohttp session for these: a call through the event-loop thread
pays two thread hand-offs, and when the socket is full aiohttp copies the unsent rest of each
piece into its transport buffer; a download lands in aiohttp's chunks and is copied again.
Here the calling thread moves the bytes itself:

    upload:    sendmsg(request head, frame heads, payload views ...) ──> socket   no user-space copy
    download:  socket ──> readinto(the caller's buffer)                           large reads skip buffering

Connections are the standard library's http.client ones (TCP_NODELAY on), kept alive in a
small pool per client. Retries follow the async client's contract (client/async_client.py): 502/503/
504, connection errors and timeouts, with exponential backoff, for the idempotent calls that use
this path (batch_put, batch_get); a pooled connection the daemon closed while idle is retried once
at no cost. A 4xx is final. When the daemon stops reading an upload part-way (an error it answered
before the body ended), the send fails; the reply it sent is read then, and reported, rather than
the body re-sent.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
import urllib.parse
from typing import Any, Callable, Sequence

from kvcache.client.common import RETRY_STATUS, DaemonError, DaemonUnreachableError, error_from

IOV_BATCH = 512     # buffers per sendmsg (Linux allows 1024)
_TRANSPORT_ERRORS = (OSError, http.client.HTTPException)


class _UnixConnection(http.client.HTTPConnection):
    """http.client over a unix socket (the daemon's --unix-socket)."""

    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def send_pieces(sock: socket.socket, pieces: Sequence) -> None:
    """sendall for a list of buffers, IOV_BATCH at a time with sendmsg (partial sends resumed)."""
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i: i + IOV_BATCH])
        while sent:
            n = views[i].nbytes
            if sent >= n:
                sent, i = sent - n, i + 1
            else:
                views[i], sent = views[i][sent:], 0


def read_exact(resp: http.client.HTTPResponse, n: int) -> bytes:
    data = resp.read(n)
    if len(data) != n:
        raise http.client.IncompleteRead(data, n - len(data))
    return data


SKIP_BYTES = 1 << 20      # the scratch buffer skip() reads through


def skip(resp: http.client.HTTPResponse, n: int) -> None:
    """Read and drop `n` bytes (a padded miss's zeros), through a bounded scratch buffer."""
    if n:
        scratch = memoryview(bytearray(min(n, SKIP_BYTES)))
        while n:
            step = min(n, scratch.nbytes)
            read_exact_into(resp, scratch[:step])
            n -= step


def read_exact_into(resp: http.client.HTTPResponse, dst: memoryview) -> None:
    pos = 0
    while pos < dst.nbytes:
        got = resp.readinto(dst[pos:])
        if not got:
            raise http.client.IncompleteRead(bytes(pos), dst.nbytes - pos)
        pos += got


class BlockingHTTP:
    """A keep-alive pool of blocking connections to one daemon; thread-safe (a connection per call)."""

    def __init__(self, base_url: str, unix_socket: str | None, headers: dict, *, timeout_s: float,
                 pool_size: int, retries: int, backoff: Callable[[int], float]):
        url = urllib.parse.urlsplit(base_url)
        self._https = url.scheme == "https"
        self._host, self._port = url.hostname or "127.0.0.1", url.port
        self._prefix = url.path.rstrip("/")
        self.unix_socket, self.timeout_s, self.retries = unix_socket, timeout_s, retries
        self._headers, self._backoff, self._pool_size = dict(headers), backoff, pool_size
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False          # connections in use when close() ran are closed on return

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        if self.unix_socket:
            return _UnixConnection(self.unix_socket, self.timeout_s), False
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=self.timeout_s), False

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._pool_size:
                self._idle.append(conn)
                return
        conn.close()

    def request(self, method: str, path: str, pieces: Sequence, headers: dict,
                handle: Callable[[http.client.HTTPResponse], Any]) -> Any:
        """Send `pieces` as the body; `handle(resp)` runs on 2xx and must read the whole body."""
        attempt, free_retry = 0, True
        while True:
            last = attempt >= self.retries
            conn, reused = self._connection()
            try:
                resp = self._exchange(conn, method, path, pieces, headers)
                if resp.status < 300:
                    result = handle(resp)
                    self._finish(conn, resp)
                    return result
                err = error_from(resp.status, resp.reason, method, path, resp.read())
                self._finish(conn, resp)
                if resp.status not in RETRY_STATUS or last:
                    raise err
            except _TRANSPORT_ERRORS as e:
                conn.close()
                if reused and free_retry:     # the daemon closed it while it sat in the pool
                    free_retry = False
                    continue
                if last:
                    raise DaemonUnreachableError(f"{method} {self._prefix}{path} failed after {attempt + 1} "
                                                 f"attempt(s): {type(e).__name__}: {e}") from e
            except BaseException:
                conn.close()                  # a caller's error mid-body: the stream is not reusable
                raise
            time.sleep(self._backoff(attempt))
            attempt += 1

    def _exchange(self, conn, method: str, path: str, pieces: Sequence, headers: dict) -> http.client.HTTPResponse:
        conn.putrequest(method, self._prefix + path, skip_accept_encoding=True)
        for k, v in {**self._headers, **headers}.items():
            conn.putheader(k, v)
        conn.endheaders()
        try:
            if self._https:           # TLS sockets have no sendmsg
                for p in pieces:
                    conn.send(p)
            else:
                send_pieces(conn.sock, pieces)
        except OSError as e:          # reset or closed mid-body: the daemon may have answered first
            return self._answer_after(conn, e)
        return conn.getresponse()

    @staticmethod
    def _answer_after(conn, send_error: OSError) -> http.client.HTTPResponse:
        """The reply the daemon sent before it stopped reading the body (a 413 for a block over
        its limit, a 401): an error reply is final, and re-sending the body would only meet it
        again. No reply: the send error, for the retry logic."""
        try:
            resp = conn.getresponse()
        except _TRANSPORT_ERRORS:
            raise send_error from None
        if resp.status < 300:
            raise send_error          # a success cannot come before the whole body was read
        resp.will_close = True
        return resp

    def _finish(self, conn, resp: http.client.HTTPResponse) -> None:
        if resp.read(1):              # the handler left bytes behind: never reuse such a stream
            conn.close()
            raise DaemonError("the daemon sent more than the reply's frames")
        if resp.will_close:
            conn.close()
        else:
            self._give_back(conn)

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for conn in idle:
            conn.close()
