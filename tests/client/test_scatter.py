"""Reads into a Scatter (one payload over several buffers) on every read path of the daemon
clients: the shared-memory arena, NVMe file slots after a restart, and the socket."""

import asyncio
import os

import pytest

from kvcache.client import shm_client
from kvcache.client.async_client import AsyncKVClient
from kvcache.kvstore.types import Scatter, copy_into, copy_pieces, dest_pieces
from kvcache.client.sync_client import KVClient
from kvcache.kvstore.hashing import tenant_key
from tests.client.test_shm import ADMIN, SHARER, no_socket_reads, served  # noqa: F401 (served: a fixture)
from tests.client.test_shm_files import N, restarted_daemon  # noqa: F401 (a fixture)
from tests.conftest import NS, make_keys, payload_for, put_blocks

SPLIT = (1000, 24_000, N - 25_000)           # uneven parts, one not a multiple of anything


def scatters(count: int, split=SPLIT) -> tuple[list[Scatter], list[list[bytearray]]]:
    bufs = [[bytearray(n) for n in split] for _ in range(count)]
    return [Scatter(b) for b in bufs], bufs


def joined(parts: list[bytearray]) -> bytes:
    return b"".join(bytes(p) for p in parts)


# ---------------------------------------------------------------- the type itself
def test_a_scatter_splits_payloads_in_order_and_refuses_what_it_cannot_hold():
    s = Scatter([bytearray(3), memoryview(bytearray(8)).cast("B"), bytearray(5)])
    assert s.nbytes == 16
    assert [p.nbytes for p in s.pieces(16)] == [3, 8, 5]
    assert [p.nbytes for p in s.pieces(6)] == [3, 3]            # a shorter payload fills from the first
    assert copy_pieces(s.pieces(6), memoryview(b"abcdef")) == 6 and joined(s.parts)[:6] == b"abcdef"
    with pytest.raises(ValueError, match="hold 16 bytes"):
        s.pieces(17)
    with pytest.raises(ValueError, match="writable"):
        Scatter([b"read-only"])
    with pytest.raises(ValueError, match="1 to"):
        Scatter([])
    with pytest.raises(ValueError, match="contiguous"):
        Scatter([memoryview(bytearray(8))[::2]])           # strided
    assert [p.nbytes for p in dest_pieces(bytearray(10), 4)] == [4]
    with pytest.raises(ValueError, match="output buffer"):
        dest_pieces(bytearray(3), 4)
    plain = bytearray(5)
    assert copy_into(plain, memoryview(b"wxyz")) == 4 and plain == b"wxyz\0"
    assert copy_into(s, memoryview(b"0123456789")) == 10 and joined(s.parts)[:10] == b"0123456789"
    with pytest.raises(ValueError, match="output buffer"):
        copy_into(bytearray(3), memoryview(b"wxyz"))


# ---------------------------------------------------------------- the read paths
def test_scattered_reads_from_shared_memory(served):
    url, _ = served()
    with KVClient(url, ADMIN, shared_memory="on") as c:
        c.register_namespace(NS)
        keys = make_keys(6)
        put_blocks(c, keys, n=N)
        no_socket_reads(c)
        outs, bufs = scatters(len(keys))
        miss = make_keys(1, start=800)[0]
        assert c.get_many_into(keys + [miss], outs + [Scatter([bytearray(1)])]) == [N] * 6 + [None]
        assert [joined(b) for b in bufs] == [payload_for(k, N) for k in keys]
        one, parts = scatters(1)
        assert c.get_into(keys[4], one[0]) == N and joined(parts[0]) == payload_for(keys[4], N)
        with pytest.raises(ValueError, match="output buffers hold"):
            c.get_many_into(keys[:1], [Scatter([bytearray(10), bytearray(10)])])


def test_scattered_reads_from_the_segment_files_are_verified(restarted_daemon, monkeypatch):
    keys = make_keys(5)
    url, store = restarted_daemon(keys)
    bad = tenant_key("s", keys[1])
    meta = store.index.get(bad)
    with open(store.nvme.path(meta.segment_id), "r+b") as f:      # a byte of the last part rots
        f.seek(meta.offset + meta.record_len - 10)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    read_here = []
    real = shm_client.read_record_into

    def spy(fd, slot, key, dst):
        ok = real(fd, slot, key, dst)
        read_here.append((len(dst), ok))
        return ok
    monkeypatch.setattr(shm_client, "read_record_into", spy)
    with KVClient(url, SHARER, shared_memory="on") as c:
        outs, bufs = scatters(len(keys))
        assert c.get_many_into(keys, outs) == [N, None, N, N, N]     # re-read by the daemon: quarantined
        assert sorted(read_here) == [(3, False)] + [(3, True)] * 4    # each into its 3 pieces, here
        want = [payload_for(tenant_key("s", k), N) for k in keys]
        assert [joined(b) for i, b in enumerate(bufs) if i != 1] == [w for i, w in enumerate(want) if i != 1]
        assert store.stats_counters["quarantined"] >= 1 and store.stats_counters["hits_nvme"] >= 4


@pytest.mark.parametrize("client", ["blocking", "asyncio"])
def test_scattered_reads_over_the_socket(served, client):
    url, _ = served()
    keys = make_keys(4)
    with KVClient(url, ADMIN, shared_memory="off") as c:
        c.register_namespace(NS)
        put_blocks(c, keys, n=N)
        if client == "blocking":
            outs, bufs = scatters(len(keys))
            assert c.get_many_into(keys, outs) == [N] * 4
            one, parts = scatters(1)
            assert c.get_into(keys[2], one[0]) == N and joined(parts[0]) == payload_for(keys[2], N)
        else:
            async def read():
                async with AsyncKVClient(url, ADMIN, shared_memory="off") as ac:
                    outs, bufs = scatters(len(keys))
                    assert await ac.get_many_into(keys, outs) == [N] * 4
                    one, parts = scatters(1)
                    assert await ac.get_into(keys[3], one[0]) == N
                    assert joined(parts[0]) == payload_for(keys[3], N)
                    return bufs
            bufs = asyncio.run(read())
        assert [joined(b) for b in bufs] == [payload_for(k, N) for k in keys]
