"""Bad input and damaged files: what the store refuses, and what it survives.

Input errors are rejected before any I/O with a message that names the problem. Damaged
files (truncated or bit-flipped segments, garbage namespaces.json or segment files) never
make the store serve wrong bytes or fail to open: damaged blocks become misses, are
quarantined and reported by `check`.
"""


from __future__ import annotations

import json
import os
import random
import shutil

import pytest

from kvcache.gc.collector import Collector
from kvcache.gc.fsck import check
from kvcache.kvstore.errors import (
    BlockFormatError, UnknownNamespaceError,
)
from kvcache.kvstore.hashing import Namespace
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.types import PutItem
from kvcache.kvstore.types import TensorSpec

from tests.tiering.faults_common import NS, NS_SHA, key_for, payload_for, make_config, open_store, fill, placements


# ------------------------------------------------------------------ bad input

def test_payload_that_does_not_match_its_layout_is_rejected(tmp_path):
    with open_store(tmp_path / "d") as s:
        layout = (TensorSpec("k", "bfloat16", (16, 8)), TensorSpec("v", "bfloat16", (16, 8)))
        s.put(key_for(0), bytes(512), NS.id, layout=layout)  # 2 x 16 x 8 x 2 bytes: fine
        for size in (511, 513, 256, 1):
            with pytest.raises(BlockFormatError, match=f"payload is {size} bytes.*needs 512"):
                s.put(key_for(1), bytes(size), NS.id, layout=layout)
        with pytest.raises(BlockFormatError, match="1-255 tensors"):
            s.put(key_for(1), bytes(512), NS.id, layout=())
        assert s.get(key_for(1)) is None and s.get(key_for(0)) == bytes(512)


@pytest.mark.parametrize("empty", [b"", bytearray(), memoryview(b"")])
def test_empty_payload_is_rejected(tmp_path, empty):
    with open_store(tmp_path / "d") as s:
        with pytest.raises(BlockFormatError, match="must not be empty"):
            s.put(key_for(0), empty, NS.id)
        assert not s.contains(key_for(0)) and s.index.count() == 0


def test_key_length_must_match_the_namespace_hash(tmp_path):
    with open_store(tmp_path / "d") as s:
        s.register_namespace(NS_SHA)
        for bad in (b"k", b"k" * 15, b"k" * 17, b"k" * 32, b"k" * 600):
            with pytest.raises(BlockFormatError, match="16-byte keys"):
                s.put(bad, b"x" * 10, NS.id)
        for bad in (b"k" * 16, b"k" * 31, b"k" * 33):
            with pytest.raises(BlockFormatError, match="32-byte keys"):
                s.put(bad, b"x" * 10, NS_SHA.id)
        s.put(b"k" * 32, b"x" * 10, NS_SHA.id)
        s.put(b"k" * 16, b"y" * 10, NS.id)
        assert s.get(b"k" * 32) == b"x" * 10 and s.get(b"k" * 16) == b"y" * 10
        assert s.get(b"k" * 600) is None and s.lookup([b"k" * 600]).num_hits == 0


def test_empty_key_is_rejected_cleanly(tmp_path):
    with open_store(tmp_path / "d") as s:
        with pytest.raises(BlockFormatError, match="16-byte keys"):
            s.put(b"", b"x" * 10, NS.id)
        assert s.get(b"") is None and s.lookup([b""]).num_hits == 0


def test_unregistered_namespace_is_rejected_and_nothing_of_the_batch_lands(tmp_path):
    other = Namespace("some-other-model", "raw/v1", 16)
    with open_store(tmp_path / "d") as s:
        with pytest.raises(UnknownNamespaceError, match=other.id.hex()):
            s.put(key_for(0), b"x" * 100, other.id)
        # a batch with one bad item is refused as a whole, before any I/O
        batch = [PutItem(key_for(1), payload_for(1), NS.id), PutItem(key_for(2), payload_for(2), other.id)]
        with pytest.raises(UnknownNamespaceError):
            s.put_many(batch)
        with pytest.raises(BlockFormatError):
            s.put_many([PutItem(key_for(3), payload_for(3), NS.id), PutItem(key_for(4), b"", NS.id)])
        assert s.index.count() == 0 and s.lookup([key_for(1)]).num_hits == 0
        assert s.nvme.disk_bytes() == 0, "a refused batch still wrote to a segment"


# ------------------------------------------------------------------ damaged segments

def test_truncated_segment_turns_its_tail_into_misses(tmp_path):
    data = tmp_path / "d"
    with open_store(data) as s:
        fill(s, range(30))  # ~0.6 MiB: one segment
        where = placements(s)
    seg_ids = {m.segment_id for _, m in where.values()}
    assert len(seg_ids) == 1
    sid = seg_ids.pop()
    path = os.path.join(str(data), "nvme", f"seg-{sid:08d}.kvs")
    victim = sorted(where.values(), key=lambda km: km[1].offset)[17][1]
    cut = victim.offset + victim.record_len // 2  # in the middle of block 17's record
    os.truncate(path, cut)
    lost = {i for i, (_, m) in where.items() if m.offset + m.record_len > cut}
    assert len(lost) == 30 - 17

    with open_store(data) as s:
        rep = check(s)
        assert set(rep.bad_blocks) == {key_for(i).hex() for i in lost}, rep.bad_blocks
        for i in range(30):
            assert s.get(key_for(i)) == (None if i in lost else payload_for(i)), f"block {i}"
        assert s.stats().persistent_counters["quarantined"] == len(lost)
        assert s.lookup([key_for(i) for i in sorted(lost)]).num_hits == 0
        assert not check(s).bad_blocks  # quarantined blocks left the index
    shutil.rmtree(data / "index")
    with open_store(data) as s:  # a rebuild sees the same: the torn tail is simply not there
        for i in range(30):
            assert s.get(key_for(i)) == (None if i in lost else payload_for(i)), f"block {i} after rebuild"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_bit_flips_are_never_served(tmp_path, seed):
    data = tmp_path / "d"
    rng = random.Random(seed)
    with open_store(data) as s:
        fill(s, range(60))  # ~1.3 MiB: two segments
        where = placements(s)
    hit: set[int] = set()
    flipped: set[tuple[int, int]] = set()

    def flip(sid: int, at: int) -> None:
        if (sid, at) in flipped:  # a second flip of the same byte could undo the first
            return
        flipped.add((sid, at))
        with open(os.path.join(str(data), "nvme", f"seg-{sid:08d}.kvs"), "r+b") as f:
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))
        hit.update(i for i, (_, m) in where.items()
                   if m.segment_id == sid and m.offset <= at < m.offset + m.record_len)

    records = sorted(where.items(), key=lambda kv: (kv[1][1].segment_id, kv[1][1].offset))
    for _, (_, meta) in rng.sample(records, 7):  # a bit inside 7 records, anywhere in them ...
        flip(meta.segment_id, meta.offset + rng.randrange(meta.record_len))
    for sid in sorted({m.segment_id for _, m in where.values()}):  # ... and 2 anywhere in each file
        size = os.path.getsize(os.path.join(str(data), "nvme", f"seg-{sid:08d}.kvs"))
        for _ in range(2):
            flip(sid, rng.randrange(4096, size))
    assert len(hit) >= 7
    with open(os.path.join(str(data), "nvme", "seg-00000001.kvs"), "r+b") as f:
        f.seek(2000)  # and one in the segment head's padding, which no read looks at
        f.write(b"\xff")

    with open_store(data) as s:
        rep = check(s)
        assert set(rep.bad_blocks) == {key_for(i).hex() for i in hit}
        assert rep.corrupt_records > 0 or rep.torn_bytes > 0, "the segment scan saw no damage"
        before = s.stats().persistent_counters.get("quarantined", 0)
        out = bytearray(64 << 10)
        for i in range(60):
            for _ in range(2):  # a second read must not find it anywhere either
                got = s.get(key_for(i)) if rng.random() < 0.5 else (
                    None if (n := s.get_into(key_for(i), out)) is None else bytes(out[:n]))
                assert got == (None if i in hit else payload_for(i)), f"block {i}"
        assert s.stats().persistent_counters["quarantined"] - before == len(hit)
        with open(data / "quarantine.jsonl") as f:
            entries = [json.loads(line) for line in f]
        assert {e["key"] for e in entries} == {key_for(i).hex() for i in hit}
        assert all(e["reason"] for e in entries)
    with open_store(data) as s:  # quarantine is persistent
        assert all(s.get(key_for(i)) is None for i in hit)
        assert s.stats().persistent_counters["quarantined"] == len(hit)


def test_garbage_segment_file_does_not_break_open_rebuild_or_gc(tmp_path):
    data = tmp_path / "d"
    with open_store(data) as s:
        fill(s, range(10))
    nvme = data / "nvme"
    (nvme / "seg-00000099.kvs").write_bytes(random.Random(9).randbytes(300_000))
    (nvme / "seg-00000098.kvs").write_bytes(b"")
    # a valid segment head followed by garbage
    head = (nvme / "seg-00000001.kvs").read_bytes()[:4096]
    (nvme / "seg-00000097.kvs").write_bytes(head + random.Random(7).randbytes(100_000))

    with open_store(data) as s:
        assert all(s.get(key_for(i)) == payload_for(i) for i in range(10))
        fill(s, range(10, 20))
        assert s.nvme.active_segment == 100, "new writes must not go into a garbage file"
        rep = check(s)
        assert not rep.bad_blocks and {97, 98, 99} <= set(rep.orphan_segments)
    shutil.rmtree(data / "index")
    with open_store(data) as s:  # rebuild skips what does not verify
        assert all(s.get(key_for(i)) == payload_for(i) for i in range(20))
        Collector(s).run(max_steps=20)
        assert all(s.get(key_for(i)) == payload_for(i) for i in range(20))
        assert not {97, 98, 99} & set(s.nvme.segment_ids()), "GC did not reclaim the garbage files"
        assert not check(s).bad_blocks


NAMESPACES_GARBAGE = [
    pytest.param(random.Random(3).randbytes(500), id="random-bytes"),
    pytest.param(b'{"0123": {"model_fingerprint": "m", "kv_la', id="truncated-json"),
    pytest.param(b"", id="empty"),
    pytest.param(b"[1, 2, 3]", id="json-list"),
    pytest.param(b'{"x": 5}', id="json-wrong-values"),
    pytest.param(b'{"x": {"model_fingerprint": "m"}}', id="json-missing-fields"),
]


@pytest.mark.parametrize("garbage", NAMESPACES_GARBAGE)
def test_garbage_namespaces_json_does_not_break_open_or_rebuild(tmp_path, garbage):
    data = tmp_path / "d"
    with open_store(data) as s:
        fill(s, range(10))
    (data / "nvme" / "namespaces.json").write_bytes(garbage)
    with open_store(data) as s:  # the index still knows the namespace
        assert NS.id in s.namespaces
        assert all(s.get(key_for(i)) == payload_for(i) for i in range(10))
    assert (data / "nvme" / "namespaces.json").read_bytes() == garbage  # nothing rewrote it
    shutil.rmtree(data / "index")
    with BlockStore(make_config(data)) as s:  # the rebuild cannot recover the namespace...
        assert all(s.get(key_for(i)) == payload_for(i) for i in range(10))
        with pytest.raises(UnknownNamespaceError):
            fill(s, [10])
        s.register_namespace(NS)  # ... until it is registered again
        fill(s, [10])
    with BlockStore(make_config(data)) as s:
        assert NS.id in s.namespaces
        assert all(s.get(key_for(i)) == payload_for(i) for i in range(11))
