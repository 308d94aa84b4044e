"""The native batch_put: a KVB1 upload served on a FrontConnection (cli/http_front.py).

Same contract as the aiohttp handler (docs/api.md: auth, tenant keys, quota per chunk,
limits, the same JSON reply and errors) and the same code for everything past the bytes
(`server.ingest_puts`); what differs is where the bytes land:

    socket ──recv_into──> staging buffer (reused) ──store.put_many──> DRAM slab / NVMe
                 one kernel copy                      one copy (the store's own)

An error reply keeps the connection when the rest of the body can be skipped (Content-Length
says how much); a truncated body or a lost client closes it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from http import HTTPStatus

from aiohttp import web

from kvcache.cli.http_front import FrontConnection, Head
from kvcache.cli.server import CONFIG, METRICS, UNAUTHORIZED, authenticate, error_for, ingest_puts
from kvcache.kvstore import wire
from kvcache.kvstore.errors import BlockFormatError

log = logging.getLogger(__name__)
BULK_PATH = "/v1/blocks/batch_put"
CHUNK_BYTES = 16 << 20         # stored per put_many call on this path (one stored while the next arrives)
DRAIN_LIMIT = 64 << 20        # an error reply skips at most this much unread body, else closes


def wants(head: Head) -> bool:
    """Requests this path serves; everything else (chunked bodies, Expect, HTTP/1.0) is aiohttp's."""
    h = head.headers
    return (head.method == "POST" and head.target == BULK_PATH and head.version == "HTTP/1.1"
            and "transfer-encoding" not in h and "expect" not in h and h.get("content-length", "x").isdigit())


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


class Body:
    """The request body as the frame reader sees it: never past Content-Length. Payloads go to
    two staging buffers in turn, one chunk each (the other chunk is being stored meanwhile);
    a chunk holds less than CHUNK_BYTES before its last payload, so a payload of up to
    CHUNK_BYTES always fits, and larger ones get buffers of their own."""

    def __init__(self, conn: FrontConnection, length: int):
        self.conn, self.remaining = conn, length
        self.buffers: list[memoryview | None] = [None, None]
        self.staging, self.pos, self.turn = None, 0, 0

    def _take(self, n: int) -> None:
        if n > self.remaining:
            raise BlockFormatError(f"a frame runs {n - self.remaining} bytes past the Content-Length")
        self.remaining -= n

    async def read(self, n: int) -> bytes:
        self._take(n)
        return await self.conn.read_exactly(n)

    async def next_frame(self, max_payload: int) -> wire.PutFrame:
        """Parsed straight from the connection's buffer when the frame header is there (the
        usual case), else field by field as bytes arrive."""
        view = self.conn.buffered()
        got = wire.parse_put_head(view, max_payload)
        view.release()
        if got is None:
            return await wire.read_put_frame(self.read, max_payload, self.read_payload)
        frame, plen, used = got
        self._take(used)
        self.conn.consume(used)
        return dataclasses.replace(frame, payload=await self.read_payload(plen))

    async def read_payload(self, n: int) -> memoryview:
        self._take(n)
        st = self.staging
        if st is not None and self.pos + n <= len(st):
            dst, self.pos = st[self.pos: self.pos + n], self.pos + n
        else:
            dst = memoryview(bytearray(n))
        await self.conn.read_into(dst)
        return dst

    def next_chunk(self) -> None:
        """The chunk so far went to the store: fill the other buffer (its chunk is stored)."""
        self.turn ^= 1
        self.staging, self.pos = self.buffers[self.turn], 0

    async def skip_rest(self) -> bool:
        if self.remaining > DRAIN_LIMIT:
            return False
        scratch = memoryview(bytearray(min(self.remaining, 1 << 20) or 1))
        try:
            while self.remaining:
                n = min(self.remaining, len(scratch))
                await self.conn.read_into(scratch[:n])
                self.remaining -= n
        except Exception:
            return False
        return True


async def serve_bulk_put(conn: FrontConnection, head: Head, app: web.Application) -> bool:
    """Serve one batch_put; True when the connection can take another request."""
    t0 = time.perf_counter()
    body = Body(conn, int(head.headers["content-length"]))
    keep = head.headers.get("connection", "").lower() != "close"
    who = authenticate(app[CONFIG], head.headers.get("authorization", ""), BULK_PATH)
    if who is None:
        status, reply = UNAUTHORIZED[0], {"error": UNAUTHORIZED[1], "message": UNAUTHORIZED[2]}
    else:
        pool = app[STAGING]
        body.buffers = [pool.acquire(), pool.acquire()]
        body.staging = body.buffers[0]
        try:
            reply = await ingest_puts(app, who, body.read, body.next_frame, body.next_chunk, CHUNK_BYTES)
            if body.remaining:
                raise BlockFormatError(f"{body.remaining} bytes follow the last frame of the batch")
            status = 200
        except Exception as e:
            known = error_for(e)
            if known is None:
                log.exception("unhandled error on POST %s", BULK_PATH)
                known = (500, "internal", "internal error; see the daemon log")
            status, reply = known[0], {"error": known[1], "message": known[2]}
        finally:
            for b in body.buffers:
                pool.release(b)
    if status != 200 and body.remaining:
        keep = keep and await body.skip_rest()
    app[METRICS].observe_request(BULK_PATH, status, time.perf_counter() - t0)
    conn.respond(status, HTTPStatus(status).phrase, json.dumps(reply).encode(), close=not keep)
    return keep
