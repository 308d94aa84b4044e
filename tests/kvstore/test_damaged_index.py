"""Index values damaged at rest (bit flips): sizes are checked before a buffer is sized from them,
a damaged entry is a miss (its copy quarantined), and LMDB failures are StoreErrors."""

import dataclasses

import lmdb
import pytest

from kvcache.kvstore.errors import StoreError
from kvcache.kvstore.types import BlockMeta, Tier
from tests.tiering.faults_common import NS, fill, key_for, open_store, payload_for


def _rewrite(store, key: bytes, change) -> None:
    """Replace `key`'s index value with change(value) behind the store's back."""
    idx = store.index
    with idx.env.begin(write=True) as txn:
        raw = bytes(txn.get(key, db=idx._blocks))
        txn.put(key, change(raw), db=idx._blocks)


def _flip(field: str, bit: int):
    def change(raw: bytes) -> bytes:
        meta = BlockMeta.unpack(raw)
        return dataclasses.replace(meta, **{field: getattr(meta, field) ^ (1 << bit)}).pack()
    return change


@pytest.mark.parametrize("field,bit", [("payload_len", 40), ("payload_len", 30), ("record_len", 44),
                                       ("record_len", 16), ("offset", 36)])
def test_a_flipped_size_in_the_index_is_a_miss_not_an_allocation(tmp_path, field, bit):
    s = open_store(tmp_path / "d", dram=False)
    fill(s, range(3))
    _rewrite(s, key_for(0), _flip(field, bit))
    assert s.sizes_tiered([key_for(0)]) == [None]
    assert s.get_many_tiered([key_for(0), key_for(1)]) == [(None, Tier.NONE), (payload_for(1), Tier.NVME)]
    assert s.get(key_for(0)) is None
    assert s.index.get(key_for(0)) is None                  # quarantined: forgotten, never served
    assert s.stats_counters["quarantined"] == 1
    assert s.get(key_for(2)) == payload_for(2)
    s.close()


def test_a_flipped_size_does_not_reach_the_nvme_read(tmp_path):
    """The NVMe tier checks a placement against its file before sizing its own buffers."""
    s = open_store(tmp_path / "d", dram=False)
    fill(s, range(1))
    meta = s.index.get(key_for(0))
    bad = dataclasses.replace(meta, payload_len=meta.payload_len | 1 << 40)
    from kvcache.kvstore.reads import _placement
    assert s.nvme.get(key_for(0), _placement(bad)) is None
    assert s.nvme.holds_extent(_placement(meta)) and not s.nvme.holds_extent(_placement(bad))
    s.close()


def test_a_truncated_index_value_reads_as_absent(tmp_path):
    s = open_store(tmp_path / "d", dram=False)
    fill(s, range(2))
    _rewrite(s, key_for(0), lambda raw: raw[:20])
    _rewrite(s, key_for(1), lambda raw: raw[:16 + 8] + b"\x77" + raw[16 + 9:])   # residency 0x77: no such tier
    assert s.get_many([key_for(0), key_for(1)]) == [None, None]
    assert s.exists_many([key_for(0), key_for(1)]) == [False, False]
    assert s.lookup([key_for(0)]).num_hits == 0
    assert [k for k, _ in s.index.scan()] == []               # GC's scan skips them too
    assert s.delete([key_for(0), key_for(1)]) == 0            # and a delete of them does not fail
    s.close()


class _BrokenEnv:
    """An LMDB environment whose every transaction fails as a damaged file does."""

    def __init__(self, env):
        self._env = env

    def begin(self, **kw):
        raise lmdb.CorruptedError("mdb_get: MDB_CORRUPTED: Located page was wrong type")

    def __getattr__(self, name):
        return getattr(self._env, name)


def test_lmdb_errors_surface_as_store_errors(tmp_path):
    s = open_store(tmp_path / "d", dram=False)
    fill(s, range(1))
    real, s.index.env = s.index.env, _BrokenEnv(s.index.env)
    try:
        for call in (lambda: s.get(key_for(0)), lambda: s.exists_many([key_for(0)]),
                     lambda: s.sizes_tiered([key_for(0)]), lambda: s.delete([key_for(0)]),
                     lambda: s.put(key_for(9), payload_for(9), NS.id), lambda: s.stats()):
            with pytest.raises(StoreError, match="index"):
                call()
    finally:
        s.index.env = real
    assert s.get(key_for(0)) == payload_for(0)
    s.close()
