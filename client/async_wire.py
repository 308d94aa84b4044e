"""The asyncio client's side of the HTTP bodies (client/async_client.py): the KVB1 upload it
streams, the batch_get frames and payloads it reads as they arrive, the layout header it sends,
and the error a non-2xx answer maps to (client/common.py's table). The frame formats themselves
are kvstore/wire.py's, shared with the daemon and the blocking client.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable, Sequence

import aiohttp

from kvcache.client.common import DaemonError, error_from, put_pieces
from kvcache.kvstore import wire
from kvcache.kvstore.errors import StoreError
from kvcache.kvstore.types import PutItem, TensorSpec

# take(i, n, content): consumes hit i's n payload bytes from the response stream, returns its result
TakeHit = Callable[[int, int, aiohttp.StreamReader], Awaitable[Any]]


async def error_for(resp: aiohttp.ClientResponse) -> StoreError:
    """The store error a non-2xx answer stands for; its body may be cut off (then the status alone)."""
    try:
        raw = await resp.read()
    except aiohttp.ClientError:
        raw = b""
    return error_from(resp.status, resp.reason or "", resp.method, resp.url.path, raw)


def put_body(items: Sequence[PutItem]) -> tuple[int, Callable[[], Any]]:
    """(Content-Length, factory of a fresh async body) for a KVB1 batch_put stream: a retry needs
    a body of its own, and the pieces are views of the caller's buffers, never copied."""
    pieces = put_pieces(items)
    total = sum(memoryview(p).nbytes for p in pieces)

    async def body():
        for p in pieces:
            yield p
    return total, body


async def read_into(content: aiohttp.StreamReader, dst: memoryview, n: int) -> None:
    """The next n bytes of a response into dst[:n], chunk by chunk as they arrive."""
    pos = 0
    while pos < n:
        chunk = await content.read(n - pos)
        if not chunk:
            raise asyncio.IncompleteReadError(b"", n)
        dst[pos: pos + len(chunk)] = chunk
        pos += len(chunk)


async def read_get_frames(content: aiohttp.StreamReader, keys: Sequence[bytes], take: TakeHit) -> list:
    """One batch_get answer for `keys`, frame by frame in order: each frame must name its key
    (a daemon that answers another block is an error, never a wrong payload); a hit's result is
    what `take` returns, a miss's None."""
    read = content.readexactly
    count = await wire.read_stream_header(read, len(keys))
    if count != len(keys):
        raise DaemonError(f"batch_get answered {count} frames for {len(keys)} keys")
    out: list = []
    for i, key in enumerate(keys):
        fkey, hit, _tier_bits, n = await wire.read_get_frame_header(read)
        if fkey != key:
            raise DaemonError(f"batch_get frame {i} is for key {fkey.hex()}, expected {key.hex()}")
        if not hit:
            await _skip(content, n)       # a padded miss's zeros (none for a plain miss)
        out.append(await take(i, n, content) if hit else None)
    return out


async def _skip(content: aiohttp.StreamReader, n: int) -> None:
    while n:
        chunk = await content.read(min(n, 1 << 20))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", n)
        n -= len(chunk)


def layout_json(layout: Sequence[TensorSpec]) -> str:
    """The X-KVCache-Layout header: [[name, dtype, shape], ...]."""
    return json.dumps([[t.name, t.dtype, list(t.shape)] for t in layout])
