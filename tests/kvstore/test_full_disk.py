"""The store on a full disk: deletes still work (the delete reserve), GC evicts against what the
filesystem can really hold, and deleted blocks stay deleted through a rebuild. Where the machine
lets the test mount a small tmpfs (root), the disk is really full; elsewhere ENOSPC is injected."""

import errno
import os
import shutil
import subprocess

import pytest

from kvcache.gc.collector import Collector
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.errors import StoreError, TierFullError
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.types import PutItem
from kvcache.tiering.config import NvmeConfig
from kvcache.tiering.nvme import NvmeTier
from tests.tiering.faults_common import NS, key_for, payload_for


@pytest.fixture
def small_fs(tmp_path):
    """A mounted 32 MiB tmpfs, or a skip where mounting is not allowed."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _config(data_dir, reserve: int = 512 << 10, eviction: str = "segment-lru") -> StoreConfig:
    return StoreConfig(str(data_dir), dram=None, index_map_bytes=1 << 30,
                       nvme=NvmeConfig(segment_bytes=1 << 20, reserve_bytes=reserve, eviction=eviction))


def _open(data_dir, **kw) -> BlockStore:
    s = BlockStore(_config(data_dir, **kw), maintenance=Collector)     # puts make room, as in the daemon
    s.register_namespace(NS)
    return s


def _put(s: BlockStore, idxs, size: int = 32 << 10) -> None:
    for i in idxs:
        s.put_many([PutItem(key_for(i), payload_for(i, size), NS.id)])


def _fill_disk(path) -> None:
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


def _rebuilt(data_dir) -> BlockStore:
    shutil.rmtree(os.path.join(data_dir, "index"))
    return BlockStore(_config(data_dir), maintenance=Collector)


def test_gc_evicts_against_the_disk_when_it_is_smaller_than_configured(small_fs):
    s = _open(small_fs / "d")                          # nvme.capacity_bytes 64 GiB on a 32 MiB disk
    _put(s, range(1600))                               # 50 MiB of blocks: every put finds room
    [nvme] = [t for t in s.stats().tiers if t.tier == "nvme"]
    assert nvme.capacity_bytes <= 32 << 20             # stats show the bound GC works against
    assert s.stats_counters["evictions_nvme"] > 0
    assert s.get(key_for(1599)) == payload_for(1599, 32 << 10)
    s.close()


def test_a_delete_on_a_full_disk_frees_and_stays_deleted_after_a_rebuild(small_fs):
    data = small_fs / "d"
    s = _open(data)
    _put(s, range(40))
    s.pin([key_for(i) for i in range(40)])             # nothing to evict: the put below gets no room
    assert s.nvme.reserve.held                         # a small disk: the reserve is set aside
    _fill_disk(small_fs / "filler")
    with pytest.raises(TierFullError):                 # puts get 507 ...
        s.put_many([PutItem(key_for(1000), payload_for(1000, 256 << 10), NS.id)])
    assert s.delete([key_for(i) for i in range(10)]) == 10    # ... deletes still work
    assert not s.nvme.reserve.held
    assert s.get(key_for(0)) is None
    os.unlink(small_fs / "filler")
    s.close()
    s = _rebuilt(data)                                 # the tombstones reached the disk
    assert [s.get(key_for(i)) is None for i in range(12)] == [True] * 10 + [False] * 2
    s.close()


def test_a_delete_spends_the_reserve_when_tombstones_meet_enospc(tmp_path, monkeypatch):
    """The same without a mount: ENOSPC at the write syscall while the reserve is held."""
    data = tmp_path / "d"
    s = _open(data)
    _put(s, range(6), size=4096)
    assert s.nvme.reserve.take()
    real = NvmeTier._pwrite_all

    def pwrite(fd, bufs, offset):
        if s.nvme.reserve.held:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, bufs, offset)
    monkeypatch.setattr(NvmeTier, "_pwrite_all", staticmethod(pwrite))
    with pytest.raises(TierFullError):
        s.put(key_for(100), payload_for(100, 4096), NS.id)
    assert s.delete([key_for(0), key_for(1)]) == 2
    assert not os.path.exists(s.nvme.reserve.path)
    monkeypatch.setattr(NvmeTier, "_pwrite_all", staticmethod(lambda fd, bufs, offset: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device"))))
    with pytest.raises(TierFullError, match="disk is full"):   # no reserve left: the delete says so
        s.delete([key_for(2)])
    monkeypatch.setattr(NvmeTier, "_pwrite_all", staticmethod(real))
    s.close()
    s = _rebuilt(data)
    assert [s.get(key_for(i)) is None for i in range(4)] == [True, True, False, False]
    s.close()


def _namespaces_json(data_dir) -> dict:
    import json
    path = os.path.join(data_dir, "nvme", "namespaces.json")
    return json.load(open(path)) if os.path.exists(path) else {}


NS2 = type(NS)("other-model@rev1", "raw/v1", 16, name="other")


@pytest.mark.parametrize("err,raised", [(errno.ENOSPC, TierFullError), (errno.EROFS, StoreError)])
def test_a_namespace_that_cannot_be_persisted_is_not_registered(tmp_path, monkeypatch, err, raised):
    s = _open(tmp_path / "d")
    real = os.replace

    def replace(src, dst):
        raise OSError(err, os.strerror(err))
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(raised, match="full; free space" if err == errno.ENOSPC else "read-only; remount"):
        s.register_namespace(NS2)
    assert NS2.id not in s.namespaces and NS2.id not in s.index.namespaces()
    assert NS2.id.hex() not in _namespaces_json(tmp_path / "d")
    assert not os.path.exists(tmp_path / "d" / "nvme" / "namespaces.json.tmp")
    monkeypatch.setattr(os, "replace", real)
    assert s.register_namespace(NS2) == NS2.id          # the next registration does persist it
    assert NS2.id.hex() in _namespaces_json(tmp_path / "d") and NS2.id in s.index.namespaces()
    s.close()


def test_a_namespace_registered_on_a_full_disk_is_refused_then_registered(small_fs):
    s = _open(small_fs / "d")
    _fill_disk(small_fs / "filler")
    s.nvme.reserve.release()
    _fill_disk(small_fs / "filler2")
    with pytest.raises(TierFullError):
        s.register_namespace(NS2)
    assert NS2.id not in s.namespaces
    os.unlink(small_fs / "filler")
    s.register_namespace(NS2)
    _put(s, [0])                                         # a segment, so that a lost index is rebuilt
    s.close()
    s = BlockStore(_config(small_fs / "d"), maintenance=Collector)
    assert NS2.id in s.namespaces
    s.close()
    shutil.rmtree(small_fs / "d" / "index")             # a rebuild knows it from namespaces.json
    s = BlockStore(_config(small_fs / "d"), maintenance=Collector)
    assert NS2.id in s.namespaces
    s.close()


async def test_the_daemon_answers_507_for_a_namespace_on_a_full_disk(tmp_path, monkeypatch):
    from aiohttp.test_utils import TestClient, TestServer

    from kvcache.server.app import build_app
    from kvcache.server.config import ServerConfig, TokenInfo
    store = _open(tmp_path / "d")
    cfg = ServerConfig(tokens=(TokenInfo("a" * 32, "alice"),))
    monkeypatch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    async with TestClient(TestServer(build_app(store, cfg))) as c:
        r = await c.post("/v1/namespaces", json=NS2.to_dict(), headers={"Authorization": "Bearer " + "a" * 32})
        assert r.status == 507
        body = await r.json()
        assert body["error"] == "insufficient_storage" and "free space" in body["message"]
        monkeypatch.undo()
        r = await c.post("/v1/namespaces", json=NS2.to_dict(), headers={"Authorization": "Bearer " + "a" * 32})
        assert r.status == 200
    store.close()


def test_puts_find_room_again_on_a_full_disk_whose_segments_are_partly_dead(small_fs):
    """Segments 60% live on a disk with no free space: compaction has nowhere to copy to, so the
    sparsest segment's blocks are evicted and the segment dropped without a copy."""
    s = _open(small_fs / "d")
    _put(s, range(300))                                 # ~10 MiB in 1 MiB segments
    s.pin([key_for(i) for i in range(2, 300, 5)])       # pinned blocks are never evicted
    assert s.delete([key_for(i) for i in range(300) if i % 5 in (0, 1)]) == 120
    _fill_disk(small_fs / "filler")                     # something else takes the rest of the disk
    for i in range(1000, 1010):                         # was 507 on every put: no room to compact
        _put(s, [i])
        assert s.get(key_for(i)) == payload_for(i, 32 << 10)
    assert s.stats_counters["evictions_nvme"] > 0
    assert all(s.get(key_for(i)) == payload_for(i, 32 << 10) for i in range(2, 300, 5))
    assert all(s.get(key_for(i)) in (None, payload_for(i, 32 << 10)) for i in range(300))
    s.close()


def test_a_full_disk_drops_an_unpinned_segment_rather_than_a_mostly_pinned_sparser_one(small_fs):
    """The sparsest segment is mostly pinned, and its pinned blocks do not fit in the free space:
    GC leaves it alone (evicting its unpinned blocks would lose them and gain nothing) and drops
    the next candidate, whose blocks are all unpinned (the sampled rule: segment-lru would
    evict the first segment's two old unpinned blocks too)."""
    s = _open(small_fs / "d", eviction="sampled-lru")
    _put(s, range(100))
    by_segment: dict[int, list[int]] = {}
    for i in range(100):
        by_segment.setdefault(s.index.get(key_for(i)).segment_id, []).append(i)
    first, second = (by_segment[sid] for sid in sorted(by_segment)[:2])
    pinned, unpinned = first[:20], first[20:]
    s.pin([key_for(i) for i in pinned])
    assert s.delete([key_for(i) for i in unpinned[2:]]) == len(unpinned) - 2   # the sparsest segment
    assert s.nvme.reserve.held
    _fill_disk(small_fs / "filler")
    _put(s, [1000])                                      # was a 507, after evicting unpinned[:2]
    assert s.get(key_for(1000)) == payload_for(1000, 32 << 10)
    assert all(s.get(key_for(i)) == payload_for(i, 32 << 10) for i in pinned + unpinned[:2])
    assert all(s.get(key_for(i)) is None for i in second)   # the segment dropped instead
    s.close()


def test_a_forced_compaction_copies_when_the_free_space_is_unknown(tmp_path, monkeypatch):
    """statvfs failing (free_bytes -1) is not a full disk: make_room compacts the sparsest segment
    by copying its live blocks forward, and evicts none of them."""
    s = _open(tmp_path / "d")
    _put(s, range(100))                                  # ~3 MiB in 1 MiB segments
    first = s.index.get(key_for(0)).segment_id
    in_first = [i for i in range(100) if s.index.get(key_for(i)).segment_id == first]
    assert s.delete([key_for(i) for i in in_first[::2]]) == len(in_first[::2])   # the sparsest segment
    kept = [i for i in range(100) if i not in in_first[::2]]
    monkeypatch.setattr(s.nvme, "free_bytes", lambda: -1)
    r = Collector(s).make_room()
    assert r.evicted == 0 and r.segments_compacted == 1 and r.segments_removed == 1
    assert first not in s.nvme.segment_ids()
    assert all(s.get(key_for(i)) == payload_for(i, 32 << 10) for i in kept)
    assert s.stats_counters.get("evictions_nvme", 0) == 0
    s.close()
