"""Block reads' responses (batch_get streams, GET /v1/blocks/{key}): bounded memory for a bounded
time, however slowly the client reads.

    keys ─> group (at most 32 blocks and GROUP_BYTES, or one larger block)
        ─> GetBudget.take(group bytes)      daemon-wide: server.max_batch_get_bytes
        ─> get_many_into(one buffer)        ReadBuffers: reused, no per-block allocation
        ─> write the frames, WRITE_SLICE at a time, within server.request_timeout_s
        ─> GetBudget.give                   the buffer goes back once the socket holds none of it

A client that never reads cannot hold more than one group per connection, nor longer than the
deadline: past it the connection is aborted, which drops the socket's copy of the unsent bytes
too. Writing in slices keeps that copy (asyncio's transport copies what the kernel did not take)
to one slice per connection instead of a second copy of the group. When the budget has no room
for the first group the answer is 503 (Retry-After: 1) before the stream starts; for a later
group the stream waits for room within the same deadline.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

from aiohttp import web

from kvcache.server.metrics import Metrics
from kvcache.server.read_buffers import ReadBuffers
from kvcache.kvstore import wire
from kvcache.kvstore.errors import StoreError
from kvcache.kvstore.store import BlockStore

GROUP_BYTES = 8 << 20      # a group reads at most this much (or one block) per store call
GROUP_BLOCKS = 128
WRITE_SLICE = 256 << 10    # the most the socket's send buffer copies per connection
FIRST_WAIT_S = 1.0         # how long the first group waits for room before the 503


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
        self.buffers = ReadBuffers()      # what the bytes held are read into
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


async def stream_blocks(request: web.Request, s: GetStream, keys: Sequence[bytes],
                        sent: Sequence[bytes]) -> web.StreamResponse:
    """The KVB1 stream of `keys` (stored keys), framed with `sent` (the client's keys)."""
    resp = web.StreamResponse(headers={"Content-Type": "application/x-kvcache-batch"})
    try:
        await _stream(request, s, resp, keys, sent)
    except Exception:
        if resp.prepared:      # no answer can follow a started stream (it would land inside it): cut it short
            _abort(request)
        raise
    return resp


async def _stream(request: web.Request, s: GetStream, resp: web.StreamResponse, keys, sent) -> None:
    i = 0
    while i < len(keys):
        sizes = await s.call(s.store.sizes_tiered, keys[i: i + GROUP_BLOCKS])
        n, nbytes = _group(sizes)
        held = await _take(request, s, nbytes, first=not resp.prepared)
        try:
            group = await _read_group(s, keys[i: i + n], sizes[:n], nbytes, sent[i: i + n])
            s.metrics.count_gets(group.frames)
            if not resp.prepared:
                await resp.prepare(request)
                await resp.write(wire.stream_header(len(keys)))
            await _write_parts(request, resp, s.deadline_s, group.parts, "a batch_get group")
            _give_buffer(request, s, group.raw)
        finally:
            s.budget.give(held)
        i += n
    if not resp.prepared:              # no keys
        await resp.prepare(request)
        await resp.write(wire.stream_header(0))
    await resp.write_eof()


def _group(sizes) -> tuple[int, int]:
    """How many of `sizes` the next group takes, and their bytes."""
    n, nbytes = 0, 0
    while n < len(sizes) and (n == 0 or nbytes + (sizes[n] or (0,))[0] <= GROUP_BYTES):
        nbytes, n = nbytes + (sizes[n] or (0,))[0], n + 1
    return n, nbytes


async def _take(request: web.Request, s: GetStream, nbytes: int, first: bool) -> int:
    try:
        return await s.budget.take(nbytes, FIRST_WAIT_S if first else s.deadline_s, first)
    except TimeoutError:
        if first:
            raise BatchGetBusy(f"batch_get streams hold {s.budget.held} bytes (server.max_batch_get_bytes = "
                               f"{s.budget.limit}); retry shortly") from None
        _abort(request)                    # the stream has started: no answer can follow
        raise ClientTooSlow("no room for the next batch_get group within server.request_timeout_s") from None


@dataclass(slots=True)
class Group:
    """One group read: what each key got, the bytes to send, the buffer they sit in."""
    frames: list            # [(payload view or None, tier)]
    parts: list             # what goes on the wire, in order
    raw: bytearray


async def _read_group(s: GetStream, keys, sizes, nbytes: int, sent=None) -> Group:
    """Read one group into one buffer. With `sent` (the client's keys) the buffer holds the
    group's KVB1 frames back to back, heads written in place around the payloads, so the group
    goes out in WRITE_SLICE writes instead of two per block:

        [head 0][payload 0][head 1 (a miss)][head 2][payload 2] ...   one buffer, parts = [it]

    A block gone between sizes_tiered and the read (deleted, expired) is a miss, and one stored
    again with other bytes since is what get_many_into read (or a miss if it grew past its slot):
    their frames no longer fit that layout, so such a group goes out frame by frame. The buffer
    is reused: a payload is cut to what was read into it, never padded with an earlier read's
    bytes. Without `sent`, parts are the bare payloads (GET /v1/blocks/{key})."""
    heads = [None] * len(sizes) if sent is None else [
        wire.get_frame_head(k, *(size or (None, None))) for k, size in zip(sent, sizes)]
    raw = s.budget.buffers.take(nbytes + sum(len(h) for h in heads if h))
    buf, pos, slots = memoryview(raw), 0, []
    for head, size in zip(heads, sizes):
        if head is not None:
            buf[pos: pos + len(head)] = head
            pos += len(head)
        slots.append(None if size is None else buf[pos: pos + size[0]])
        pos += size[0] if size else 0
    want = [j for j, v in enumerate(slots) if v is not None]
    got = await s.call(_read_into, s.store, [keys[j] for j in want], [slots[j] for j in want])
    changed = [(j, length) for j, length in zip(want, got) if length != sizes[j][0]]
    for j, length in changed:     # a miss, or stored again smaller: never the buffer's older bytes
        slots[j] = None if length is None else slots[j][:length]
    frames = [(slots[j], sizes[j][1] if slots[j] is not None else None) for j in range(len(sizes))]
    if sent is None:
        parts = [p for p, _ in frames if p is not None]
    elif changed:
        parts = [part for k, (payload, tier) in zip(sent, frames) for part in wire.encode_get_frame(k, payload, tier)]
    else:
        parts = [buf[:pos]]
    return Group(frames, parts, raw)


def _read_into(store: BlockStore, keys: list, slots: list) -> list:
    """store.get_many_into; a block grown past its slot since it was sized (ValueError, which
    fails the whole call) is read alone so that only it is a miss."""
    try:
        return store.get_many_into(keys, slots)
    except ValueError:
        out = []
        for key, slot in zip(keys, slots):
            try:
                out += store.get_many_into([key], [slot])
            except ValueError:
                out.append(None)
        return out


def _give_buffer(request: web.Request, s: GetStream, raw: bytearray) -> None:
    """Back to the pool once written, if the transport kept none of it (it may hold views of
    unsent bytes); a buffer whose group failed midway is dropped instead."""
    t = request.transport
    s.budget.buffers.give(raw, t is not None and not t.is_closing() and t.get_write_buffer_size() == 0)


async def _write_parts(request: web.Request, resp: web.StreamResponse, deadline_s: float, parts, what: str) -> None:
    try:
        async with asyncio.timeout(deadline_s):
            for part in parts:
                view = memoryview(part)
                for at in range(0, len(view), WRITE_SLICE):
                    await resp.write(view[at: at + WRITE_SLICE])
    except TimeoutError:
        _abort(request)
        raise ClientTooSlow(f"the client did not read {what} within server.request_timeout_s") from None


async def send_block(request: web.Request, s: GetStream, key: bytes) -> web.StreamResponse:
    """GET /v1/blocks/{key}: one block (up to max_block_bytes) under the same budget, slices and
    deadline as a batch_get group, so clients that never read hold no more than batch_get's."""
    [size] = await s.call(s.store.sizes_tiered, [key])
    held = await _take(request, s, size[0], first=True) if size is not None else 0
    try:
        group = await _read_group(s, [key], [size], size[0]) if size is not None else None
        [(payload, tier)] = group.frames if group is not None else [(None, None)]
        s.metrics.count_gets([(payload, tier)])
        if payload is None:
            raise web.HTTPNotFound(text="no such block")
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream", "X-KVCache-Tier": tier.label})
        resp.content_length = len(payload)
        await resp.prepare(request)
        await _write_parts(request, resp, s.deadline_s, [payload], "a block")
        await resp.write_eof()
        _give_buffer(request, s, group.raw)
        return resp
    finally:
        s.budget.give(held)


def _abort(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()      # drops the unsent bytes now, not when the peer goes
