"""Block reads' response buffers: reused once the socket holds none of them, and the frames laid
out in them are exact, whatever the buffer held before (a miss where the last read had a hit, a
block gone between sizing the group and reading it)."""

import asyncio
import contextlib
import json
import os

import pytest

from kvcache.kvstore import wire
from kvcache.kvstore.types import PutItem
from kvcache.server.batch_get import ZERO_COPY_BYTES
from kvcache.server import tenancy
from kvcache.server.read_buffers import ReadBuffers, size_for
from kvcache.server.request_state import GET_BUDGET, STORE

from tests.server.test_responses import make_client, put_blocks, raw_post, recv_all, until  # noqa: F401
from tests.server.test_server import ALICE, NS, auth


def test_buffers_come_in_size_classes_and_are_reused_within_one():
    pool = ReadBuffers(keep_bytes=10 << 20)
    assert [size_for(n) for n in (1, 5000, 100_000, 1 << 20, (1 << 20) + 1, 3 << 20)] == [
        4096, 8192, 1 << 17, 1 << 20, 2 << 20, 3 << 20]
    small, big = pool.take(100_000), pool.take(3 << 20)
    assert len(small) == size_for(100_000) and len(big) == 3 << 20   # what the budget charges is held
    pool.give(big, True)
    pool.give(small, True)
    assert pool.idle_bytes == len(small) + len(big)
    assert pool.take(70_000) is small and pool.take((2 << 20) + 5) is big and pool.idle_bytes == 0
    assert len(pool.take(100)) == 4096                             # another class: a new one


def test_give_drops_what_is_still_referenced_or_past_the_limit():
    pool = ReadBuffers(keep_bytes=3 << 20)
    a, b = pool.take(2 << 20), pool.take(2 << 20)
    pool.give(a, False)                   # something may still refer to it
    assert pool.idle_bytes == 0
    pool.give(a, True)
    pool.give(b, True)                    # 4 MiB idle would pass keep_bytes
    assert pool.idle_bytes == 2 << 20 and pool.take(1 << 21) is a


async def batch_get(c, keys: list[str], sized: bool = False) -> list:
    r = await c.post("/v1/blocks/batch_get", json={"keys": keys, "sized": sized}, headers=auth(ALICE))
    assert r.status == 200, await r.text()
    read = r.content.readexactly
    n = await wire.read_stream_header(read, 1000)
    frames = [await wire.read_get_frame(read) for _ in range(n)]
    assert await r.content.read() == b""
    assert (r.content_length is not None) == sized
    return frames


async def sized_body(c, keys: list[str]) -> bytes:
    """A sized batch_get's raw body, checked against its Content-Length."""
    r = await c.post("/v1/blocks/batch_get", json={"keys": keys, "sized": True}, headers=auth(ALICE))
    assert r.status == 200 and "chunked" not in r.headers.get("Transfer-Encoding", "")
    body = await r.read()
    assert len(body) == r.content_length
    return body


def frames_of(body: bytes) -> list[tuple[str, bool, bytes]]:
    """(key hex, hit, the bytes after the head: payload or padding) of each frame of `body`."""
    pos, out = wire.STREAM_HEADER_BYTES, []
    while pos < len(body):
        klen = body[pos]
        key, hit, _, n = wire.parse_get_head(body[pos + 1: pos + 11 + klen])
        pos += 11 + klen
        out.append((key.hex(), hit, body[pos: pos + n]))
        pos += n
    assert pos == len(body)
    return out


@contextlib.contextmanager
def changed_after_sizing(c, gone=(), again: dict | None = None):
    """While in it, each sizes_tiered answers and then, before the group is read, deletes the
    keys at positions `gone` of what it sized and stores `again` ({position: payload}) as alice's."""
    store = c.server.app[STORE]
    real, ns = store.sizes_tiered, tenancy.stored_namespace_id("alice", NS.id.hex())

    def sizes_then_change(ks):
        sizes = real(ks)
        store.delete([ks[j] for j in (*gone, *(again or {}))])
        store.put_many([PutItem(ks[j], payload, ns, tenant="alice") for j, payload in (again or {}).items()])
        return sizes
    store.sizes_tiered = sizes_then_change
    try:
        yield
    finally:
        del store.sizes_tiered


async def test_a_buffer_used_before_serves_exact_frames_and_misses(make_client):  # noqa: F811
    c = await make_client()
    size = 200_000                          # below ZERO_COPY_BYTES: read into a pooled buffer
    keys = await put_blocks(c, 6, size)
    pool = c.server.app[GET_BUDGET].buffers
    first = await batch_get(c, keys)
    assert [f.payload for f in first] == [bytes([i]) * size for i in range(6)]
    assert pool.idle_bytes > 0                                  # the group's buffer went back
    absent = os.urandom(16).hex()
    second = await batch_get(c, [keys[5], absent, keys[0]])     # the same buffer, a miss where a hit was
    assert [f.payload for f in second] == [bytes([5]) * size, None, bytes([0]) * size]
    assert [f.key.hex() for f in second] == [keys[5], absent, keys[0]]
    r = await c.get(f"/v1/blocks/{keys[3]}", headers=auth(ALICE))
    assert r.status == 200 and await r.read() == bytes([3]) * size


async def test_a_block_gone_after_sizing_is_a_miss_and_the_rest_arrive_whole(make_client):  # noqa: F811
    c = await make_client()
    size = 200_000
    keys = await put_blocks(c, 4, size)
    with changed_after_sizing(c, gone=[1]):       # sized as present, deleted before the group is read
        got = await batch_get(c, keys)
    assert [f.key.hex() for f in got] == keys
    assert [f.payload for f in got] == [bytes([0]) * size, None, bytes([2]) * size, bytes([3]) * size]


async def test_a_block_stored_again_smaller_or_larger_is_never_padded_with_older_bytes(make_client):  # noqa: F811
    """Sized, then stored again before the read (a delete and a put in between): a shorter block
    arrives as it now is, not padded with the rest of a reused buffer that held another block's
    bytes; a longer one no longer fits its slot and is a miss; the others arrive whole."""
    c = await make_client()
    size = 200_000
    keys = await put_blocks(c, 4, size)
    await batch_get(c, keys)                      # the pool's buffer now holds these blocks' bytes
    with changed_after_sizing(c, again={1: b"s" * 1000, 2: b"g" * 300_000}):
        got = await batch_get(c, [keys[3], keys[0], keys[1], keys[2]])
    assert [f.payload for f in got] == [bytes([3]) * size, b"s" * 1000, None, bytes([2]) * size]
    assert [f.key.hex() for f in got] == [keys[3], keys[0], keys[1], keys[2]]


async def test_a_sized_stream_has_the_same_frames_and_its_content_length(make_client):  # noqa: F811
    c = await make_client()
    keys = await put_blocks(c, 5, 300_000)
    absent = os.urandom(16).hex()
    asked = [keys[4], absent, *keys[:4]]
    assert await batch_get(c, asked, sized=True) == await batch_get(c, asked)
    frames = frames_of(await sized_body(c, asked))
    assert [(k, hit, len(b)) for k, hit, b in frames] == [(keys[4], True, 300_000), (absent, False, 0),
                                                         *[(k, True, 300_000) for k in keys[:4]]]
    assert await batch_get(c, [], sized=True) == []


def leases_held(c) -> int:
    """Leases on the daemon's DRAM chunks (batch_get groups sent from them hold some)."""
    return sum(e.leases for e in c.server.app[STORE].dram._entries.values())


@pytest.mark.parametrize("size", [200_000, 300_000])      # read into a buffer; sent from leased chunks
async def test_a_sized_stream_pads_blocks_that_changed_after_sizing_with_zeros(make_client, size):  # noqa: F811
    """Sized, then deleted, stored again smaller, and stored again larger before the read: each
    keeps the bytes the Content-Length promised, as a miss followed by zeros (never a reused
    buffer's older bytes, nor part of the new block); the others arrive whole."""
    assert (size >= ZERO_COPY_BYTES) == (size == 300_000)
    c = await make_client()
    keys = await put_blocks(c, 5, size)
    await batch_get(c, keys)                      # the pool's buffer now holds these blocks' bytes
    with changed_after_sizing(c, gone=[1], again={2: b"s" * 1000, 3: b"g" * (size + 100_000)}):
        frames = frames_of(await sized_body(c, keys))
    assert [k for k, _, _ in frames] == keys
    assert [(hit, b) for _, hit, b in frames] == [(True, bytes([0]) * size), (False, bytes(size)),
                                                  (False, bytes(size)), (False, bytes(size)),
                                                  (True, bytes([4]) * size)]
    await until(lambda: leases_held(c) == 0)


async def test_a_sized_stream_that_would_fall_short_of_its_length_is_cut_not_left_hanging(make_client, monkeypatch):  # noqa: F811
    c = await make_client()
    keys = await put_blocks(c, 2, 100_000)
    real = wire.frame_bytes
    monkeypatch.setattr(wire, "frame_bytes", lambda key, n: real(key, n) + 1)     # a Content-Length too long
    s = raw_post(c.server.port, "/v1/blocks/batch_get", json.dumps({"keys": keys, "sized": True}).encode())
    got = await asyncio.get_running_loop().run_in_executor(None, recv_all, s)    # ends: no 10 s timeout
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
    assert len(body) == length - 2                  # every byte written, none promised more: cut short


async def test_sized_must_be_a_boolean(make_client):  # noqa: F811
    c = await make_client()
    r = await c.post("/v1/blocks/batch_get", json={"keys": [], "sized": "yes"}, headers=auth(ALICE))
    assert r.status == 400 and "sized" in await r.text()


def _dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower(), head[:200]
    body = bytearray()
    while True:
        line, _, rest = rest.partition(b"\r\n")
        n = int(line, 16)
        if n == 0:
            return bytes(body)
        body += rest[:n]
        rest = rest[n + 2:]


async def test_a_slow_readers_buffer_is_not_reused_until_its_last_byte_left(make_client):  # noqa: F811
    """A client that reads nothing holds its group's buffer (the transport still has bytes of it):
    it is not pooled, a second request meanwhile gets a buffer of its own, and once the slow
    client reads, its stream is its own blocks, byte for byte."""
    c = await make_client(request_timeout_s=30)
    size = 1 << 20
    slow_keys = await put_blocks(c, 3, size)                      # bytes([0]), [1], [2]
    pool, budget = c.server.app[GET_BUDGET].buffers, c.server.app[GET_BUDGET]
    s = raw_post(c.server.port, "/v1/blocks/batch_get", json.dumps({"keys": slow_keys}).encode(), rcvbuf=4096)
    await until(lambda: budget.held > 0)
    await asyncio.sleep(0.2)
    assert pool.idle_bytes == 0 and budget.held >= size_for(3 * size)     # in flight, not pooled
    fast_keys = [os.urandom(16).hex() for _ in range(3)]
    for i, k in enumerate(fast_keys):
        r = await c.put(f"/v1/blocks/{k}", data=bytes([7 + i]) * size,
                        headers={**auth(ALICE), "X-KVCache-Namespace": NS.id.hex()})
        assert r.status == 200
    got = await batch_get(c, fast_keys)                          # meanwhile: a buffer of its own
    assert [f.payload for f in got] == [bytes([7 + i]) * size for i in range(3)]
    raw = await asyncio.get_running_loop().run_in_executor(None, _read_until_eof_or_idle, s)
    body = _dechunk(raw)
    assert body[:wire.STREAM_HEADER_BYTES] == wire.stream_header(3)
    pos = wire.STREAM_HEADER_BYTES
    for i, key in enumerate(slow_keys):
        klen = body[pos]
        fkey, hit, _, n = wire.parse_get_head(body[pos + 1: pos + 1 + klen + 10])
        pos += 1 + klen + 10
        assert fkey.hex() == key and hit and body[pos: pos + n] == bytes([i]) * size
        pos += n
    assert pos == len(body)
    await until(lambda: budget.held == 0)


def _read_until_eof_or_idle(s) -> bytes:
    """Read a keep-alive response: until the terminating chunk arrived (or 10 s of silence)."""
    s.settimeout(10)
    out = bytearray()
    try:
        while not out.endswith(b"\r\n0\r\n\r\n") and (chunk := s.recv(1 << 16)):
            out += chunk
    finally:
        s.close()
    return bytes(out)
