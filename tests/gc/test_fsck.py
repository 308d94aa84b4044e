"""`check`: finds what is wrong, fixes only when asked, recounts exactly."""

import os

from kvcache.gc.fsck import check
from kvcache.kvstore.types import BlockMeta, Tier
from tests.conftest import make_keys, payload_for, put_blocks


def test_clean_store_checks_ok(make_store):
    s = make_store()
    put_blocks(s, make_keys(30))
    rep = check(s)
    assert rep.ok and rep.blocks_checked == 30 and not rep.fixed


def test_finds_and_fixes_corruption_missing_segments_and_bad_counts(make_store):
    s = make_store(dram_mib=None)
    keys = make_keys(300)
    put_blocks(s, keys, n=16384)
    metas = {k: s.index.get(k) for k in keys}
    victim = keys[5]
    with open(s.nvme.path(metas[victim].segment_id), "r+b") as f:
        at = metas[victim].offset + metas[victim].record_len - 1
        f.seek(at)
        flipped = f.read(1)[0] ^ 0x01
        f.seek(at)
        f.write(bytes([flipped]))
    gone_seg = metas[keys[-1]].segment_id
    os.unlink(s.nvme.path(gone_seg))
    s.index.set_segment_usage({1: (1, 1)})          # wrong counts
    dangling = make_keys(1, start=90_000)[0]
    s.index.commit({dangling: BlockMeta(bytes(16), 10, Tier.NVME, segment_id=777, record_len=50)})

    rep = check(s)
    assert not rep.ok
    lost = [k for k in keys if metas[k].segment_id == gone_seg]
    assert set(rep.bad_blocks) == {victim.hex(), dangling.hex()} | {k.hex() for k in lost}
    assert rep.segment_table_mismatches > 0
    assert s.index.get(victim) is not None           # report only

    rep = check(s, fix=True)
    assert rep.fixed
    assert s.index.get(victim) is None and s.index.get(dangling) is None
    again = check(s)
    assert again.ok, again.to_dict()
    assert all(s.get(k) == payload_for(k, 16384) for k in keys if k != victim and k not in lost)


def test_orphan_segments_are_registered_for_gc(make_store):
    from kvcache.gc.collector import Collector
    s = make_store(dram_mib=None)
    keys = make_keys(100)
    put_blocks(s, keys, n=16384)
    s.index.commit(deletes=keys)
    s.index.set_segment_usage({})                    # forget every segment
    rep = check(s, fix=True)
    assert rep.orphan_segments and rep.unreferenced_bytes > 0
    Collector(s).run()
    assert s.nvme.segment_ids() == [s.nvme.active_segment] or len(s.nvme.segment_ids()) <= 1
