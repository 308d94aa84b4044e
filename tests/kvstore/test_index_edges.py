"""The index at its edges (found by review): namespaces that are not what they say, an index
written by a newer build, keys no block can have, strided token arrays, read-only opens beside
a writing daemon, and a rebuild that meets an object-store outage."""

import json
import shutil

import lmdb
import numpy as np
import pytest

from kvcache.gc.pack_collector import compact_one_pack
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.errors import StoreError
from kvcache.kvstore.hashing import Namespace, hash_blocks
from kvcache.kvstore.index import Index
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.types import PutItem
from kvcache.tiering import object_store
from kvcache.tiering.config import NvmeConfig, ObjectConfig
from kvcache.tiering.object_io import ObjectStoreUnavailable
from tests.tiering.faults_common import NS, key_for, make_config, payload_for


@pytest.mark.parametrize("bad", [{"name": ["x"]}, {"tenant_salt": 7}, {"kv_layout": {"a": 1}}, {"block_size": True}])
def test_namespace_fields_have_their_types(bad):
    """A list as a name was stored, then broke every read and GC of that namespace (unhashable)."""
    with pytest.raises(ValueError):
        Namespace.from_dict({**NS.to_dict(), **bad})


def test_an_index_from_a_newer_build_is_a_clear_error_and_frees_the_directory(tmp_path):
    with BlockStore(make_config(tmp_path / "d")) as s:
        s.register_namespace(NS)
    env = lmdb.open(str(tmp_path / "d" / "index"), max_dbs=8)
    db = env.open_db(b"namespaces")              # (outside the write transaction: it takes one itself)
    with env.begin(write=True) as txn:           # a field this build does not know
        txn.put(NS.id, json.dumps({**NS.to_dict(), "rope_scaling": "yarn"}).encode(), db=db)
    env.close()
    with pytest.raises(StoreError, match="newer kvcache"):
        BlockStore(make_config(tmp_path / "d"))
    with pytest.raises(StoreError, match="newer kvcache"):   # not "locked by this very process"
        BlockStore(make_config(tmp_path / "d"))


@pytest.mark.parametrize("key", [b"", b"k" * 600])
def test_keys_no_block_can_have_are_nothing_to_delete(tmp_path, key):
    with BlockStore(make_config(tmp_path / "d")) as s:
        s.register_namespace(NS)
        s.put_many([PutItem(key_for(0), payload_for(0), NS.id)])
        assert s.delete([key, key_for(0)]) == 1


def test_strided_token_arrays_hash_like_lists():
    ns = Namespace("m", "l", 4)
    tokens = np.arange(32, dtype=np.int32)[::2]              # a column of a 2-D batch, say
    assert hash_blocks(ns, tokens) == hash_blocks(ns, tokens.tolist())


def test_a_read_only_index_takes_the_reader_lock(tmp_path, monkeypatch):
    """Without LMDB's reader table a writer reuses pages a read-only reader walks (kvcache stats
    beside a daemon: MDB_PAGE_NOTFOUND, or an abort in mdb.c)."""
    Index(str(tmp_path / "i")).close()
    seen = {}
    real = lmdb.open
    monkeypatch.setattr(lmdb, "open", lambda path, **kw: (seen.update(kw), real(path, **kw))[1])
    Index(str(tmp_path / "i"), readonly=True).close()
    assert seen["readonly"] and seen["lock"]


def _object_config(d, bucket) -> StoreConfig:
    return StoreConfig(str(d), dram=None, nvme=NvmeConfig(segment_bytes=1 << 20),
                       object_store=ObjectConfig(url=f"file://{bucket}", pack_linger_s=0.05))


class _Report:
    def __getattr__(self, name):
        return 0

    def __setattr__(self, name, value):
        pass


def test_a_rebuild_during_an_object_outage_indexes_the_packs_at_a_later_open(tmp_path, monkeypatch):
    """Object-only blocks (acknowledged) used to be lost for good: the rebuild finished without
    them, and pack GC then took their packs for empty ones."""
    d, bucket, keys = tmp_path / "data", tmp_path / "bucket", [key_for(i) for i in range(8)]
    with BlockStore(_object_config(d, bucket)) as s:
        s.register_namespace(NS)
        s.put_many([PutItem(k, payload_for(i, 20_000), NS.id) for i, k in enumerate(keys)])
        s.flush()
    shutil.rmtree(d)                                             # the blocks live in the packs only
    real = object_store.ObjectTier.list_packs

    def down(self):
        raise ObjectStoreUnavailable("outage (injected)")
    monkeypatch.setattr(object_store.ObjectTier, "list_packs", down)
    with BlockStore(_object_config(d, bucket)) as s:             # rebuilt during the outage
        assert s.index.objects_pending
        compact_one_pack(s, _Report(), keep_newest=0)            # pack GC waits
    monkeypatch.setattr(object_store.ObjectTier, "list_packs", real)
    with BlockStore(_object_config(d, bucket)) as s:             # the store is back: indexed now
        assert not s.index.objects_pending
        assert [s.get(k) for k in keys] == [payload_for(i, 20_000) for i in range(8)]
        for _ in range(3):
            compact_one_pack(s, _Report(), keep_newest=0)
        assert [s.get(k) for k in keys] == [payload_for(i, 20_000) for i in range(8)]


@pytest.mark.parametrize("path", ["write-through", "write-back", "compacted", "object only"])
def test_a_rebuilt_index_knows_whose_blocks_they_are(tmp_path, path):
    """Records name their tenant (format version 2; a block of no tenant stays version 1), so a
    rebuilt index keeps each tenant's usage (quotas) and retention, whichever way the record was
    written: a put, a write-back flush, a compaction's copy, an object pack."""
    import dataclasses
    from kvcache.gc.collector import Collector, GcReport
    from kvcache.kvstore.block_format import FORMAT_VERSION, decode_header, encode_header
    d, bucket = tmp_path / "data", tmp_path / "bucket"
    cfg = _object_config(d, bucket) if path == "object only" else make_config(d)
    if path == "write-back":
        cfg = dataclasses.replace(cfg, write_policy="write-back")
    keys = [key_for(i) for i in range(6)]
    with BlockStore(cfg) as s:
        s.register_namespace(NS)
        s.put_many([PutItem(k, payload_for(i, 50_000), NS.id, tenant="alice" if i < 4 else "")
                    for i, k in enumerate(keys)])
        if path == "compacted":
            s.delete(keys[4:])
            s.flush()
            Collector(s)._compact_one(GcReport(), force=True)
        if path == "write-back":
            s.flush()                                            # the write-back: records written now
        if path == "object only":
            s.flush()                                            # the packs have landed
        before = s.tenant_usage("alice")
    assert before == (200_000, 4)
    shutil.rmtree(d if path == "object only" else d / "index")  # object only: rebuilt from the packs alone
    with BlockStore(cfg) as s:
        assert s.tenant_usage("alice") == before
        assert {s.index.get(k).tenant for k in keys[:4]} == {"alice"}
        assert [s.get(k) for k in keys[:4]] == [payload_for(i, 50_000) for i in range(4)]
    untouched = encode_header(keys[0], NS.id, (), b"x", 1, 0.0)             # no tenant: the old format
    assert untouched[4:6] == FORMAT_VERSION.to_bytes(2, "little") and decode_header(untouched).tenant == ""


def test_a_lease_that_fails_half_way_gives_its_chunks_back(tmp_path, monkeypatch):
    from tests.client.test_shm import shm_store
    store = shm_store(tmp_path / "d")
    store.register_namespace(NS)
    keys = [key_for(i) for i in range(3)]
    store.put_many([PutItem(k, payload_for(i), NS.id) for i, k in enumerate(keys)])

    def broken(*args):
        raise RuntimeError("accounting failed (injected)")
    monkeypatch.setattr(store, "_publish", broken)
    with pytest.raises(RuntimeError):
        store.lease_dram(keys)
    entries = [store.dram._entries[k] for k in keys if k in store.dram._entries]
    assert entries and all(e.leases == 0 for e in entries)           # evictable again
    store.close()


def test_a_full_index_map_costs_access_times_not_reads(tmp_path, monkeypatch):
    from kvcache.kvstore import store as store_mod
    from kvcache.kvstore.errors import TierFullError
    s = BlockStore(make_config(tmp_path / "d", dram=False))
    s.register_namespace(NS)
    s.put_many([PutItem(key_for(0), payload_for(0), NS.id)])
    monkeypatch.setattr(store_mod, "MAX_PENDING_TOUCHES", 0)

    def full():
        raise TierFullError("index map full (injected)")
    monkeypatch.setattr(s.index, "flush_touches", full)
    assert s.get(key_for(0)) == payload_for(0)
    assert s.get_many([key_for(0)]) == [payload_for(0)]
    monkeypatch.undo()
    s.close()


def test_lease_views_are_read_only_payload_views_held_until_released(tmp_path, monkeypatch):
    from tests.client.test_shm import shm_store
    store = shm_store(tmp_path / "d")
    store.register_namespace(NS)
    keys = [key_for(i) for i in range(3)]
    store.put_many([PutItem(k, payload_for(i), NS.id) for i, k in enumerate(keys[:2])])
    published = []
    monkeypatch.setattr(store, "_publish", lambda *a: published.append(a))
    views, lease = store.lease_views(keys)
    assert [bytes(v) if v is not None else None for v in views] == [payload_for(0), payload_for(1), None]
    assert all(v.readonly for v in views[:2]) and published == []     # the read directory is untouched
    assert [store.dram._entries[k].leases for k in keys[:2]] == [1, 1]
    store.delete(keys[:1])                                  # deleted while leased: its chunk is not reused
    store.put_many([PutItem(key_for(9), payload_for(9), NS.id)])
    assert bytes(views[0]) == payload_for(0)
    store.release_dram(lease)
    assert store.dram._entries[keys[1]].leases == 0
    del views
    store.close()
