"""Same-host reads of blocks only on NVMe (after a restart): file slots, the client's verified
segment reads, the fallback for damaged records, and the idle-time promotion into DRAM."""

import os
import time

import pytest

from kvcache.client.shm_files import read_record_into
from kvcache.client.sync_client import KVClient
from kvcache.kvstore import shm_wire as w
from kvcache.kvstore.block_format import encode_header, verify_raw_record
from kvcache.kvstore.errors import CorruptBlockError
from kvcache.kvstore.hashing import tenant_key
from kvcache.kvstore.promoter import Promoter
from kvcache.kvstore.types import Tier
from tests.client.test_shm import SHARER, no_socket_reads, served, shm_store  # noqa: F401 (served: a fixture)
from tests.conftest import NS, FakeClock, make_keys, payload_for, put_blocks

N = 64 << 10


def _restarted(path, keys, n=N):
    """A store that held `keys` and was reopened: DRAM empty, every block on NVMe."""
    store = shm_store(path, dram_bytes=8 << 20)
    store.register_namespace(NS)
    put_blocks(store, keys, n=n)
    store.close()
    return shm_store(path, dram_bytes=8 << 20)


def wait_for(cond, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(what)


# ---------------------------------------------------------------- the store's answer
def test_lease_shared_answers_nvme_blocks_with_their_records_and_promotes_them_later(tmp_path):
    keys = make_keys(4)
    store = _restarted(tmp_path / "s", keys)
    try:
        miss = make_keys(1, start=900)[0]
        slots, lease, fds = store.lease_shared(keys + [miss], max_files=w.MAX_LEASE_FDS)
        assert slots[4] is None and all(isinstance(s, w.FileSlot) for s in slots[:4]) and len(fds) == 1
        assert lease.held == () and store.stats_counters["hits_nvme"] == 4
        for k, s in zip(keys, slots[:4]):
            out = memoryview(bytearray(N))
            assert read_record_into(fds[s.fd], s, k, [out]) and bytes(out) == payload_for(k, N)
        w.close_fds(fds)
        store.release_dram(lease)
        wait_for(lambda: all(store.dram.contains(k) for k in keys), "the blocks were not promoted when idle")
        slots, lease, fds = store.lease_shared(keys, max_files=w.MAX_LEASE_FDS)   # now from DRAM
        assert all(type(s) is tuple for s in slots) and fds == [] and store.stats_counters["hits_dram"] == 4
        store.release_dram(lease)
    finally:
        store.close()


def test_without_files_cold_blocks_are_promoted_into_a_chunk_and_leased(tmp_path):
    keys = make_keys(3)
    store = _restarted(tmp_path / "s", keys)
    try:
        adopted = store.dram.adopted
        slots, lease, fds = store.lease_shared(keys, max_files=0)
        assert fds == [] and all(type(s) is tuple for s in slots)
        assert store.dram.adopted == adopted + 3       # read straight into DRAM: no second copy
        for k, (off, n) in zip(keys, slots):
            assert bytes(store.dram.arena.view[off: off + n]) == payload_for(k, N)
        store.release_dram(lease)
        assert store.dram.reserved_bytes == 0
    finally:
        store.close()


def test_blocks_beyond_the_descriptor_limit_are_promoted_instead(tmp_path):
    keys = make_keys(80)                 # 5 MiB over 4 MiB segments: two segments
    store = _restarted(tmp_path / "s", keys)
    try:
        segments = {store.index.get(k).segment_id for k in keys}
        assert len(segments) == 2
        slots, lease, fds = store.lease_shared(keys, max_files=1)
        kinds = {type(s) for s in slots}
        assert kinds == {w.FileSlot, tuple} and len(fds) == 1
        w.close_fds(fds)
        store.release_dram(lease)
    finally:
        store.close()


# ---------------------------------------------------------------- the client's checks
def _record(key=b"k" * 16, payload=b"p" * 1000):
    head = encode_header(key, NS.id, (), payload, len(payload), 1.0)
    return head, payload


@pytest.mark.parametrize("damage", ["header", "payload", "key", "length"])
def test_verify_raw_record_rejects_every_kind_of_mismatch(damage):
    head, payload = _record()
    verify_raw_record(head, b"k" * 16, payload)
    head, payload, key = bytearray(head), bytearray(payload), b"k" * 16
    if damage == "header":
        head[20] ^= 1
    elif damage == "payload":
        payload[500] ^= 1
    elif damage == "key":
        key = b"j" * 16
    else:
        payload = payload[:-1]
    with pytest.raises(CorruptBlockError):
        verify_raw_record(head, key, payload)


def test_read_record_into_refuses_bad_places_and_short_files(tmp_path):
    head, payload = _record()
    path = tmp_path / "seg"
    path.write_bytes(b"x" * 10 + head + payload)
    fd = os.open(path, os.O_RDONLY)
    try:
        out = memoryview(bytearray(len(payload)))
        good = w.FileSlot(0, 10, len(head), len(payload))
        assert read_record_into(fd, good, b"k" * 16, [out]) and bytes(out) == payload
        for bad in (good._replace(offset=11), good._replace(header_len=0), good._replace(header_len=1 << 20),
                    good._replace(offset=20), good._replace(nbytes=len(payload) + 1)):
            assert not read_record_into(fd, bad, b"k" * 16, [memoryview(bytearray(bad.nbytes))])
        assert not read_record_into(fd, good, b"k" * 16, [memoryview(bytearray(10))])   # too small
    finally:
        os.close(fd)


def test_a_record_read_into_pieces_is_verified_over_all_of_them(tmp_path):
    head, payload = _record(payload=bytes(range(256)) * 4)
    path = tmp_path / "seg"
    path.write_bytes(head + payload)
    fd = os.open(path, os.O_RDONLY)
    try:
        slot = w.FileSlot(0, 0, len(head), len(payload))
        parts = [memoryview(bytearray(n)) for n in (1, 500, 523)]
        assert read_record_into(fd, slot, b"k" * 16, parts) and b"".join(map(bytes, parts)) == payload
        verify_raw_record(head, b"k" * 16, [payload[:7], payload[7:]])
        with pytest.raises(CorruptBlockError):       # a piece that is not the record's bytes
            verify_raw_record(head, b"k" * 16, [payload[:7], b"\0" + payload[8:]])
        with pytest.raises(CorruptBlockError):       # pieces missing a byte
            verify_raw_record(head, b"k" * 16, [payload[:7], payload[8:]])
    finally:
        os.close(fd)


def test_lease_files_replies_round_trip_and_refuse_descriptors_they_lack():
    slots = [(1, 2), None, "socket", w.FileSlot(0, 100, 80, N)]
    body = w.encode_slots(9, slots, files=True)
    assert w.decode_slots(body, files=True, nfds=1) == (9, [(1, 2), None, "socket", w.FileSlot(0, 100, 80, N)])
    with pytest.raises(w.ShmProtocolError):
        w.decode_slots(body, files=True, nfds=0)
    with pytest.raises(w.ShmProtocolError):
        w.decode_slots(body)                          # a LEASE reply is shorter


# ---------------------------------------------------------------- promotion waits for idle
def test_promoter_waits_until_reads_pause():
    clock, done = FakeClock(0.0), []
    p = Promoter(lambda k, m: done.append(k), idle_s=1.0, clock=clock)
    try:
        p.note_read()
        p.submit([(b"a", None), (b"b", None)])
        time.sleep(0.1)
        assert done == [] and p.pending() == 2          # reads are recent: nothing copied
        clock.advance(seconds=2)
        wait_for(lambda: done == [b"a", b"b"], "idle promotion did not run")
    finally:
        p.close()


def test_promoter_gives_the_client_time_to_read_its_file_slots():
    """Leases of 1 GB of file slots, two in flight, keep promotion off for idle_s plus 2 GB at a
    slow disk's speed: the read times add up, and a later lease without slots shortens nothing."""
    from kvcache.kvstore.promoter import POLL_S, SLOW_READ_BYTES_PER_S
    clock, done = FakeClock(0.0), []
    p = Promoter(lambda k, m: done.append(k), idle_s=1.0, clock=clock)
    reading_s = 2 * 10 ** 9 / SLOW_READ_BYTES_PER_S
    try:
        p.note_read(10 ** 9)
        p.note_read(10 ** 9)
        p.note_read()
        p.submit([(b"a", None)])
        clock.advance(seconds=reading_s)              # read time over, idle_s not yet
        time.sleep(20 * POLL_S)                       # the worker looked at the clock again
        assert done == []
        clock.advance(seconds=1.01)
        wait_for(lambda: done == [b"a"], "promotion did not run once the reads could be over")
    finally:
        p.close()


# ---------------------------------------------------------------- the client over a daemon
@pytest.fixture
def restarted_daemon(tmp_path, served):
    def start(keys, n=N):
        return served(store=_restarted(tmp_path / "s", [tenant_key("s", k) for k in keys], n))
    return start


def slot_kinds(store) -> list:
    """Record the kind of every slot the store answers shared reads with."""
    kinds, real = [], store.lease_shared

    def lease_shared(keys, max_files):
        slots, lease, fds = real(keys, max_files)
        kinds.extend(type(s) for s in slots)
        return slots, lease, fds
    store.lease_shared = lease_shared
    return kinds


def test_a_restarted_daemon_serves_local_reads_from_the_segment_files(restarted_daemon):
    keys = make_keys(40)
    url, store = restarted_daemon(keys)
    answered = slot_kinds(store)
    with KVClient(url, SHARER, shared_memory="on") as c:
        no_socket_reads(c)
        outs = [bytearray(N) for _ in keys]
        assert c.get_many_into(keys, outs) == [N] * len(keys)
        assert [bytes(o) for o in outs] == [payload_for(tenant_key("s", k), N) for k in keys]
        assert answered == [w.FileSlot] * len(keys) and store.stats_counters["hits_nvme"] == len(keys)
        wait_for(lambda: list(c.lookup(keys).tiers) == [Tier.DRAM] * len(keys), "not promoted once idle")
        assert c.get_many_into(keys, outs) == [N] * len(keys)      # leased from DRAM now
        assert store.stats_counters["hits_dram"] == len(keys)


def test_a_damaged_record_is_reread_by_the_daemon_and_quarantined_never_served(restarted_daemon):
    keys = make_keys(6)
    url, store = restarted_daemon(keys)
    bad = tenant_key("s", keys[2])
    meta = store.index.get(bad)
    with open(store.nvme.path(meta.segment_id), "r+b") as f:      # one payload byte rots on disk
        f.seek(meta.offset + meta.record_len - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with KVClient(url, SHARER, shared_memory="on") as c:
        outs = [bytearray(N) for _ in keys]
        got = c.get_many_into(keys, outs)
        assert got == [N, N, None, N, N, N]
        assert [bytes(o) for i, o in enumerate(outs) if i != 2] == \
            [payload_for(tenant_key("s", k), N) for i, k in enumerate(keys) if i != 2]
        assert store.stats_counters["quarantined"] >= 1 and c.lookup([keys[2]]).num_hits == 0


def test_get_many_without_buffers_still_reads_nvme_blocks_through_dram(restarted_daemon):
    keys = make_keys(5)
    url, store = restarted_daemon(keys)
    with KVClient(url, SHARER, shared_memory="on") as c:
        no_socket_reads(c)
        assert c.get_many(keys) == [payload_for(tenant_key("s", k), N) for k in keys]
        assert store.dram.adopted == len(keys)                  # promoted into chunks, then leased


def test_a_cold_block_larger_than_a_page_is_read_into_a_span(tmp_path):
    key, n = make_keys(1)[0], (1 << 20) + 4096            # pages are 1 MiB: two of them
    store = shm_store(tmp_path / "s", dram_bytes=32 << 20)
    store.register_namespace(NS)
    put_blocks(store, [key], n=n)
    store.close()
    store = shm_store(tmp_path / "s", dram_bytes=32 << 20)
    try:
        [slot], lease, _ = store.lease_shared([key], max_files=0)
        assert store.dram.adopted == 1 and bytes(store.dram.arena.view[slot[0]: slot[0] + n]) == payload_for(key, n)
        store.release_dram(lease)
    finally:
        store.close()
