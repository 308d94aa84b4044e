"""The native batch_put: a KVB1 upload received by a thread of its own on a FrontConnection
(server/front/connection.py) that lends it the socket.

Same contract as the aiohttp handler (docs/api.md: auth, tenant keys, quota per chunk, limits,
the same JSON reply and errors) and the same chunking (server/put_batch.py); what differs is who
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

Admission happens on the event loop, before a thread is lent (`admit`): a request without a
known token gets its 401 there and the connection closes unread, so strangers' bytes never
reach an upload thread; an upload that finds no thread free (all UPLOAD_THREADS in use, or,
with tokens, its tenant holding server.max_uploads_per_tenant) is served by aiohttp, never
queued for a thread. An upload must end within server.request_timeout_s (408 after),
and its payload memory grows with the bytes that arrive, counted as pending against the
tenant's quota and the daemon-wide server.max_pending_upload_bytes before it is reserved
(server/quota.py).

An error reply keeps the connection when the rest of the body can be skipped (Content-Length
says how much, up to DRAIN_LIMIT); past that, and after a 408, the reply goes out with
Connection: close, the write side is shut and the body is read and dropped for up to LINGER_S, so that the client
reads the answer rather than a reset. A truncated body or a lost client closes it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from kvcache.server.front.bulk_body import CHUNK_BYTES, Body, RequestDeadline, StagingPool  # noqa: F401
from kvcache.server.front.connection import HEAD_LIMIT, REFUSED, FrontConnection, UploadPath
from kvcache.server.front.head import NOT_PLAIN, WINDOW, Head, head_end, parse_head, reply_head
from kvcache.server.metrics import CLIENT_HEADER, client_label
from kvcache.server.put_batch import ingest_puts_blocking
from kvcache.server.quota import PendingBytes
from kvcache.server.request_state import (CONFIG, METRICS, METRICS_FORBIDDEN, QUOTAS, STORE, UNAUTHORIZED,
                                          Principal, authenticate, identify)
from kvcache.server.errors import error_for
from kvcache.kvstore.errors import BlockFormatError

log = logging.getLogger(__name__)
BULK_PATH = "/v1/blocks/batch_put"
UPLOAD_THREADS = 32           # uploads received at once; one that finds no thread free goes to aiohttp
HOLD_S = 0.25                 # an upload thread waits this long for the connection's next upload
MAX_LENGTH_DIGITS = 18        # a Content-Length longer than this is refused (int() takes 4300 digits)


def _is_count(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes "²" and other digits int() refuses."""
    return text.isascii() and text.isdigit()


def wants(head: Head) -> bool:
    """Requests this path serves; everything else (chunked bodies, Expect, HTTP/1.0) is aiohttp's."""
    h = head.headers
    return (head.method == "POST" and head.target == BULK_PATH and head.version == "HTTP/1.1"
            and "transfer-encoding" not in h and "expect" not in h and _is_count(h.get("content-length", "x")))


def admit(conn: FrontConnection, head: Head):
    """On the event loop, before a thread is lent: the request's Principal, with an upload thread
    counted for it (serve_bulk_put gives it back); None when no thread is free daemon-wide, or its
    tenant holds its share (aiohttp serves it, no thread held); REFUSED when answered here.

    Counting in the same loop turn as the check is what keeps the executor's queue empty: an
    admitted upload always finds a thread, and one that would wait for a thread goes to aiohttp."""
    app, front = conn.front.app, conn.front
    if len(head.headers["content-length"]) > MAX_LENGTH_DIGITS:
        conn.refuse(413, "request_entity_too_large", "Content-Length has "
                    f"{len(head.headers['content-length'])} digits; a batch_put body is far smaller")
        return REFUSED
    cfg = app[CONFIG]
    who = identify(cfg, head.headers.get("authorization", ""), BULK_PATH)
    if who is None:
        app[METRICS].observe_request(BULK_PATH, UNAUTHORIZED[0], 0.0)
        conn.refuse(*UNAUTHORIZED)
        return REFUSED
    if who.metrics_only:        # it has no tenant: never near the data
        app[METRICS].observe_request(BULK_PATH, METRICS_FORBIDDEN[0], 0.0)
        conn.refuse(*METRICS_FORBIDDEN)
        return REFUSED
    if sum(front.uploads.values()) >= UPLOAD_THREADS:
        return None
    if cfg.auth_required and front.uploads[who.tenant] >= front.max_uploads_per_tenant:
        return None             # without tokens there is one tenant: the share would only slow it
    front.uploads[who.tenant] += 1
    return who


STAGING = web.AppKey("staging", StagingPool)
UPLOADS = web.AppKey("upload_threads", ThreadPoolExecutor)


def _respond(sock: socket.socket, status: int, body: bytes, close: bool) -> None:
    retry = b"Retry-After: 1\r\n" if status == 503 else b""
    head = reply_head(status, len(body), close)
    sock.sendall(head[:-2] + retry + b"\r\n" + body)


def serve_blocking(app: web.Application, sock: socket.socket, head: Head, early: bytes,
                   who: Principal) -> tuple[bool, bytes]:
    """Serve one batch_put on the lent socket: (keep the connection?, bytes read past the body)."""
    t0 = time.perf_counter()
    cfg, store, pool = app[CONFIG], app[STORE], app[STAGING]
    pending = PendingBytes(app[QUOTAS], store, who, cfg.max_pending_upload_bytes)
    body = Body(sock, int(head.headers["content-length"]), early, store, pending,
                time.monotonic() + cfg.request_timeout_s)
    keep = head.headers.get("connection", "").lower() != "close"
    body.pool = pool
    try:
        reply = ingest_puts_blocking(app, who, body.read, body.next_frame, body.next_chunk, CHUNK_BYTES, pending,
                                     client_label(head.headers.get(CLIENT_HEADER.lower())))
        if body.remaining:
            raise BlockFormatError(f"{body.remaining} bytes follow the last frame of the batch")
        status = 200
    except RequestDeadline as e:
        status, reply, keep = 408, {"error": "request_timeout", "message": str(e)}, False
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
        pending.release()           # received but never stored (an error)
        if body.landed:             # read but never handed to the store (an error): free their chunks
            store.release_payloads(body.landed)
    if status != 200 and body.remaining and status != 408:
        keep = keep and body.skip_rest()
    app[METRICS].observe_request(BULK_PATH, status, time.perf_counter() - t0)
    _respond(sock, status, json.dumps(reply).encode(), close=not keep)
    if not keep and body.remaining:     # a 408 too: a reset must not eat the answer
        sock.shutdown(socket.SHUT_WR)
        body.linger()
    return keep, body.leftover() if keep else b""


def serve_lent(app: web.Application, sock: socket.socket, head: Head, early: bytes, who: Principal,
               closing) -> tuple[bool, bytes]:
    """Serve batch_puts on the lent connection while they keep coming (a client streaming uploads
    never goes back through the loop) as the same Principal; (keep the connection?, bytes read
    past the last one). Each next head is authenticated again: one whose token now stands for
    another Principal (a reconfigure changed its tenant or quota, or revoked it) goes back to the
    loop's admission, as does one with another token."""
    def same_principal(h: Head) -> bool:
        return authenticate(app[CONFIG], h.headers.get("authorization", ""), BULK_PATH) == who
    read_timeout = sock.gettimeout()
    while True:
        sock.settimeout(read_timeout)       # a request near its deadline shortened it
        keep, rest = serve_blocking(app, sock, head, early, who)
        if not keep or closing():
            return keep, rest
        head, early, keep = _next_head(sock, rest, same_principal)
        if head is None:
            return keep, early


def _next_head(sock: socket.socket, buf: bytes, accept) -> tuple[Head | None, bytes, bool]:
    """The next request, if it is a batch_put that `accept`s and arrives within HOLD_S: (head,
    bytes after it, True); else (None, the bytes read, whether the connection is still open) for
    the loop (which admits it as any other)."""
    timeout = sock.gettimeout()
    sock.settimeout(HOLD_S)
    try:
        while True:
            end = head_end(buf)
            if end == NOT_PLAIN:
                return None, buf, True
            if end > 0:
                head = parse_head(buf[:end])
                same = head is not None and wants(head) and accept(head) \
                    and len(head.headers["content-length"]) <= MAX_LENGTH_DIGITS
                return (head, buf[end:], True) if same else (None, buf, True)
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


async def serve_bulk_put(conn: FrontConnection, head: Head, app: web.Application, who: Principal) -> bool:
    """Serve batch_puts on an upload thread (admit counted it for `who`); True when the connection
    can take another request."""
    keep, extra, sock = False, b"", None
    try:
        sock, early = conn.lend()
        keep, extra = await asyncio.get_running_loop().run_in_executor(
            app[UPLOADS], serve_lent, app, sock, head, early, who, lambda: conn.front.closing)
    except (OSError, asyncio.IncompleteReadError) as e:
        log.debug("bulk upload connection dropped: %s", e)
    finally:
        uploads = conn.front.uploads
        uploads[who.tenant] -= 1
        if not uploads[who.tenant]:
            del uploads[who.tenant]
        if sock is not None:
            conn.give_back(sock, extra)
    return keep


UPLOAD = UploadPath(wants, admit, serve_bulk_put)   # what the daemon's front serves natively
