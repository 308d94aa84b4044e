"""The store facade: lookup, get/put, write policies, pins, delete, restarts."""

import numpy as np
import pytest

from kvcache.kvstore import Namespace, Tier
from kvcache.kvstore.errors import BlockFormatError, StoreLockedError, UnknownNamespaceError
from kvcache.kvstore.types import PutItem, Tier
from kvcache.kvstore.types import TensorSpec
from tests.conftest import NS, make_keys, payload_for, put_blocks


def test_lookup_returns_longest_contiguous_prefix(make_store):
    s = make_store()
    keys = make_keys(10)
    put_blocks(s, keys[:4] + keys[5:])
    r = s.lookup(keys)
    assert r.num_hits == 4 and len(r.tiers) == 4
    assert r.num_tokens(NS.block_size) == 64
    assert s.lookup(keys[5:]).num_hits == 5
    assert s.lookup([]).num_hits == 0


def test_lookup_reports_tier_per_block(make_store):
    s = make_store(dram_mib=1)  # 1 MiB of DRAM: 256 blocks of 4 KiB at most
    keys = make_keys(400)
    put_blocks(s, keys)
    r = s.lookup(keys)
    assert r.num_hits == 400
    assert r.tiers[0] == Tier.NVME and r.tiers[-1] == Tier.DRAM
    assert set(r.tiers) == {Tier.NVME, Tier.DRAM}


def test_get_put_roundtrip_and_dedupe(make_store):
    s = make_store()
    keys = make_keys(5)
    r = put_blocks(s, keys)
    assert (r.stored, r.already_present, r.durable) == (5, 0, True)
    r = put_blocks(s, keys + keys[:1])
    assert (r.stored, r.already_present) == (0, 6)
    for k in keys:
        assert s.get(k) == payload_for(k)
    out = bytearray(5000)
    assert s.get_into(keys[0], out) == 4096 and bytes(out[:4096]) == payload_for(keys[0])
    assert s.get_many([keys[1], make_keys(1, start=999)[0]]) == [payload_for(keys[1]), None]


def test_nvme_hit_is_promoted_to_dram(make_store):
    s = make_store()
    keys = make_keys(3)
    put_blocks(s, keys)
    s.dram.delete(keys[0])
    assert s.lookup(keys[:1]).tiers == (Tier.NVME,)
    assert s.get(keys[0]) == payload_for(keys[0])
    assert s.lookup(keys[:1]).tiers == (Tier.DRAM,)
    assert s.stats().counters["hits_nvme"] == 1


def test_layout_is_validated(make_store):
    s = make_store()
    [k] = make_keys(1)
    layout = (TensorSpec("k", "bfloat16", (16, 64)), TensorSpec("v", "bfloat16", (16, 64)))
    s.put(k, bytes(4096), NS.id, layout=layout)
    with pytest.raises(BlockFormatError, match="needs 4096"):
        s.put(make_keys(1, start=77)[0], bytes(4000), NS.id, layout=layout)


def test_unknown_namespace_and_bad_keys_are_rejected(make_store):
    s = make_store()
    other = Namespace("other", "raw/v1", 16)
    with pytest.raises(UnknownNamespaceError, match="register_namespace"):
        s.put(make_keys(1)[0], b"x", other.id)
    with pytest.raises(BlockFormatError, match="16-byte keys"):
        s.put(b"short", b"x", NS.id)
    with pytest.raises(BlockFormatError, match="empty"):
        s.put(make_keys(1)[0], b"", NS.id)


def test_restart_keeps_blocks_and_namespaces(make_store, tmp_path, clock):
    s = make_store()
    keys = make_keys(20)
    put_blocks(s, keys)
    s.close()
    s2 = make_store()
    assert NS.id in s2.namespaces
    assert s2.lookup(keys).num_hits == 20
    assert all(s2.get(k) == payload_for(k) for k in keys)


def test_second_opener_gets_a_clear_error(make_store):
    make_store()
    with pytest.raises(StoreLockedError, match="in use"):
        make_store()


def test_write_back_acknowledges_from_dram_and_flush_makes_durable(make_store):
    s = make_store(dram_mib=8, write_policy="write-back")
    keys = make_keys(10)
    r = put_blocks(s, keys)
    assert r.stored == 10 and not r.durable
    assert s.index.count() == 0                 # nothing on NVMe yet
    s.flush()
    assert s.index.count() == 10
    s.close()
    s2 = make_store(dram_mib=8, write_policy="write-back")
    assert all(s2.get(k) == payload_for(k) for k in keys)


def test_write_back_demotes_on_eviction(make_store):
    s = make_store(dram_mib=1, write_policy="write-back")
    keys = make_keys(600)  # 600 x 4 KiB > 1 MiB of DRAM
    put_blocks(s, keys)
    assert s.stats().counters["demotions"] > 0
    assert all(s.get(k) == payload_for(k) for k in keys)


def test_dram_only_store(make_store):
    s = make_store(dram_mib=1, nvme=False)
    keys = make_keys(400)
    r = put_blocks(s, keys)
    assert not r.durable
    hits = [s.get(k) for k in keys]
    assert hits[-1] == payload_for(keys[-1]) and hits[0] is None
    assert all(h is None or h == payload_for(k) for h, k in zip(hits, keys))


def test_pins_never_go_negative(make_store):
    s = make_store()
    keys = make_keys(3)
    put_blocks(s, keys)
    assert s.pin(keys) == 3
    assert s.unpin(keys) == 3
    assert s.unpin(keys) == 0   # a double unpin changes nothing
    assert s.index.get(keys[0]).hard_pins == 0
    assert s.pin(make_keys(1, start=500)) == 0  # missing blocks are not pinned


def test_delete_removes_everywhere_and_survives_rebuild(make_store, tmp_path):
    import shutil
    s = make_store()
    keys = make_keys(6)
    put_blocks(s, keys)
    assert s.delete(keys[:3]) == 3
    assert s.lookup(keys).num_hits == 0
    assert s.get(keys[0]) is None and s.get(keys[4]) == payload_for(keys[4])
    put_blocks(s, keys[2:3])  # put again after delete: must survive the rebuild
    s.close()
    shutil.rmtree(tmp_path / "data" / "index")
    s2 = make_store()
    assert [s2.get(k) is not None for k in keys] == [False, False, True, True, True, True]


def test_corrupt_block_is_quarantined_not_served(make_store, tmp_path):
    s = make_store(dram_mib=None)
    keys = make_keys(4)
    put_blocks(s, keys)
    meta = s.index.get(keys[1])
    with open(s.nvme.path(meta.segment_id), "r+b") as f:
        f.seek(meta.offset + meta.record_len - 100)
        f.write(b"\xff" * 4)
    assert s.get(keys[1]) is None
    assert s.lookup(keys).num_hits == 1          # gone from the index
    assert s.stats().persistent_counters["quarantined"] == 1
    assert (tmp_path / "data" / "quarantine.jsonl").read_text().count(keys[1].hex()) == 1
    assert s.get(keys[2]) == payload_for(keys[2])


def test_sha256_namespace_uses_32_byte_keys(make_store):
    from kvcache.kvstore import HashAlgo, hash_blocks
    s = make_store()
    ns = Namespace("m", "raw/v1", 16, algo=HashAlgo.SHA256)
    s.register_namespace(ns)
    [k] = hash_blocks(ns, np.arange(16))
    s.put(k, b"abc", ns.id)
    assert s.get(k) == b"abc"
    with pytest.raises(BlockFormatError):
        s.put(k[:16], b"abc", ns.id)


def test_put_many_mixed_batch_is_all_or_nothing_on_bad_input(make_store):
    s = make_store()
    keys = make_keys(3)
    items = [PutItem(k, payload_for(k), NS.id) for k in keys] + [PutItem(b"bad", b"x", NS.id)]
    with pytest.raises(BlockFormatError):
        s.put_many(items)
    assert s.lookup(keys).num_hits == 0


def test_batched_gets(make_store):
    s = make_store()
    keys = make_keys(6)
    put_blocks(s, keys[:4])
    s.dram.delete(keys[0])  # one from NVMe
    assert s.get_many(keys) == [payload_for(k) for k in keys[:4]] + [None, None]
    outs = [bytearray(4096) for _ in keys]
    assert s.get_many_into(keys, outs) == [4096] * 4 + [None, None]
    assert [bytes(o) for o in outs[:4]] == [payload_for(k) for k in keys[:4]]
    with pytest.raises(ValueError, match="output buffers"):
        s.get_many_into(keys, outs[:2])
    with pytest.raises(ValueError, match="output buffer holds"):
        s.get_many_into(keys[:1], [bytearray(10)])


@pytest.mark.parametrize("nvme", [True, False])
def test_batched_gets_miss_expired_blocks_and_check_every_size_first(make_store, clock, nvme):
    """The batch path's shortcuts (all in DRAM, all young) never serve a block past its ttl, and
    a buffer too small anywhere in a batch fails it before any block is copied."""
    s = make_store(nvme=nvme)
    keys = make_keys(4)
    put_blocks(s, keys[:3])
    outs = [bytearray(4096) for _ in keys]
    assert s.get_many_into(keys[:3], outs[:3]) == [4096] * 3
    clock.advance(hours=48)
    assert s.get_many_into(keys[:1], outs[:1]) == [4096]          # block 0 read again: 72 h from now
    clock.advance(hours=25)
    outs = [bytearray(4096) for _ in keys]
    assert s.get_many_into(keys, outs) == [4096, None, None, None]
    assert s.get_many_into(keys[1:3], outs[1:3]) == [None, None] and outs[1] == bytes(4096)
    if not nvme:                                                    # DRAM-only: counted in memory
        assert s._dram_meta[keys[0]].access_count == 3
    fresh = make_keys(6)[4:]
    put_blocks(s, fresh)
    for wrap in (bytearray, lambda n: memoryview(bytearray(n))):     # memoryviews: the batch's C-level check
        outs = [wrap(4096), wrap(10)]
        with pytest.raises(ValueError, match="output buffer holds 10 bytes"):
            s.get_many_into(fresh, outs)
        assert outs[0] == bytes(4096)                               # nothing copied


def test_a_block_being_flushed_is_still_read_from_dram(make_store):
    """A write-back flush marks a block's metadata NVMe-resident before its index commit; a read
    meanwhile (readers take no store lock) still finds it in DRAM, never a miss or an NVMe read."""
    s = make_store(write_policy="write-back")
    keys = make_keys(2)
    put_blocks(s, keys)
    for k in keys:
        s._dram_meta[k].residency = Tier.NVME          # mid-commit: no placement, no index entry yet
    out = bytearray(4096)
    assert s.get_into(keys[0], out) == 4096 and bytes(out) == payload_for(keys[0])
    outs = [bytearray(4096) for _ in keys]
    assert s.get_many_into(keys, outs) == [4096, 4096]
    assert list(s.lookup(keys).tiers) == [Tier.DRAM] * 2
    assert s.stats_counters["hits_nvme"] == 0 and s.stats_counters["misses"] == 0


def test_second_hit_admission_keeps_one_off_puts_out_of_dram(tmp_path, clock):
    from kvcache.kvstore.config import StoreConfig
    from kvcache.kvstore.store import BlockStore
    from kvcache.tiering.config import DramConfig
    from kvcache.tiering.config import NvmeConfig
    cfg = StoreConfig(str(tmp_path / "s"), dram=DramConfig(capacity_bytes=4 << 20, page_bytes=1 << 20, prefault=False,
                                                          admission="second-hit"),
                      nvme=NvmeConfig(segment_bytes=1 << 20))
    with BlockStore(cfg, clock=clock) as store:
        store.register_namespace(NS)
        keys = make_keys(3)
        put_blocks(store, keys)
        assert not any(store.dram.contains(k) for k in keys)           # first sight: NVMe only
        assert store.stats().counters["dram_admission_refused"] == 3
        assert store.get(keys[1]) == payload_for(keys[1])              # a read is the second sight
        assert store.dram.contains(keys[1]) and not store.dram.contains(keys[0])
    with pytest.raises(ValueError, match="admission"):
        DramConfig(admission="sometimes")


def test_a_block_larger_than_a_dram_page_is_served_from_dram(tmp_path, clock):
    """Write-through and promotion alike: a block bigger than dram.page_bytes takes whole pages."""
    from kvcache.kvstore.config import StoreConfig
    from kvcache.kvstore.store import BlockStore
    from kvcache.tiering.config import DramConfig, NvmeConfig
    cfg = StoreConfig(str(tmp_path / "s"), dram=DramConfig(capacity_bytes=8 << 20, page_bytes=1 << 20, prefault=False),
                      nvme=NvmeConfig(segment_bytes=8 << 20))
    keys = make_keys(2)
    with BlockStore(cfg, clock=clock) as store:
        store.register_namespace(NS)
        put_blocks(store, keys, n=(1 << 20) + 4096)
        assert list(store.lookup(keys).tiers) == [Tier.DRAM, Tier.DRAM]
    with BlockStore(cfg, clock=clock) as store:            # restarted: NVMe only, then promoted
        assert list(store.lookup(keys).tiers) == [Tier.NVME, Tier.NVME]
        assert store.get(keys[0]) == payload_for(keys[0], (1 << 20) + 4096)
        assert list(store.lookup(keys).tiers) == [Tier.DRAM, Tier.NVME]


@pytest.mark.parametrize("shares", [{}, {"acme": {"share": 0.5}}])
def test_a_tenants_dram_share_keeps_its_prefixes_in_dram_through_a_neighbours_flood(tmp_path, clock, shares):
    from kvcache.kvstore.config import StoreConfig
    from kvcache.kvstore.store import BlockStore
    from kvcache.tiering.config import DramConfig, NvmeConfig
    cfg = StoreConfig(str(tmp_path / "s"), dram=DramConfig(capacity_bytes=4 << 20, page_bytes=64 << 10, prefault=False,
                                                          tenants=shares),
                      nvme=NvmeConfig(segment_bytes=4 << 20))
    with BlockStore(cfg, clock=clock) as store:                  # 64 blocks of 64 KiB
        store.register_namespace(NS)
        ours, flood = make_keys(24), make_keys(200, start=10_000)
        put_blocks(store, ours, n=64 << 10, tenant="acme")
        for i in range(0, 200, 20):
            put_blocks(store, flood[i: i + 20], n=64 << 10, tenant="noisy")
        tiers = store.lookup(ours, tenant="acme").tiers
        assert len(tiers) == 24                                  # NVMe holds every block either way
        in_dram = sum(t == Tier.DRAM for t in tiers)
        assert in_dram == (24 if shares else 0)
