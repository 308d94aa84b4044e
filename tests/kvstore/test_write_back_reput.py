"""Write-back puts of blocks the store still holds in DRAM but no longer counts (expired, not yet
collected): the put's metadata and the DRAM copy must agree afterwards, whatever the put evicts
on the way, so that every later flush, eviction and read works and nothing is quarantined."""

import logging
import random

import pytest

from kvcache.kvstore.reads import _placement
from kvcache.kvstore.types import PutItem
from tests.conftest import NS, make_keys

BLOCK = 64 << 10


def _wb_store(make_store, subdir: str = "data", dram_mib: float = 1):
    return make_store(dram_mib=dram_mib, write_policy="write-back", subdir=subdir)


def test_an_expired_block_put_again_while_the_put_evicts_its_clean_copy(make_store, clock, caplog):
    """The put's own allocations evict the block's older, clean copy before the put reaches it:
    the copy it then inserts is dirty and must keep this put's metadata (the flush needs it)."""
    s = _wb_store(make_store)                      # 1 MiB of DRAM: 16 blocks of 64 KiB
    old, *rest = make_keys(17)
    s.put_many([PutItem(old, b"o" * BLOCK, NS.id, ttl_s=5.0)])
    s.flush()                                      # on NVMe now; its DRAM copy is clean
    clock.advance(seconds=10)                      # expired, not yet collected: a put stores it again
    with caplog.at_level(logging.ERROR):
        s.put_many([PutItem(k, k * (BLOCK // len(k)), NS.id) for k in rest[:15]] + [PutItem(old, b"o" * BLOCK, NS.id)])
        assert s.dram.contains(old) and old in s._dram_meta
        s.flush()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert s.get(old) == b"o" * BLOCK
    s.close()
    s = _wb_store(make_store)                      # the flush made it durable
    assert s.get(old) == b"o" * BLOCK


def test_an_expired_block_put_again_with_another_size_is_read_at_that_size(make_store, clock, caplog):
    """One key, two sizes (a client's mistake, or a format change): the DRAM copy is replaced, so
    the size the metadata records is the size DRAM, a read's buffer and the NVMe record hold."""
    s = _wb_store(make_store)
    key = make_keys(1)[0]
    s.put_many([PutItem(key, b"a" * 1000, NS.id, ttl_s=5.0)])
    clock.advance(seconds=10)
    s.put_many([PutItem(key, b"b" * 4000, NS.id)])
    with caplog.at_level(logging.ERROR):
        assert s.get(key) == b"b" * 4000
        assert s.get_many([key]) == [b"b" * 4000]
        s.flush()
        s.dram.delete(key)                         # now from NVMe
        assert s.get(key) == b"b" * 4000
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]    # no record quarantined


def test_random_write_back_puts_gets_expiry_and_flushes_lose_nothing(make_store, clock, caplog):
    """Seeded random runs of the operations that met the two cases above by chance: a read returns
    a miss or the bytes of one of its key's puts, no ERROR is logged, no operation raises."""
    keys = make_keys(120)
    for seed in range(4):
        rng = random.Random(seed)
        s = _wb_store(make_store, subdir=f"run{seed}")
        put: dict[bytes, set[bytes]] = {}
        with caplog.at_level(logging.ERROR):
            for _ in range(250):
                op = rng.choice("pppggtf")
                if op == "p":
                    items = [PutItem(k, k[:1] * rng.choice([100, 1000, 16000]), NS.id, ttl_s=rng.choice([None, 5.0]))
                             for k in rng.sample(keys, rng.randint(1, 20))]
                    s.put_many(items)
                    for it in items:
                        put.setdefault(it.key, set()).add(it.payload)
                elif op == "g":
                    ks = rng.sample(keys, 10)
                    for k, got in zip(ks, s.get_many(ks)):
                        assert got is None or got in put[k]
                elif op == "t":
                    clock.advance(seconds=rng.choice([1, 4, 10]))
                else:
                    s.flush()
            s.close()
        assert not [(r.getMessage(), r.exc_text) for r in caplog.records if r.levelno >= logging.ERROR], seed


def test_a_write_back_put_that_does_not_fit_in_dram_goes_to_nvme_whole(make_store):
    """DRAM holds pinned blocks and room for one more; a batch of that one and a block larger than
    DRAM goes to NVMe, durable and indexed, and the block that reached DRAM is a clean copy (a
    flush does not write it a second time)."""
    s = _wb_store(make_store)                       # 16 blocks of 64 KiB
    pinned, (first, huge) = make_keys(15), make_keys(2, start=100)
    s.put_many([PutItem(k, k * (BLOCK // len(k)), NS.id) for k in pinned])
    s.pin(pinned)
    demoted = s.stats_counters["demotions"]
    batch = {first: first * (BLOCK // len(first)), huge: huge * ((2 << 20) // len(huge))}
    s.put_many([PutItem(k, v, NS.id) for k, v in batch.items()])
    assert [s.index.get(k) is not None for k in batch] == [True, True]
    assert s.dram.contains(first) and first not in s._dram_meta and not s.dram._entries[first].dirty
    s.flush()
    assert s.stats_counters["demotions"] - demoted == len(pinned)      # the pinned ones, once
    assert [s.get(k) for k in batch] == list(batch.values())


@pytest.mark.parametrize("drop", ["expiry", "capacity eviction", "quarantine"])
def test_dropping_an_expired_record_keeps_the_newer_write_back_copy(make_store, clock, drop):
    """The old record goes (the collector's expiry or capacity eviction, or quarantine); the copy a
    write-back put stored since is newer and not yet on NVMe: it stays readable and reaches NVMe
    at the next flush, so it survives a restart."""
    from kvcache.gc.collector import Collector
    s = _wb_store(make_store)
    key = make_keys(1)[0]
    s.put_many([PutItem(key, b"a" * 4096, NS.id, ttl_s=5.0)])
    s.flush()
    clock.advance(seconds=10)
    assert s.put_many([PutItem(key, b"a" * 4096, NS.id)]).stored == 1     # acknowledged
    old = s.index.get(key)
    if drop == "expiry":
        Collector(s).step()
    elif drop == "capacity eviction":
        with s._lock:
            Collector(s)._evict_locked(key, old)
    else:
        s._quarantine(key, _placement(old), "a damaged record")
    assert s.index.get(key) is None and s.dram.contains(key)
    assert s.get(key) == b"a" * 4096
    s.flush()
    s.close()
    assert _wb_store(make_store).get(key) == b"a" * 4096


def test_a_promotion_of_an_older_record_leaves_a_newer_write_back_copy_alone(make_store, clock):
    """A reader read the old record from NVMe; before it promotes those bytes, the block expires
    and is put again, at another size, into DRAM (dirty). The promotion must not replace it."""
    s = _wb_store(make_store, dram_mib=4)
    key = make_keys(1)[0]
    s.put_many([PutItem(key, b"a" * 1000, NS.id, ttl_s=5.0)])
    s.flush()
    s.dram.delete(key)
    old = s._meta(key, clock())
    buf = bytearray(old.payload_len)
    header = s.nvme.read_into(key, _placement(old), buf)
    clock.advance(seconds=10)
    s.put_many([PutItem(key, b"b" * 4000, NS.id)])
    s._promote(key, old, header.layout, memoryview(buf))
    assert s.get(key) == b"b" * 4000
    s.flush()
    s.dram.delete(key)
    assert s.get(key) == b"b" * 4000                  # the flush wrote the newer copy


def test_a_write_through_put_dram_does_not_admit_drops_a_copy_of_another_size(tmp_path, clock):
    """Second-hit admission refuses a block put again after it expired; the copy a read promoted
    before, of another size, must not answer reads sized by the new metadata."""
    from kvcache.kvstore.config import StoreConfig
    from kvcache.kvstore.store import BlockStore
    from kvcache.tiering.config import DramConfig, NvmeConfig
    cfg = StoreConfig(str(tmp_path / "s"), nvme=NvmeConfig(segment_bytes=1 << 20),
                      dram=DramConfig(capacity_bytes=4 << 20, page_bytes=1 << 20, prefault=False,
                                      admission="second-hit", admission_memory=1))
    with BlockStore(cfg, clock=clock) as s:
        s.register_namespace(NS)
        key, other = make_keys(2)
        s.put_many([PutItem(key, b"a" * 1000, NS.id, ttl_s=5.0)])     # refused, remembered
        s.get(key)                                                     # promoted: 1000 bytes in DRAM
        s.put_many([PutItem(other, b"o" * 1000, NS.id)])               # the key falls out of the memory
        clock.advance(seconds=10)
        s.put_many([PutItem(key, b"b" * 4000, NS.id)])                 # refused again
        assert s.get(key) == b"b" * 4000 and s.get_many([key]) == [b"b" * 4000]
