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
    fill(s, range(4))
    _rewrite(s, key_for(0), _flip(field, bit))
    _rewrite(s, key_for(3), _flip(field, bit))
    # key_for(3) is first met by get_many_tiered: its own size check, not sizes_tiered's quarantine
    assert s.get_many_tiered([key_for(3), key_for(1)]) == [(None, Tier.NONE), (payload_for(1), Tier.NVME)]
    assert s.index.get(key_for(3)) is None
    assert s.sizes_tiered([key_for(0)]) == [None]
    assert s.get_many_tiered([key_for(0), key_for(1)]) == [(None, Tier.NONE), (payload_for(1), Tier.NVME)]
    assert s.get(key_for(0)) is None
    assert s.index.get(key_for(0)) is None                  # quarantined: forgotten, never served
    assert s.get(key_for(3)) is None
    assert s.stats_counters["quarantined"] == 2
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


def _damage_table(store, db_name: str, change) -> int:
    """Replace every value of one of the index's tables with change(value); how many there were."""
    idx = store.index
    db = getattr(idx, db_name)
    with idx.env.begin(write=True) as txn:
        rows = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
        for k, v in rows:
            txn.put(k, change(v), db=db)
    return len(rows)


@pytest.mark.parametrize("table", ["_segments", "_counters"])
@pytest.mark.parametrize("change", [lambda v: v[:3], lambda v: v + b"\x01"], ids=["truncated", "longer"])
def test_a_damaged_usage_or_counter_value_is_recounted_not_raised(tmp_path, caplog, monkeypatch, table, change):
    """Segment usage and counters are bookkeeping that `kvcache check --fix` recounts: a damaged
    value reads as absent (a warning), and the next commit writes it afresh."""
    from kvcache.kvstore import index_usage
    monkeypatch.setattr(index_usage, "_warned", set())    # warned once per process: this test's own
    s = open_store(tmp_path / "d", dram=False)
    fill(s, range(3))
    assert s.delete([key_for(0)]) == 1
    assert _damage_table(s, table, change) > 0
    fill(s, range(3, 6))                                  # every put commit updates both tables
    assert s.delete([key_for(1)]) == 1
    assert s.get(key_for(3)) == payload_for(3)
    segments = s.index.segments()                         # the damaged segment's row, written afresh
    assert s.nvme.active_segment in segments and segments[s.nvme.active_segment].live_blocks > 0
    counters = s.index.counters()                         # and the tenant rows
    assert any(k.startswith("tenant_blocks/") for k in counters)
    assert any(k.startswith("tenant_bytes/") for k in counters)
    assert s.stats() is not None
    from kvcache.gc.collector import Collector
    Collector(s).run()
    assert [s.get(key_for(i)) for i in range(2, 6)] == [payload_for(i) for i in range(2, 6)]
    assert "damaged" in caplog.text
    s.close()


def test_a_damaged_object_copy_value_reads_as_no_copy(tmp_path):
    s = open_store(tmp_path / "d", dram=False)
    fill(s, range(2))
    from kvcache.tiering.base import Placement
    s.index.commit(object_puts={key_for(0): Placement(7, 0, 100, 90), key_for(1): Placement(7, 100, 100, 90)})
    assert _damage_table(s, "_objects", lambda v: v[:5]) == 2
    assert s.index.object_location(key_for(0)) is None
    assert s.index.object_copies_in([7]) == {}
    assert s.delete([key_for(0)]) == 1                    # forgetting a damaged copy does not fail
    assert s.get(key_for(1)) == payload_for(1)
    s.close()
