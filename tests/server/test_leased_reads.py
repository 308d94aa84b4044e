"""batch_get groups of large blocks, sent from their leased DRAM chunks (server/group_read.py
lease_group): the lease ends with the stream however it ends, a group never leases more than the
budget was charged, reads lease at most their share of DRAM, and a failed group's connection is
aborted before its chunks go back."""

import asyncio
import json
import time

import pytest

from kvcache.kvstore.leases import SOCKET
from kvcache.server import batch_get as batch_get_module
from kvcache.server.request_state import GET_BUDGET, STORE

from tests.server.test_read_buffers import batch_get, changed_after_sizing, leases_held
from tests.server.test_responses import make_client, put_blocks, raw_post, recv_all, until  # noqa: F401


async def test_large_blocks_go_out_from_their_leased_chunks_as_they_now_are(make_client):  # noqa: F811
    """Blocks of ZERO_COPY_BYTES and up are sent from their DRAM chunks: one stored again at
    another size after sizing arrives as it now is (its frame says so), and no lease outlives
    the stream."""
    c = await make_client()
    size = 300_000
    keys = await put_blocks(c, 4, size)
    with changed_after_sizing(c, again={1: b"s" * 1000, 2: b"g" * 400_000}):
        got = await batch_get(c, keys)
    assert [f.payload for f in got] == [bytes([0]) * size, b"s" * 1000, b"g" * 400_000, bytes([3]) * size]
    await until(lambda: leases_held(c) == 0)


async def test_a_block_that_cannot_be_placed_in_dram_sends_the_group_through_a_buffer(make_client, monkeypatch):  # noqa: F811
    c = await make_client()
    keys = await put_blocks(c, 3, 300_000)
    store = c.server.app[STORE]
    real = store.lease_views

    def one_on_the_socket(ks):            # as when DRAM is full of pinned blocks
        views, lease = real(ks)
        return [SOCKET, *views[1:]], lease
    monkeypatch.setattr(store, "lease_views", one_on_the_socket)
    got = await batch_get(c, keys, sized=True)
    assert [f.payload for f in got] == [bytes([i]) * 300_000 for i in range(3)]
    await until(lambda: leases_held(c) == 0)


async def test_a_client_gone_mid_stream_leaves_no_lease_behind(make_client):  # noqa: F811
    c = await make_client(request_timeout_s=30)
    keys = await put_blocks(c, 3, 1 << 20)
    budget = c.server.app[GET_BUDGET]
    s = raw_post(c.server.port, "/v1/blocks/batch_get", json.dumps({"keys": keys}).encode(), rcvbuf=4096)
    await until(lambda: leases_held(c) > 0)      # in flight: the chunks being sent are held
    assert budget.leased == budget.held > 0
    s.close()
    await until(lambda: leases_held(c) == 0 and budget.held == 0 and budget.leased == 0)


async def test_blocks_grown_after_sizing_are_read_through_a_buffer_not_leased_past_the_charge(make_client):  # noqa: F811
    """The budget is charged from the sizes: a group whose blocks hold more bytes by the time they
    are leased lets the lease go and is read through its buffer, where a grown block is a miss."""
    c = await make_client()
    keys = await put_blocks(c, 2, 300_000)
    with changed_after_sizing(c, again={1: b"g" * (1 << 20)}):
        got = await batch_get(c, keys)
    assert [f.payload for f in got] == [bytes([0]) * 300_000, None]
    await until(lambda: leases_held(c) == 0)


async def test_reads_lease_at_most_their_share_of_dram_and_copy_past_it(make_client, monkeypatch):  # noqa: F811
    monkeypatch.setattr(batch_get_module, "LEASE_SHARE", 64)      # 1 MiB of the 64 MiB arena
    c = await make_client(request_timeout_s=30)
    keys = await put_blocks(c, 3, 1 << 20)
    budget = c.server.app[GET_BUDGET]
    s = raw_post(c.server.port, "/v1/blocks/batch_get", json.dumps({"keys": keys}).encode(), rcvbuf=4096)
    await until(lambda: budget.held > 0)
    await asyncio.sleep(0.2)
    assert leases_held(c) == 0 and budget.leased == 0            # a 3 MiB group would pass it: copied
    s.close()
    await until(lambda: budget.held == 0)


async def test_a_leased_group_that_fails_mid_write_aborts_its_connection_before_the_lease_ends(
        make_client, monkeypatch):  # noqa: F811
    """From Python 3.12 the transport keeps views of what it has not sent: a failed group's chunks
    must not go back to the arena while its connection could still send from them."""
    c = await make_client()
    keys = await put_blocks(c, 2, 300_000)
    store = c.server.app[STORE]
    real_release, open_at_release, ours = store.release_dram, [], []

    def release_dram(lease):         # is this request's connection still open?
        open_at_release.append([h for h in c.server.runner.server.connections if h.transport is not None
                                and h.transport.get_extra_info("peername") in ours and not h.transport.is_closing()])
        real_release(lease)
    monkeypatch.setattr(store, "release_dram", release_dram)

    async def write_then_fail(request, resp, deadline_s, parts, what):
        await resp.write(parts[0])
        raise RuntimeError("a failure mid-group (injected)")
    monkeypatch.setattr(batch_get_module, "_write_parts", write_then_fail)
    s = raw_post(c.server.port, "/v1/blocks/batch_get", json.dumps({"keys": keys}).encode())
    ours.append(s.getsockname())
    await asyncio.get_running_loop().run_in_executor(None, recv_all, s)
    await until(lambda: open_at_release)
    assert open_at_release == [[]]                   # aborted first
    await until(lambda: leases_held(c) == 0)


class Leases:
    """A store's lease calls, recorded."""

    def __init__(self):
        self.released = []

    def lease_views(self, keys):
        return [b"view"], "lease"

    def release_dram(self, lease):
        self.released.append(lease)


@pytest.mark.parametrize("step", ["lease", "release"])
async def test_a_cancelled_reader_still_gives_its_lease_back(step):
    """aiohttp cancels handlers at shutdown: a lease granted, or being given back, meanwhile must
    still end, or its chunks stay unevictable for good. The pool is busy, so the call is queued
    when the reader is cancelled (a queued call whose future is cancelled never runs)."""
    from concurrent.futures import ThreadPoolExecutor
    from kvcache.server.group_read import leased, release
    store, loop = Leases(), asyncio.get_running_loop()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(time.sleep, 0.3)

        def call(fn, *args):
            return loop.run_in_executor(pool, fn, *args)
        task = asyncio.ensure_future(leased(call, store, [b"k"]) if step == "lease" else release(call, store, "lease"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: store.released == ["lease"])
