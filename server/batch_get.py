"""Block reads' responses (batch_get streams, GET /v1/blocks/{key}): bounded memory for a bounded
time, however slowly the client reads.

    keys ─> group (at most 32 blocks and GROUP_BYTES, or one larger block)
        ─> GetBudget.take(its buffer's bytes)   daemon-wide: server.max_batch_get_bytes
        ─> read_group(one buffer)               group_read.py; ReadBuffers: reused
           or, blocks of ZERO_COPY_BYTES and up: lease_group (views of their leased DRAM chunks)
        ─> write the frames, WRITE_SLICE at a time, and drain the socket to empty,
           all within server.request_timeout_s
        ─> ReadBuffers.give / release_dram,     nothing refers to the buffer (the chunks) any more
           GetBudget.give

A leased group's bytes are charged to the budget like a buffer's (a group whose blocks grew
after sizing is read through a buffer instead): they are arena a slow client keeps from
eviction, so reads hold at most 1/LEASE_SHARE of DRAM leased and copy past that. If the
stream fails while the transport may still hold views of the chunks, the connection is aborted
(its unsent bytes dropped) before the lease is released, so a chunk reused for another block is
never sent.

A client that never reads cannot hold more than two groups per connection (the one being
written and the next, read ahead while it is), each no longer than the deadline (so a group
read ahead, about twice it): past it the connection is aborted, which drops the transport's
unsent bytes too. The
transport's write limit is 0 (set once per connection): each write waits until the kernel took
everything before it, so the transport holds at most the rest of one slice, whether it copied
it (Python 3.11) or keeps a view of the buffer (3.12+), and a group's buffer is given back only
after its last byte left. When the budget has no room for the first group the answer is 503
(Retry-After: 1) before the stream starts; for a later group the stream waits for room within
the same deadline.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import traceback
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

from aiohttp import web

from kvcache.server.group_read import Group, group_bytes, lease_group, read_group, release
from kvcache.server.metrics import Metrics
from kvcache.server.read_buffers import KEEP_BYTES, ReadBuffers, size_for
from kvcache.kvstore import wire
from kvcache.kvstore.errors import StoreError
from kvcache.kvstore.store import BlockStore

GROUP_BYTES = 8 << 20      # a group reads at most this much (or one block) per store call
GROUP_BLOCKS = 32
WRITE_SLICE = 256 << 10    # the most the transport holds per connection
ZERO_COPY_BYTES = 256 << 10  # groups of blocks at least this large are sent from their DRAM chunks
LEASE_SHARE = 4            # reads hold at most 1/LEASE_SHARE of DRAM leased; past it they copy
FIRST_WAIT_S = 1.0         # how long the first group waits for room before the 503
DRAIN_POLL_S = 0.001


class BatchGetBusy(StoreError):
    """batch_get groups in flight hold server.max_batch_get_bytes (HTTP 503: retry)."""


class ClientTooSlow(ConnectionResetError):
    """The client did not take a group within server.request_timeout_s; its connection is aborted."""


class GetBudget:
    """Bytes held by block reads' response buffers, daemon-wide. Runs on the event loop only.

    A stream that has started (its later groups) goes before one that has not (its first group
    or a single GET): streams that began are never cut short because new ones keep taking the
    room; a new one that finds none within FIRST_WAIT_S is a 503 it can retry."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self.leased = 0                   # of held: groups sent from leased DRAM chunks (LEASE_SHARE)
        self.buffers = ReadBuffers(min(KEEP_BYTES, limit))     # what the bytes held are read into
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._started_waiting = 0         # later groups waiting: first groups let them go first

    async def take(self, n: int, wait_s: float, first: bool = False) -> int:
        """Reserve `n` bytes (a group larger than the whole budget takes all of it), waiting up
        to `wait_s` for room; TimeoutError past it. Answers what was reserved, for give()."""
        n = min(n, self.limit)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(wait_s):
            while self.held + n > self.limit or (first and self._started_waiting):
                waiter = loop.create_future()
                self._waiters.append(waiter)
                self._started_waiting += not first
                try:
                    await waiter
                finally:
                    self._started_waiting -= not first
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)
                    if not first and not self._started_waiting:
                        self._wake()          # first groups held back for it look again
        self.held += n
        return n

    def give(self, n: int) -> None:
        self.held -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters:          # each waiter checks again whether its group fits
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)


@dataclass(frozen=True, slots=True)
class GetStream:
    """What one batch_get stream works with."""
    store: BlockStore
    call: Callable[..., Awaitable]         # runs a blocking store call in the store's thread pool
    metrics: Metrics
    budget: GetBudget
    deadline_s: float                      # server.request_timeout_s, per group
    client: str = ""                       # the client's metrics label (server/metrics.py: client_label)


async def stream_blocks(request: web.Request, s: GetStream, keys: Sequence[bytes],
                        sent: Sequence[bytes], sized: bool = False) -> web.StreamResponse:
    """The KVB1 stream of `keys` (stored keys), framed with `sent` (the client's keys). `sized`:
    every key is sized before the first group and the response has a Content-Length (a reader
    then needs no chunked decoding, and aiohttp writes each slice as it is, where a chunked
    write joins it with its chunk line, a copy, on Python before 3.12.9); a block that changes
    after sizing is a padded miss (kvstore/wire.py)."""
    resp = web.StreamResponse(headers={"Content-Type": "application/x-kvcache-batch"})
    try:
        await _stream(request, s, resp, keys, sent, sized)
    except Exception:
        if resp.prepared:      # no answer can follow a started stream (it would land inside it): cut it short
            _abort(request)
        raise
    return resp


async def _stream(request: web.Request, s: GetStream, resp: web.StreamResponse, keys, sent, sized: bool) -> None:
    """Each group is read while the one before it is written (two groups per stream at most):

        store thread:  read 0 ─ read 1 ──────── read 2 ──────── ...
        event loop:            write 0 ──────── write 1 ──────── ...
    """
    _write_limit_zero(request)
    t0, tiers = time.perf_counter(), set()
    every = await s.call(s.store.sizes_tiered, keys) if sized else None
    if sized:
        resp.content_length = wire.STREAM_HEADER_BYTES + group_bytes(every, sent)
    i, written, ahead = 0, 0, _ahead(request, s, keys, sent, every, 0, sized)
    try:
        while ahead is not None:
            ready, ahead = await ahead, None
            i += ready.n
            if i < len(keys):
                ahead = _ahead(request, s, keys, sent, every, i, sized)
            written += await _send(request, s, resp, ready, len(keys), tiers)
    finally:
        if ahead is not None:          # the stream failed: stop the read ahead, give back what it holds
            ahead.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await _release(s, await ahead, drained=True)   # never written: nothing refers to it
    if not resp.prepared:              # no keys
        await resp.prepare(request)
        await resp.write(wire.stream_header(0))
        written += wire.STREAM_HEADER_BYTES
    if sized and written != resp.content_length:     # a bug: the client would wait for bytes never sent
        _abort(request)
        raise RuntimeError(f"a sized batch_get wrote {written} bytes of its Content-Length {resp.content_length}")
    await resp.write_eof()
    s.metrics.observe_read(s.client, tiers, time.perf_counter() - t0)


@dataclass(slots=True)
class _Ready:
    """A group read and not yet sent: its keys' count, its budget bytes, its frames."""
    n: int
    held: int
    group: Group
    leased: int = 0            # of held, counted in GetBudget.leased


def _ahead(request, s: GetStream, keys, sent, every, i: int, sized: bool) -> asyncio.Future | None:
    return asyncio.ensure_future(_prepare(request, s, keys, sent, every, i, sized)) if i < len(keys) else None


async def _prepare(request, s: GetStream, keys, sent, every, i: int, sized: bool) -> _Ready:
    """The group starting at key i: sized (unless the stream was), its room taken, read."""
    sizes = every[i: i + GROUP_BLOCKS] if every is not None else await s.call(s.store.sizes_tiered,
                                                                             keys[i: i + GROUP_BLOCKS])
    n = _group(sizes)
    held = await _take(request, s, size_for(group_bytes(sizes[:n], sent[i: i + n])), first=i == 0)
    leased = held if _zero_copy(s, sizes[:n], held) else 0
    s.budget.leased += leased
    try:
        args = (s.store, keys[i: i + n], sizes[:n], sent[i: i + n], sized)
        group = await lease_group(s.call, *args) if leased else None
        if group is None:
            s.budget.leased -= leased
            leased, group = 0, await read_group(s.call, args[0], s.budget.buffers, *args[1:])
    except BaseException:
        s.budget.leased -= leased
        s.budget.give(held)
        raise
    return _Ready(n, held, group, leased)


async def _send(request, s: GetStream, resp: web.StreamResponse, ready: _Ready, count: int, tiers: set) -> int:
    """Write a group and drain the socket to empty; then give back what it held. The bytes written."""
    g, nbytes = ready.group, 0
    try:
        s.metrics.count_gets(g.frames, s.client)
        tiers.update(t for _, t in g.frames)
        if not resp.prepared:
            await resp.prepare(request)
            await resp.write(wire.stream_header(count))
            nbytes = wire.STREAM_HEADER_BYTES
        await _write_parts(request, resp, s.deadline_s, g.parts, "a batch_get group")
        nbytes += sum(memoryview(p).nbytes for p in g.parts)
    except BaseException as e:
        if g.lease is not None:
            _abort(request)      # the transport may still hold views of the chunks: drop them first
            traceback.clear_frames(e.__traceback__)      # frames the error passed keep views (not sent)
        await _release(s, ready, drained=False)
        raise
    await _release(s, ready, drained=True)
    return nbytes


async def _release(s: GetStream, ready: _Ready, drained: bool) -> None:
    """Give back a group's buffer (pooled again only if `drained`: nothing refers to it) or its
    lease, then its budget bytes."""
    g = ready.group
    try:
        if g.lease is not None:
            g.parts.clear()
            g.frames.clear()
            await release(s.call, s.store, g.lease)
        elif g.raw is not None:
            s.budget.buffers.give(g.raw, drained)
    finally:
        s.budget.leased -= ready.leased
        s.budget.give(ready.held)


def _zero_copy(s: GetStream, sizes, charge: int) -> bool:
    """Whether a group goes out from leased DRAM chunks (lease_group): every block in it is at
    least ZERO_COPY_BYTES, where a copy into a buffer costs more than a head's own write, and
    reads would not hold more than 1/LEASE_SHARE of DRAM leased (slow clients would keep that
    much from eviction, and other tenants' puts out of DRAM)."""
    if s.store.dram is None or not any(sizes):
        return False
    room = s.store.config.dram.capacity_bytes // LEASE_SHARE
    return all(size is None or size[0] >= ZERO_COPY_BYTES for size in sizes) and s.budget.leased + charge <= room


def _group(sizes) -> int:
    """How many of `sizes` the next group takes."""
    n, nbytes = 0, 0
    while n < len(sizes) and (n == 0 or nbytes + (sizes[n] or (0,))[0] <= GROUP_BYTES):
        nbytes, n = nbytes + (sizes[n] or (0,))[0], n + 1
    return n


async def _take(request: web.Request, s: GetStream, nbytes: int, first: bool) -> int:
    try:
        return await s.budget.take(nbytes, FIRST_WAIT_S if first else s.deadline_s, first)
    except TimeoutError:
        if first:
            raise BatchGetBusy(f"batch_get streams hold {s.budget.held} bytes (server.max_batch_get_bytes = "
                               f"{s.budget.limit}); retry shortly") from None
        _abort(request)                    # the stream has started: no answer can follow
        raise ClientTooSlow("no room for the next batch_get group within server.request_timeout_s") from None


async def _write_parts(request: web.Request, resp: web.StreamResponse, deadline_s: float, parts, what: str) -> None:
    """Write `parts` and drain the socket to empty, or abort the connection past `deadline_s`."""
    try:
        async with asyncio.timeout(deadline_s):
            for part in parts:
                view = memoryview(part)
                for at in range(0, len(view), WRITE_SLICE):
                    await resp.write(view[at: at + WRITE_SLICE])    # a slice > 64 KiB drains
            await _drained(request)
    except TimeoutError:
        _abort(request)
        raise ClientTooSlow(f"the client did not read {what} within server.request_timeout_s") from None
    t = request.transport
    if t is None or t.is_closing():      # gone meanwhile (_drained stops there): not all written
        raise ConnectionResetError(f"the client went away while {what} was written")


async def _drained(request: web.Request) -> None:
    """Until the transport's buffer is empty: aiohttp drains after a write of more than 64 KiB,
    so only a shorter last write can leave bytes here (the client is then slower than we are)."""
    t = request.transport
    while t is not None and not t.is_closing() and t.get_write_buffer_size():
        await asyncio.sleep(DRAIN_POLL_S)


def _write_limit_zero(request: web.Request) -> None:
    """Writes wait until the transport's buffer is empty (see the module's docstring)."""
    if request.transport is not None:
        request.transport.set_write_buffer_limits(high=0)


async def send_block(request: web.Request, s: GetStream, key: bytes) -> web.StreamResponse:
    """GET /v1/blocks/{key}: one block (up to max_block_bytes) under the same budget, slices and
    deadline as a batch_get group, so clients that never read hold no more than batch_get's."""
    _write_limit_zero(request)
    [size] = await s.call(s.store.sizes_tiered, [key])
    held = await _take(request, s, size_for(size[0]), first=True) if size is not None else 0
    try:
        group = await read_group(s.call, s.store, s.budget.buffers, [key], [size]) if size is not None else None
        [(payload, tier)] = group.frames if group is not None else [(None, None)]
        s.metrics.count_gets([(payload, tier)], s.client)
        if payload is None:
            raise web.HTTPNotFound(text="no such block")
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream", "X-KVCache-Tier": tier.label})
        resp.content_length = len(payload)
        await resp.prepare(request)
        await _write_parts(request, resp, s.deadline_s, [payload], "a block")
        await resp.write_eof()
        s.budget.buffers.give(group.raw, True)
        return resp
    finally:
        s.budget.give(held)


def _abort(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()      # drops the unsent bytes now, not when the peer goes
