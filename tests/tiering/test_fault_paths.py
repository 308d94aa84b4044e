"""Fault paths of the store's tiers (found by review): an error opening a segment, a bad copy
that cannot be recorded, a write-back flush onto a full disk, a reader racing compaction's
unlink, and compaction's copies on disk before the index names them."""

import dataclasses
import errno
import os
import resource

import pytest

from kvcache.gc.collector import Collector, GcReport
from kvcache.kvstore.errors import TierFullError
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.types import PutItem
from kvcache.tiering import nvme as nvme_mod
from kvcache.tiering.base import Placement
from kvcache.tiering.config import NvmeConfig
from tests.tiering.faults_common import NS, key_for, make_config, open_store, payload_for


def test_a_segment_that_cannot_be_opened_is_a_miss_not_an_error(tmp_path):
    s = open_store(tmp_path / "d", dram=False)
    s.put_many([PutItem(key_for(0), payload_for(0), NS.id)])
    s.close()
    s = open_store(tmp_path / "d", dram=False)               # no segment fd cached yet
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    hogs = []
    try:
        with pytest.raises(OSError) as e:                     # the process at its fd limit
            while True:
                hogs.append(os.open("/dev/null", os.O_RDONLY))
        assert e.value.errno == errno.EMFILE
        assert s.get(key_for(0)) is None
    finally:
        for fd in hogs:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert s.get(key_for(0)) == payload_for(0)                # not quarantined: served once fds are free
    s.close()


def test_a_corrupt_copy_that_cannot_be_recorded_is_still_a_miss(tmp_path):
    s = open_store(tmp_path / "d", dram=False)
    s.put_many([PutItem(key_for(i), payload_for(i), NS.id) for i in range(2)])
    meta = s.index.get(key_for(0))
    with open(s.nvme.path(meta.segment_id), "r+b") as f:     # one payload byte flipped on disk
        f.seek(meta.offset + meta.record_len - 10)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    os.mkdir(os.path.join(s.config.data_dir, "quarantine.jsonl"))   # the quarantine log cannot be appended
    assert s.get(key_for(0)) is None
    assert s.get(key_for(0)) is None                          # checked again, never served
    assert s.get(key_for(1)) == payload_for(1)
    assert s.stats_counters["quarantine_errors"] >= 1
    s.close()


def test_a_write_back_flush_onto_a_full_disk_raises_and_keeps_the_blocks(tmp_path):
    s = BlockStore(dataclasses.replace(make_config(tmp_path / "d"), write_policy="write-back"))
    s.register_namespace(NS)
    s.put_many([PutItem(key_for(i), payload_for(i), NS.id) for i in range(3)])
    real = s.nvme.put

    def full(writes):
        raise TierFullError("disk full (injected)")
    s.nvme.put = full
    with pytest.raises(TierFullError):
        s.flush()                                             # not durable: says so
    assert all(s.get(key_for(i)) == payload_for(i) for i in range(3))   # still readable from DRAM
    s.nvme.put = real
    s.flush()                                                 # and the next flush writes them
    s.close()
    s = open_store(tmp_path / "d", dram=False)
    assert all(s.get(key_for(i)) == payload_for(i) for i in range(3))
    s.close()


def _sparse_segment(tmp_path, nvme: NvmeConfig | None = None):
    """A store whose first segment holds one live block among seven deleted ones."""
    cfg = make_config(tmp_path / "d", dram=False)
    s = BlockStore(dataclasses.replace(cfg, nvme=nvme) if nvme else cfg)
    s.register_namespace(NS)
    s.put_many([PutItem(key_for(i), payload_for(i, 200 << 10), NS.id) for i in range(8)])
    s.flush()
    first = s.index.get(key_for(0))
    s.delete([key_for(i) for i in range(1, 8)])
    return s, first


def test_a_reader_racing_compactions_unlink_leaves_no_descriptor_behind(tmp_path, monkeypatch):
    s, first = _sparse_segment(tmp_path)
    stale = Placement(first.segment_id, first.offset, first.record_len, first.payload_len)
    real_unlink = os.unlink

    def unlink(path):
        if path == s.nvme.path(first.segment_id):             # a reader with pre-compaction metadata
            s.nvme.read_into(key_for(0), stale, bytearray(stale.payload_len))   # opens it just before
        real_unlink(path)
    monkeypatch.setattr(nvme_mod.os, "unlink", unlink)
    Collector(s)._compact_one(GcReport(), force=True)
    assert not os.path.exists(s.nvme.path(first.segment_id))
    assert first.segment_id not in s.nvme.readers._open     # no fd kept for a file that is gone
    assert s.get(key_for(0)) == payload_for(0, 200 << 10)
    s.close()


def test_compaction_syncs_its_copies_before_the_index_names_them(tmp_path, monkeypatch):
    """fsync "interval": the index is not synced per commit either, so its entries for the copies
    could reach the disk first; a power cut would then lose a block that was durable before."""
    s, _ = _sparse_segment(tmp_path, NvmeConfig(segment_bytes=1 << 20, fsync="interval", fsync_interval_s=3600))
    trace = []
    for name in ("fsync", "fdatasync"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda fd, real=real, name=name: (trace.append(name), real(fd))[1])
    real_commit = s.index.commit

    def commit(puts=None, **kw):
        if puts and any(m.segment_id == s.nvme.active_segment for m in puts.values()):
            trace.append("commit of the moved blocks")
        return real_commit(puts, **kw)
    monkeypatch.setattr(s.index, "commit", commit)
    Collector(s)._compact_one(GcReport(), force=True)
    moved = trace.index("commit of the moved blocks")
    assert any(t in ("fsync", "fdatasync") for t in trace[:moved]), trace
    assert s.get(key_for(0)) == payload_for(0, 200 << 10)
    s.close()


def test_a_torn_record_hiding_a_well_formed_one_is_never_indexed(tmp_path):
    """A put torn by a crash whose payload holds a complete record for another block: the
    rebuild's scan must not look for headers inside the torn record and index the one it holds
    (with a far-future creation time it would beat the victim's own record)."""
    import shutil
    from kvcache.kvstore.block_format import encode_header
    from kvcache.kvstore.types import raw_layout
    d, victim, good = tmp_path / "d", key_for(1), b"G" * 4096
    with open_store(d, dram=False) as s:
        assert s.put(victim, good, NS.id).durable
    evil = b"EVIL" * 256
    forged = encode_header(victim, NS.id, raw_layout(len(evil)), evil, len(evil), 2e9) + evil
    n = 64 << 10
    start = 4096 + len(encode_header(key_for(2), NS.id, raw_layout(n), bytes(n), n, 0.0))
    pad = (-start) % 8 + 64                                    # the embedded record on an aligned offset
    with open_store(d, dram=False) as s:
        s.put(key_for(2), bytes(pad) + forged + bytes(n - pad - len(forged)), NS.id)
        meta = s.index.get(key_for(2))
        assert meta.offset == 4096                             # the first record of a fresh segment
        path = s.nvme.path(meta.segment_id)
    with open(path, "r+b") as f:                               # the crash: the file ends past the forgery
        f.truncate(start + pad + len(forged) + 100)
    shutil.rmtree(d / "index")                                 # and the index is lost: a rebuild
    with open_store(d, dram=False) as s:
        assert s.get(victim) == good
        assert s.get(key_for(2)) is None
