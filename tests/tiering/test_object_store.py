"""The object tier (tiering/object_store.py): the tier contract over file:// and a real
S3-protocol server (moto_server in its own process), compression, the write-back queue,
timeouts and the circuit breaker."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from kvcache.kvstore.block_format import Codec, decode_header, decode_payload
from kvcache.kvstore.errors import CorruptBlockError
from kvcache.kvstore.types import raw_layout
from kvcache.tiering.base import BlockWrite, Placement
from kvcache.tiering.object_codec import ObjCodec, decode_header_any, shuffle2, unshuffle2_into
from kvcache.tiering.config import ObjectConfig
from kvcache.tiering.object_store import ObjectTier

pytest.importorskip("fsspec", reason="the object tier needs fsspec: pip install fsspec")

from tests.tiering.object_helpers import NS_ID, SIZES, _bf16_write, _flaky_tier, _key, _s3_config, _write


# ---------------------------------------------------------------- the contract, object specifics
# (the generic checks also run on file:// packs in test_tier_conformance.py)
@pytest.fixture(params=["file", "file-shuffle2", "s3"])
def tier(request, tmp_path):
    corrupt = []
    on_corrupt = lambda k, p, why: corrupt.append((k, why))  # noqa: E731
    if request.param == "s3":
        server = request.getfixturevalue("moto")
        cfg = _s3_config(server, pack_bytes=4 << 20)
    else:
        codec = "zstd-shuffle2" if request.param.endswith("shuffle2") else "none"
        cfg = ObjectConfig(url=f"file://{tmp_path}/obj", pack_bytes=4 << 20, codec=codec)
    landed = []
    t = ObjectTier(cfg, on_corrupt=on_corrupt, on_stored=landed.extend)
    t.corrupt, t.landed, t.backend = corrupt, landed, request.param
    yield t
    t.close()


def test_roundtrip_is_bit_identical(tier):
    writes = [_write(i + 10, n) for i, n in enumerate(SIZES)]
    placements = tier.put(writes)
    assert len(placements) == len(writes)
    assert len({p.segment_id for p in placements}) == 1, "one pack, not one object per block"
    for w, p in zip(writes, placements):
        assert tier.get(w.key, p) == bytes(w.payload)
        out = bytearray(len(w.payload) + 13)
        assert tier.get_into(w.key, p, out) == len(w.payload)
        assert out[: len(w.payload)] == w.payload
    assert not tier.corrupt


def test_missing_block_is_a_miss(tier):
    [p] = tier.put([_write(2, 3000)])
    assert tier.get(_key(999), p) is None          # another key at that placement
    assert tier.get(_key(2), Placement(p.segment_id + 50, p.offset, p.record_len, p.payload_len)) is None
    assert tier.get(_key(2), None) is None
    assert any("gone from the bucket" in why for _, why in tier.corrupt)   # on_missing defaults to on_corrupt


def test_corruption_in_a_pack_is_a_miss_and_reported(tier):
    writes = [_write(i, 50000) for i in range(300, 308)]
    placements = tier.put(writes)
    path = tier.path(placements[0].segment_id)
    data = bytearray(tier.fs.cat_file(path))
    # header byte, key byte, last payload byte, a payload byte
    mid = placements[3].record_len - placements[3].payload_len // 2
    for p, where in zip(placements[:4], (10, 40, placements[2].record_len - 1, mid)):
        data[p.offset + where] ^= 0x10
    tier.fs.pipe_file(path, bytes(data))
    assert [tier.get(w.key, p) for w, p in zip(writes[:4], placements[:4])] == [None] * 4
    assert [tier.get(w.key, p) for w, p in zip(writes[4:], placements[4:])] == [bytes(w.payload) for w in writes[4:]]
    assert len(tier.corrupt) >= 4
    assert tier.stats()["corrupt"] >= 4


def test_concurrent_puts_enqueues_and_gets(tier):
    n = 12 if tier.backend == "s3" else 40
    placements: dict[int, Placement] = {}
    errors = []
    barrier = threading.Barrier(5)

    def writer(base):
        barrier.wait()
        for i in range(base, base + n):
            placements[i] = tier.put([_write(i, 20000 + i)])[0]

    def enqueuer(base):
        barrier.wait()
        tier.enqueue([_write(i, 9000 + i) for i in range(base, base + n)])

    def reader(base):
        barrier.wait()
        for _ in range(2):
            for i in range(base, base + n):
                p = placements.get(i)
                if p is not None and tier.get(_key(i), p) != bytes(_write(i, 20000 + i).payload):
                    errors.append(i)

    threads = [threading.Thread(target=f, args=(b,)) for f, b in
               ((writer, 1000), (writer, 2000), (reader, 1000), (reader, 2000), (enqueuer, 5000))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tier.flush(30)
    assert not errors
    for i, p in placements.items():
        assert tier.get(_key(i), p) == bytes(_write(i, 20000 + i).payload)
    landed = dict(tier.landed)
    assert sorted(landed) == [_key(i) for i in range(5000, 5000 + n)] and len(tier.landed) == n
    for i in range(5000, 5000 + n):
        assert tier.get(_key(i), landed[_key(i)]) == bytes(_write(i, 9000 + i).payload)


def test_writeback_queue_packs_and_lands_everything(tier):
    landed = tier.landed
    writes = [_write(i, 30000 + i) for i in range(400, 460)]
    assert tier.enqueue(writes) == len(writes)
    assert tier.flush(30)
    got = dict(landed)
    assert len(landed) == len(writes) and set(got) == {w.key for w in writes}
    assert len({p.segment_id for p in got.values()}) <= 2, "blocks are packed, not one object each"
    for w in writes:
        assert tier.get(w.key, got[w.key]) == bytes(w.payload)
    s = tier.stats()
    assert s["queue_bytes"] == 0 and s["queue_unfinished"] == 0 and s["dropped_writes"] == 0


def test_rebuild_lists_every_record_from_pack_indexes(tier):
    writes = [_write(i, 40000 + i) for i in range(500, 520)]
    placements = tier.put(writes[:10]) + tier.put(writes[10:])
    deleted = tier.put_tombstones([writes[0].key], 5.0)
    found = {}
    for key, p, h in tier.rebuild():
        if h.is_tombstone:
            assert key == writes[0].key and p.segment_id in deleted
        else:
            found[key] = (p, h)
    for w, p in zip(writes, placements):
        got_p, h = found[w.key]
        assert got_p == p and h.raw_len == len(w.payload) and h.namespace_id == NS_ID and h.created == 1.0
    assert tier.list_packs().keys() >= {p.segment_id for p in placements}


def test_compaction_rewrites_live_records_then_removes_the_pack(tier):
    writes = [_write(i, 30000) for i in range(600, 610)]
    placements = tier.put(writes)
    old = placements[0].segment_id
    live = [(w.key, p) for w, p in zip(writes, placements) if int.from_bytes(w.key[:4], "little") % 2 == 0]
    moved = tier.rewrite_pack(old, live)
    assert set(moved) == {k for k, _ in live}
    assert all(p.segment_id != old for p in moved.values())
    # (the store commits `moved` to its index here) then the old pack goes
    tier.remove_pack(old)
    assert old not in tier.list_packs()
    for key, _ in live:
        w = next(w for w in writes if w.key == key)
        assert tier.get(key, moved[key]) == bytes(w.payload)
    assert tier.get(writes[1].key, placements[1]) is None


def test_namespaces_are_kept_beside_the_packs(tier):
    tier.save_namespaces({"ab": {"model": "m"}})
    assert tier.load_namespaces() == {"ab": {"model": "m"}}


# ---------------------------------------------------------------- packs on disk
def test_torn_pack_is_skipped_by_rebuild(tmp_path):
    t = ObjectTier(ObjectConfig(url=f"file://{tmp_path}/o"))
    good = t.put([_write(1, 1000)])[0]
    bad = t.put([_write(2, 1000)])[0]
    path = t.path(bad.segment_id)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 5)
    keys = [k for k, _, _ in t.rebuild()]
    assert keys == [_key(1)] and t.stats()["torn_packs"] == 1
    assert t.get(_key(1), good) == bytes(_write(1, 1000).payload)
    t.close()


def test_pack_ids_continue_after_a_restart(tmp_path):
    cfg = ObjectConfig(url=str(tmp_path / "o"))
    t = ObjectTier(cfg)
    p1 = t.put([_write(1, 100)])[0]
    t.close()
    t2 = ObjectTier(cfg)
    p2 = t2.put([_write(2, 100)])[0]
    assert p2.segment_id == p1.segment_id + 1
    assert t2.get(_key(1), p1) == bytes(_write(1, 100).payload)
    assert t2.usage().used_bytes > 0
    t2.close()


@pytest.mark.parametrize("bad, match", [
    (dict(codec="lz4"), "codec"),
    (dict(url="s3://kv/prefix"), "bucket"),
    (dict(url="relative/dir"), "absolute"),
    (dict(max_queue_bytes=1 << 20, pack_bytes=2 << 20), "max_queue_bytes"),
    (dict(queue_full="wait"), "queue_full"),
    (dict(on_outage="retry"), "on_outage"),
    (dict(timeout_s=0), "timeout_s"),
    (dict(breaker_failures=0), "breaker_failures"),
])
def test_config_validation_names_the_setting(bad, match):
    with pytest.raises(ValueError, match=match):
        ObjectConfig(**{"url": "file:///tmp/x", **bad})


# ---------------------------------------------------------------- compression
def test_shuffle2_roundtrips_odd_lengths():
    for n in (0, 1, 2, 7, 4096, 65537):
        raw = os.urandom(n)
        out = bytearray(n)
        unshuffle2_into(shuffle2(raw), out)
        assert bytes(out) == raw
    assert bytes(shuffle2(bytes([1, 2, 3, 4, 5]))) == bytes([2, 4, 1, 3, 5])   # hi bytes, lo bytes, tail


def test_bf16_compresses_with_zstd_shuffle2(tmp_path):
    writes = [_bf16_write(i) for i in range(1, 9)]   # 8 x 256 KiB
    ratios = {}
    for codec in ("zstd", "zstd-shuffle2"):
        t = ObjectTier(ObjectConfig(url=f"file://{tmp_path}/{codec}", codec=codec))
        placements = t.put(writes)
        for w, p in zip(writes, placements):
            assert p.payload_len < len(w.payload)
            assert t.get(w.key, p) == bytes(w.payload)
            out = np.zeros(len(w.payload) // 2, dtype=np.uint16)
            assert t.get_into(w.key, p, out) == len(w.payload) and out.tobytes() == w.payload
        s = t.stats()
        ratios[codec] = s["stored_ratio"]
        print(f"{codec}: ratio {s['zstd_ratio']}, compress {s['zstd_compress_MBps']} MB/s, "
              f"decompress {s['zstd_decompress_MBps']} MB/s")
        [(_, _, h)] = [r for r in t.rebuild() if r[0] == writes[0].key]
        assert h.codec == (ObjCodec.ZSTD if codec == "zstd" else ObjCodec.ZSTD_SHUFFLE2)
        t.close()
    assert ratios["zstd-shuffle2"] > ratios["zstd"] > 1.1


def test_shuffle2_records_fail_safe_for_unaware_readers(tmp_path):
    t = ObjectTier(ObjectConfig(url=f"file://{tmp_path}/o", codec="zstd-shuffle2"))
    [p] = t.put([_bf16_write(1)])
    rec = t.fs.cat_file(t.path(p.segment_id), start=p.offset, end=p.offset + p.record_len)
    h = decode_header_any(rec)
    assert h.codec == ObjCodec.ZSTD_SHUFFLE2
    if ObjCodec.ZSTD_SHUFFLE2 in {int(c) for c in Codec}:   # block_format knows codec 2: decodes it right
        assert bytes(decode_payload(decode_header(rec), rec[h.header_len:])) == _bf16_write(1).payload
    else:
        with pytest.raises(CorruptBlockError):   # it does not: a miss, never shuffled bytes
            decode_header(rec)
    t.close()


def test_incompressible_blocks_stay_raw(tmp_path):
    t = ObjectTier(ObjectConfig(url=f"file://{tmp_path}/o", codec="zstd"))
    w = BlockWrite(_key(1), NS_ID, os.urandom(100_000), raw_layout(100_000), 1.0)
    [p] = t.put([w])
    assert p.payload_len == 100_000 and t.get(w.key, p) == w.payload
    t.close()


@pytest.mark.parametrize("bandwidth, state", [(1e6, "on"), (1e13, "off")])
def test_auto_codec_decides_from_ratio_and_speed(tmp_path, bandwidth, state):
    cfg = ObjectConfig(url=f"file://{tmp_path}/o", codec="auto", auto_sample_bytes=1 << 20,
                       auto_bandwidth_bytes_s=bandwidth)
    t = ObjectTier(cfg)
    writes = [_bf16_write(i) for i in range(1, 11)]
    placements = t.put(writes)
    auto = t.stats()["codec_auto"]
    assert auto["state"] == state and auto["ratio"] > 1.1, auto
    if state == "off":
        assert placements[-1].payload_len == len(writes[-1].payload)   # decided: raw from then on
    assert all(t.get(w.key, p) == bytes(w.payload) for w, p in zip(writes, placements))
    t.close()


def test_auto_codec_waits_for_a_measured_upload_rate(tmp_path):
    t, fs = _flaky_tier(tmp_path, codec="auto", auto_sample_bytes=256 << 10, on_outage="hold")
    fs.fail = True
    t.enqueue([_bf16_write(i) for i in (1, 2)])
    assert not t.flush(0.3)
    assert t.stats()["codec_auto"]["state"] == "sampling"   # sampled enough, but no upload rate yet
    fs.fail = False
    assert t.flush(10)
    auto = t.stats()["codec_auto"]
    assert auto["state"] in ("on", "off") and auto["store_MBps"] > 0, auto
    t.close()
