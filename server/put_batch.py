"""One KVB1 upload (POST /v1/blocks/batch_put) turned into store calls, a chunk at a time.

Two drivers share `PutBatch`: `ingest_puts` (async; aiohttp's handler, any HTTP client) and
`ingest_puts_blocking` (server/front/bulk_put.py's thread, the native path). Receiving and storing overlap:

    receive chunk k+1 ──────────────┐       (the event loop)
    store chunk k (put_many) ───────┤       (a store worker thread)
    wait for chunk k, start k+1 ────┘       at most one chunk in flight; quota held per chunk

(the blocking driver stores each chunk in its own thread, see there).
A payload that lands in no DRAM chunk or staging buffer is received into a `GrowingPayload`
(on aiohttp's path, every payload): its memory grows with the bytes that arrive, counted as pending first.
`next_chunk()` is called when a chunk has been handed to the store: payload buffers of the chunk
before it may be reused from then on. DRAM landings (payloads received straight into reserved
arena chunks) that put_many did not adopt are released by `put_within_quota`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable, Iterator
from typing import Mapping

from aiohttp import web

from kvcache.server.quota import PendingBytes, put_within_quota
from kvcache.server.request_state import CONFIG, METRICS, POOL, QUOTAS, STORE, Principal
from kvcache.server.tenancy import known_namespace_id
from kvcache.kvstore import wire
from kvcache.kvstore.hashing import Namespace, tenant_key
from kvcache.kvstore.types import PutItem
from kvcache.kvstore.types import PutResult

PUT_CHUNK_BYTES = 64 << 20
GROW_FROM = 1 << 20     # a payload's buffer starts this large and doubles as its bytes arrive


class PutBatch:
    """The frames of one upload grouped into chunks for the store, and the reply's totals."""

    def __init__(self, who: Principal, chunk_limit: int, registered: Mapping[bytes, Namespace], client: str = ""):
        self.who, self.chunk_limit, self.registered, self.client = who, chunk_limit, registered, client
        self.items: list[PutItem] = []
        self.nbytes = self.total_bytes = 0
        self.stored = self.present = 0
        self.durable = True

    def add(self, f: wire.PutFrame) -> bool:
        """Queue one frame; True when the chunk is full (flush it)."""
        self.items.append(PutItem(tenant_key(self.who.tenant, f.key), f.payload,
                                  known_namespace_id(self.registered, self.who.tenant, f.namespace_id), f.layout,
                                  self.who.tenant, f.ttl_s))
        self.nbytes += len(f.payload)
        self.total_bytes += len(f.payload)
        return self.nbytes >= self.chunk_limit

    def take(self) -> tuple[list[PutItem], int]:
        items, nbytes = self.items, self.nbytes
        self.items, self.nbytes = [], 0
        return items, nbytes

    def done(self, r: PutResult) -> None:
        self.stored += r.stored
        self.present += r.already_present
        self.durable = self.durable and r.durable

    def reply(self, app: web.Application) -> dict:
        app[METRICS].count_puts(self.stored, self.present, self.client, self.total_bytes)
        return {"stored": self.stored, "already_present": self.present, "durable": self.durable}


@contextlib.contextmanager
def _naming_max_block_bytes() -> Iterator[None]:
    """A frame's 413 names the setting that sets its limit."""
    try:
        yield
    except wire.FrameLimitError as e:
        raise wire.FrameLimitError(f"{e} (the daemon's server.max_block_bytes)") from None


class GrowingPayload:
    """n payload bytes received into memory of their own that grows as they arrive (from
    GROW_FROM, doubling), each growth counted (as pending, server/quota.py) before it is reserved:
    a client that declares a large payload and stalls holds what it sent, not what it declared.
    Both upload paths use it: aiohttp's `write`s the chunks it reads, the native one receives."""

    def __init__(self, n: int, count: Callable[[int], None]):
        self.n, self.count, self.buf, self.pos = n, count, bytearray(0), 0

    @property
    def done(self) -> bool:
        return self.pos >= self.n

    def room(self) -> int:
        """Bytes it takes before it must grow again; grown (counted first) when full."""
        if self.pos == len(self.buf):
            more = min(self.n, max(GROW_FROM, 2 * len(self.buf))) - len(self.buf)
            self.count(more)
            self.buf += bytes(more)
        return len(self.buf) - self.pos

    def write(self, data) -> None:
        data = memoryview(data)
        while data.nbytes:
            k = min(self.room(), data.nbytes)
            self.buf[self.pos: self.pos + k] = data[:k]
            self.pos += k
            data = data[k:]

    def receive(self, recv_into: Callable[[memoryview], int]) -> int:
        """One recv_into its free room; the bytes it got."""
        self.room()
        with memoryview(self.buf) as view:      # released before the buffer grows again
            got = recv_into(view[self.pos:])
        self.pos += got
        return got


async def ingest_puts(app: web.Application, who: Principal, read, next_frame, next_chunk=None,
                      chunk_limit: int = PUT_CHUNK_BYTES, pending: PendingBytes | None = None,
                      client: str = "") -> dict:
    """Store one upload: the stream header is read with `read(n)`, each frame with
    `next_frame(max payload bytes)` (both awaitables). `pending`: the upload's payload bytes
    were counted as pending as they arrived (server/quota.py); each stored chunk stops counting."""
    cfg, store, loop = app[CONFIG], app[STORE], asyncio.get_running_loop()
    count = await wire.read_stream_header(read, cfg.max_batch_blocks)
    batch, storing = PutBatch(who, chunk_limit, store.namespaces, client), None

    async def flush() -> None:
        nonlocal storing
        if storing is not None:
            batch.done(await storing)
            storing = None
        items, _ = batch.take()
        if items:                    # quota held from its check to the end of its put (server/quota.py)
            storing = loop.run_in_executor(app[POOL], put_within_quota, store, app[QUOTAS], who, items, pending)
            if next_chunk is not None:
                next_chunk()
    try:
        for _ in range(count):
            with _naming_max_block_bytes():
                frame = await next_frame(cfg.max_block_bytes)
            if batch.add(frame):
                await flush()
        await flush()
        await flush()
    finally:
        if storing is not None:     # an error while a chunk is being stored: let it finish first
            await asyncio.wait([storing])
    return batch.reply(app)


def ingest_puts_blocking(app: web.Application, who: Principal, read, next_frame, next_chunk=None,
                         chunk_limit: int = PUT_CHUNK_BYTES, pending: PendingBytes | None = None,
                         client: str = "") -> dict:
    """ingest_puts for a receiving thread: `read` and `next_frame` block, and chunks are stored
    right here, not overlapped: with payloads landing in DRAM a put is bookkeeping that costs
    less than waking a worker thread (measured: 0.9x -> 1.0x of redis at 256 KiB on 2 cores;
    durable puts gained nothing from the overlap either)."""
    cfg, store = app[CONFIG], app[STORE]
    count = wire.parse_stream_header(read(wire.STREAM_HEADER_BYTES), cfg.max_batch_blocks)
    batch = PutBatch(who, chunk_limit, store.namespaces, client)

    def flush() -> None:
        items, _ = batch.take()
        if items:
            batch.done(put_within_quota(store, app[QUOTAS], who, items, pending))
            if next_chunk is not None:
                next_chunk()
    for _ in range(count):
        with _naming_max_block_bytes():
            frame = next_frame(cfg.max_block_bytes)
        if batch.add(frame):
            flush()
    flush()
    return batch.reply(app)


async def ingest_request(app: web.Application, who: Principal, content, client: str = "") -> dict:
    """aiohttp's batch_put body (`content`: its StreamReader) stored, within server.request_timeout_s
    (408 after). Each payload's memory grows as its bytes arrive and is counted as pending first
    (server/quota.py): an upload that declares 64 MiB and stalls holds what it sent."""
    cfg = app[CONFIG]
    pending = PendingBytes(app[QUOTAS], app[STORE], who, cfg.max_pending_upload_bytes)

    async def read_payload(n: int) -> bytearray:   # one copy out of the socket's chunks, no join
        payload = GrowingPayload(n, pending.add)
        while not payload.done:
            chunk = await content.read(payload.room())
            if not chunk:
                raise asyncio.IncompleteReadError(b"", n)
            payload.write(chunk)
        return payload.buf
    read = content.readexactly
    try:
        async with asyncio.timeout(cfg.request_timeout_s):
            reply = await ingest_puts(app, who, read, lambda limit: wire.read_put_frame(read, limit, read_payload),
                                      pending=pending, client=client)
            if await content.read(1):   # as the native path (server/front/bulk_put.py): the frames must end the body
                raise wire.BlockFormatError("bytes follow the last frame of the batch")
    except TimeoutError:
        raise web.HTTPRequestTimeout(text="the upload took longer than server.request_timeout_s") from None
    finally:
        pending.release()           # received but never stored (an error)
    return reply
