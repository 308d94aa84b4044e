"""One contract, every tier (DRAM, NVMe, object): see tiering/base.py."""

import threading

import pytest

from kvcache.kvstore.types import raw_layout
from kvcache.tiering.base import BlockWrite, Placement
from kvcache.tiering.config import DramConfig, NvmeConfig, ObjectConfig
from kvcache.tiering.dram import DramTier
from kvcache.tiering.nvme import NvmeTier
from kvcache.tiering.object_store import ObjectTier

NS_ID = bytes(range(16))


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _write(i: int, n: int) -> BlockWrite:
    payload = (i.to_bytes(4, "little") * (n // 4 + 1))[:n]
    return BlockWrite(_key(i), NS_ID, payload, raw_layout(n), 1.0)


@pytest.fixture(params=["dram", "nvme", "nvme-odirect", "object", "object-shuffle2"])
def tier(request, tmp_path):
    corrupt = []
    if request.param == "dram":
        t = DramTier(DramConfig(capacity_bytes=64 << 20, page_bytes=2 << 20, prefault=False))
    elif request.param.startswith("object"):  # packs in a file:// directory; S3 in test_object_store.py
        codec = "zstd-shuffle2" if request.param.endswith("shuffle2") else "none"
        t = ObjectTier(ObjectConfig(url=f"file://{tmp_path}/bucket", pack_bytes=4 << 20, codec=codec),
                       on_corrupt=lambda k, p, why: corrupt.append((k, why)))
    else:
        cfg = NvmeConfig(segment_bytes=4 << 20, o_direct=request.param.endswith("odirect"))
        try:
            t = NvmeTier(str(tmp_path / "nvme"), cfg, on_corrupt=lambda k, p, why: corrupt.append((k, why)))
            t.put([_write(0, 100)])  # O_DIRECT is refused by some filesystems (tmpfs)
        except OSError as e:
            pytest.skip(f"O_DIRECT unsupported here: {e}")
    t.corrupt = corrupt
    yield t
    t.close()


SIZES = [1, 7, 4096, 65536, 65537, 1 << 20]


def test_roundtrip_is_bit_identical(tier):
    writes = [_write(i + 10, n) for i, n in enumerate(SIZES)]
    placements = tier.put(writes)
    assert len(placements) == len(writes)
    for w, p in zip(writes, placements):
        assert tier.get(w.key, p) == bytes(w.payload)
        out = bytearray(len(w.payload) + 13)
        assert tier.get_into(w.key, p, out) == len(w.payload)
        assert out[: len(w.payload)] == w.payload


def test_get_into_rejects_small_buffer(tier):
    [p] = tier.put([_write(1, 5000)])
    with pytest.raises(ValueError, match="output buffer"):
        tier.get_into(_key(1), p, bytearray(4999))


def test_missing_block_is_a_miss(tier):
    [p] = tier.put([_write(2, 3000)])
    # another key at that placement: the record does not hold it
    assert tier.get(_key(999), p) is None


def test_delete_never_exposes_other_bytes(tier):
    w = _write(3, 70000)
    [p] = tier.put([w])
    tier.delete(w.key, p)
    tier.put([_write(i, 70000) for i in range(100, 120)])
    assert tier.get(w.key, p) in (None, bytes(w.payload))


def test_usage_counts_bytes(tier):
    before = tier.usage().used_bytes
    placements = tier.put([_write(i, 65536) for i in range(200, 210)])
    # stored bytes: a whole record on disk (maybe compressed), the payload in DRAM
    assert tier.usage().used_bytes >= before + sum(p.record_len or p.payload_len for p in placements)
    assert all(p.payload_len for p in placements)


def test_concurrent_puts_and_gets(tier):
    placements: dict[int, Placement] = {}
    errors = []
    barrier = threading.Barrier(4)

    def writer(base):
        barrier.wait()
        for i in range(base, base + 50):
            placements[i] = tier.put([_write(i, 20000 + i)])[0]

    def reader(base):
        barrier.wait()
        for _ in range(3):
            for i in range(base, base + 50):
                p = placements.get(i)
                if p is not None:
                    got = tier.get(_key(i), p)
                    if got != bytes(_write(i, 20000 + i).payload):
                        errors.append(i)

    threads = [threading.Thread(target=f, args=(b,)) for f, b in
               ((writer, 1000), (writer, 2000), (reader, 1000), (reader, 2000))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, p in placements.items():
        assert tier.get(_key(i), p) == bytes(_write(i, 20000 + i).payload)


def test_nvme_detects_bit_flips(tmp_path):
    corrupt = []
    t = NvmeTier(str(tmp_path), NvmeConfig(segment_bytes=4 << 20), on_corrupt=lambda k, p, why: corrupt.append(why))
    writes = [_write(i, 50000) for i in range(8)]
    placements = t.put(writes)
    t.sync()
    path = t.path(placements[0].segment_id)
    for p, where in zip(placements[:4], (10, 40, placements[2].record_len - 1, 3000)):
        with open(path, "r+b") as f:
            f.seek(p.offset + where)
            b = f.read(1)
            f.seek(p.offset + where)
            f.write(bytes([b[0] ^ 0x10]))
    for w, p in zip(writes, placements):
        got = t.get(w.key, p)
        assert got is None or got == bytes(w.payload)
    assert [t.get(w.key, p) for w, p in zip(writes[:4], placements[:4])] == [None] * 4
    assert [t.get(w.key, p) for w, p in zip(writes[4:], placements[4:])] == [bytes(w.payload) for w in writes[4:]]
    assert len(corrupt) >= 4
    t.close()


def test_nvme_rotates_segments_and_restarts_in_a_fresh_one(tmp_path):
    t = NvmeTier(str(tmp_path), NvmeConfig(segment_bytes=1 << 20))
    placements = t.put([_write(i, 300_000) for i in range(10)])
    assert len({p.segment_id for p in placements}) >= 3
    assert all(p.offset + p.record_len <= (1 << 20) + 300_200 for p in placements)
    last = max(t.segment_ids())
    t.close()
    t2 = NvmeTier(str(tmp_path), NvmeConfig(segment_bytes=1 << 20))
    [p] = t2.put([_write(99, 10)])
    assert p.segment_id == last + 1
    assert t2.get(_key(3), placements[3]) == bytes(_write(3, 300_000).payload)
    t2.close()
