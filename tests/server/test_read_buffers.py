"""Block reads' response buffers: reused once the socket holds none of them, and the frames laid
out in them are exact, whatever the buffer held before (a miss where the last read had a hit, a
block gone between sizing the group and reading it)."""

import os

from kvcache.kvstore import wire
from kvcache.server.read_buffers import ReadBuffers
from kvcache.server.request_state import GET_BUDGET, STORE

from tests.server.test_responses import make_client, put_blocks  # noqa: F401
from tests.server.test_server import ALICE, auth


def test_take_answers_the_smallest_idle_buffer_that_fits():
    pool = ReadBuffers(keep_bytes=10 << 20)
    small, big = pool.take(100_000), pool.take(3 << 20)
    assert len(small) == 1 << 17 and len(big) == 3 << 20      # rounded: the next read of a size fits
    pool.give(big, True)
    pool.give(small, True)
    assert pool.idle_bytes == len(small) + len(big)
    assert pool.take(5000) is small and pool.take(2 << 20) is big and pool.idle_bytes == 0
    assert len(pool.take(5 << 20)) == 5 << 20                  # nothing idle fits: a new one


def test_give_drops_what_is_still_referenced_or_past_the_limit():
    pool = ReadBuffers(keep_bytes=3 << 20)
    a, b = pool.take(2 << 20), pool.take(2 << 20)
    pool.give(a, False)                   # the transport may still hold a view of it
    assert pool.idle_bytes == 0
    pool.give(a, True)
    pool.give(b, True)                    # 4 MiB idle would pass keep_bytes
    assert pool.idle_bytes == 2 << 20 and pool.take(1) is a


async def batch_get(c, keys: list[str]) -> list:
    r = await c.post("/v1/blocks/batch_get", json={"keys": keys}, headers=auth(ALICE))
    assert r.status == 200, await r.text()
    read = r.content.readexactly
    n = await wire.read_stream_header(read, 1000)
    frames = [await wire.read_get_frame(read) for _ in range(n)]
    assert await r.content.read() == b""
    return frames


async def test_a_buffer_used_before_serves_exact_frames_and_misses(make_client):  # noqa: F811
    c = await make_client()
    size = 300_000
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


async def test_a_block_gone_after_sizing_is_a_miss_and_the_rest_arrive_whole(make_client, monkeypatch):  # noqa: F811
    c = await make_client()
    size = 200_000
    keys = await put_blocks(c, 4, size)
    store, real = c.server.app[STORE], c.server.app[STORE].sizes_tiered

    def sizes_then_delete(ks):          # sized as present, deleted before the group is read
        sizes = real(ks)
        store.delete([ks[1]])          # a stored key (tenant-scoped)
        return sizes
    monkeypatch.setattr(store, "sizes_tiered", sizes_then_delete)
    got = await batch_get(c, keys)
    assert [f.key.hex() for f in got] == keys
    assert [f.payload for f in got] == [bytes([0]) * size, None, bytes([2]) * size, bytes([3]) * size]


async def test_a_block_stored_again_smaller_or_larger_is_never_padded_with_older_bytes(make_client,  # noqa: F811
                                                                                        monkeypatch):
    """Sized at n, read back shorter (stored again with fewer bytes): the frame holds what was
    read, not the rest of a reused buffer that held another block's bytes. Grown past its slot
    (get_many_into's ValueError): a miss, and the others still arrive."""
    c = await make_client()
    size = 200_000
    keys = await put_blocks(c, 4, size)
    await batch_get(c, keys)                      # the pool's buffer now holds these blocks' bytes
    store = c.server.app[STORE]
    real_get, real_sizes = store.get_many_into, store.sizes_tiered
    shrunk, grown = {}, set()

    def get_many_into(ks, outs):                  # the store after those blocks were stored again
        if grown & set(ks):
            raise ValueError("output buffer holds 200000 bytes, block has 300000")
        return [shrunk.get(k, n) for k, n in zip(ks, real_get(ks, outs))]

    def sizes_tiered(ks):
        shrunk[ks[1]] = 1000
        grown.add(ks[2])
        return real_sizes(ks)
    monkeypatch.setattr(store, "get_many_into", get_many_into)
    monkeypatch.setattr(store, "sizes_tiered", sizes_tiered)
    got = await batch_get(c, [keys[3], keys[0], keys[1], keys[2]])
    assert [f.payload for f in got] == [bytes([3]) * size, bytes([0]) * 1000, None, bytes([2]) * size]
    monkeypatch.setattr(store, "sizes_tiered", real_sizes)
    monkeypatch.setattr(store, "get_many_into", lambda ks, outs: [n and min(n, 1000) for n in real_get(ks, outs)])
    r = await c.get(f"/v1/blocks/{keys[1]}", headers=auth(ALICE))   # one GET: the same rule
    assert r.status == 200 and await r.read() == bytes([1]) * 1000
