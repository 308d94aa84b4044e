"""Sized batch_get answers (a Content-Length, and padded misses for blocks that changed after
the daemon sized them: kvstore/wire.py), as both clients read them."""

import asyncio
import json

from kvcache.client.async_wire import read_get_frames
from kvcache.client.sync_client import KVClient
from kvcache.kvstore import wire
from kvcache.kvstore.types import Tier

from tests.client.test_blocking_http import OneShotServer

KEYS = [b"k" * 16, b"m" * 16, b"n" * 16]
A, C = bytes(range(256)) * 1000, b"\x07" * 3_000_000            # the padding passes the skip buffer
BODY = b"".join([wire.stream_header(3), wire.get_frame_head(KEYS[0], len(A), Tier.DRAM), A,
                 wire.padded_miss_head(KEYS[1], 2_500_000), bytes(2_500_000),
                 wire.get_frame_head(KEYS[2], len(C), Tier.NVME), C])


def test_batch_get_asks_for_a_sized_answer_and_skips_a_padded_misses_zeros():
    """The blocking client asks for a sized stream; a padded miss (a block that changed after the
    daemon sized it) reads as a miss, its zeros skipped, and the frames after it land whole."""
    keys, a, c = KEYS, A, C
    srv = OneShotServer(200, BODY)
    with KVClient(f"http://127.0.0.1:{srv.port}", shared_memory="off", retries=0) as kv:
        outs = [bytearray(len(a)), bytearray(16), bytearray(len(c))]
        assert kv.get_many_into(keys, outs) == [len(a), None, len(c)]
        assert outs[0] == a and outs[2] == c
    asked = json.loads(srv.requests[0])
    assert asked == {"keys": [k.hex() for k in keys], "sized": True}
    srv.close()


def test_the_async_readers_skip_a_padded_misses_zeros_too():
    async def frames():
        reader = asyncio.StreamReader()
        reader.feed_data(BODY + BODY)
        reader.feed_eof()

        async def take(i, n, content):
            return await content.readexactly(n)
        got = await read_get_frames(reader, KEYS, take)
        read = reader.readexactly
        assert await wire.read_stream_header(read, 3) == 3
        plain = [await wire.read_get_frame(read) for _ in KEYS]
        assert await reader.read() == b""
        return got, [f.payload for f in plain]
    got, plain = asyncio.run(frames())
    assert got == plain == [A, None, C]
