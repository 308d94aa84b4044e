"""Environment faults: full disk, read-only directories, failed opens, a second process.

They surface as StoreError subclasses with a clear message and never lose acknowledged
blocks. The disk-full and read-only cases mount a tmpfs (root only); they skip where mount fails.
"""


from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvcache.gc.fsck import check
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.errors import (
    StoreError, StoreLockedError, TierFullError,
)
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.types import PutItem
from kvcache.tiering.config import DramConfig, NvmeConfig

from tests.tiering.faults_common import NS, key_for, payload_for, make_config, open_store, fill


# ------------------------------------------------------------------ environment faults

def _mount(args: list[str], target) -> None:
    os.makedirs(target, exist_ok=True)
    try:
        r = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot run mount: {e}")
    if r.returncode != 0:
        pytest.skip(f"cannot mount here (needs root): {r.stderr.strip()}")


def _umount(target) -> None:
    subprocess.run(["umount", str(target)], capture_output=True)
    if os.path.ismount(str(target)):
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


@pytest.fixture
def tiny_nvme(tmp_path):
    """A data directory whose NVMe tier lives on a 2 MiB tmpfs (the index stays on disk)."""
    data = tmp_path / "d"
    nvme = data / "nvme"
    _mount(["-t", "tmpfs", "-o", "size=2m", "tmpfs"], nvme)
    yield data
    _umount(nvme)


def _fill_disk(path) -> None:
    """Write a filler file until the filesystem has no byte left."""
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT, 0o644)
    chunk = bytes(4096)
    try:
        while True:
            try:
                os.write(fd, chunk)
            except OSError as e:
                if e.errno != 28:
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)


def test_full_disk_refuses_puts_loses_nothing_and_recovers(tiny_nvme):
    data = tiny_nvme
    with open_store(data) as s:
        fill(s, range(12))  # ~0.3 MiB in segment 1
        # pinned: a put that finds the disk full has GC evict unpinned blocks first (the bound is the
        # filesystem's room, not nvme.capacity_bytes); what is checked here is that nothing else goes
        s.pin([key_for(i) for i in range(12)])
        _fill_disk(data / "nvme" / "filler")
        with pytest.raises(TierFullError, match="disk is full"):
            s.put(key_for(100), payload_for(100, 20_000), NS.id)
        with pytest.raises(TierFullError, match="disk is full"):
            s.put_many([PutItem(key_for(i), payload_for(i, 3000), NS.id) for i in (101, 102)])
        assert s.lookup([key_for(100)]).num_hits == 0 and s.get(key_for(101)) is None
        assert all(s.get(key_for(i)) == payload_for(i) for i in range(12))
        try:  # a delete on a full disk either happens or is refused: never half done
            s.delete([key_for(11)])
            deleted = True
        except TierFullError:
            deleted = False
        assert (s.get(key_for(11)) is None) == deleted and s.contains(key_for(11)) != deleted

        os.unlink(data / "nvme" / "filler")  # free the space: puts work again
        fill(s, [11])  # (back, if the delete went through)
        s.put(key_for(100), payload_for(100, 20_000), NS.id)
        fill(s, range(101, 110))
        assert s.get(key_for(100)) == payload_for(100, 20_000)
        assert not check(s).bad_blocks
    with open_store(data) as s:
        assert all(s.get(key_for(i)) == payload_for(i) for i in [*range(12), *range(101, 110)])
        assert s.get(key_for(100)) == payload_for(100, 20_000)
        assert not check(s).bad_blocks


def test_full_disk_keeps_puts_atomic_as_it_fills(tiny_nvme):
    """Puts on a disk that fills on its own: GC evicts to make room (a whole segment where the
    disk has no room to compact), so an acknowledged block reads back whole or is a miss, a
    failed put is absent, and nothing half-written is ever read back."""
    data = tiny_nvme
    acked, failed = [], []
    size = lambda i: 30_000 + 97 * i          # noqa: E731
    with open_store(data) as s:
        for i in range(120):
            try:
                s.put(key_for(i), payload_for(i, size(i)), NS.id)
                acked.append(i)
            except TierFullError as e:
                assert "disk is full" in str(e)
                failed.append(i)
        assert len(acked) > 90 and s.stats_counters["evictions_nvme"] > 0    # 2 MiB took 4 MiB
        assert all(s.get(key_for(i)) is None for i in failed)
        held = [i for i in acked if s.get(key_for(i)) is not None]
        assert held and acked[-1] in held
        assert all(s.get(key_for(i)) == payload_for(i, size(i)) for i in held)
    with open_store(data) as s:
        assert all(s.get(key_for(i)) in (None, payload_for(i, size(i))) for i in acked)
        assert all(s.get(key_for(i)) is None for i in failed) and not check(s).bad_blocks


def test_full_disk_when_the_put_needs_a_new_segment(tiny_nvme):
    data = tiny_nvme
    with open_store(data) as s:
        fill(s, range(12))
        _fill_disk(data / "nvme" / "filler")
        with pytest.raises(TierFullError, match="disk is full"):  # 1 MiB segment: needs a new one
            s.put(key_for(100), payload_for(100, 1_000_000), NS.id)


@pytest.fixture
def mounts():
    done = []
    yield lambda args, target: (_mount(args, target), done.append(target))
    for target in reversed(done):
        _umount(target)


def test_read_only_data_directory_is_a_clear_store_error(tmp_path, mounts):
    src, ro = tmp_path / "src", tmp_path / "ro"
    with open_store(src) as s:
        fill(s, range(5))
    mounts(["--bind", str(src)], ro)
    r = subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
    with pytest.raises(StoreError, match="Read-only file system") as e:
        BlockStore(make_config(ro))
    assert str(ro) in str(e.value)
    assert not isinstance(e.value, StoreLockedError)
    with open_store(src) as s:  # the failed open left nothing locked or damaged behind
        assert all(s.get(key_for(i)) == payload_for(i) for i in range(5))


def test_read_only_empty_filesystem_is_a_clear_store_error(tmp_path, mounts):
    ro = tmp_path / "ro"
    mounts(["-t", "tmpfs", "-o", "ro,size=1m", "tmpfs"], ro)
    for data in (ro, ro / "missing" / "data"):
        with pytest.raises(StoreError, match="Read-only file system") as e:
            BlockStore(make_config(data))
        assert str(data) in str(e.value)


def test_read_only_nvme_directory_is_a_clear_store_error(tmp_path, mounts):
    data = tmp_path / "d"
    with open_store(data) as s:
        fill(s, range(5))
    mounts(["--bind", str(data / "nvme")], data / "nvme")
    r = subprocess.run(["mount", "-o", "remount,bind,ro", str(data / "nvme")], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
    with pytest.raises(StoreError, match="not writable") as e:
        BlockStore(make_config(data))
    assert str(data / "nvme") in str(e.value)


def test_failed_open_can_be_retried_in_the_same_process(tmp_path):
    import gc
    data = tmp_path / "d"
    with open_store(data) as s:
        fill(s, range(3))
    bad = StoreConfig(str(data), dram=DramConfig(capacity_bytes=1 << 20, page_bytes=1 << 20, prefault=False,
                                                 pin_memory="on"), nvme=NvmeConfig(segment_bytes=1 << 20))
    gc.disable()  # the cycle collector must not be what makes a retry work
    try:
        try:
            BlockStore(bad)
        except StoreError:
            pass  # refused: no CUDA here (if CUDA exists the store opens and the test proves nothing)
        else:
            pytest.skip("pin_memory='on' works on this host")
        with open_store(data) as s:  # the user fixes the config and tries again
            assert all(s.get(key_for(i)) == payload_for(i) for i in range(3))
    finally:
        gc.enable()
        gc.collect()


def test_close_releases_the_data_dir_even_if_an_arena_view_is_alive(tmp_path):
    data = tmp_path / "d"
    s = open_store(data)
    fill(s, range(3))
    with s.dram.view(key_for(0)) as mv:
        escaped = mv[:16]  # a view that outlives its `with` (as a traceback's frame would keep it)
    try:
        s.close()
    except BufferError:
        pass  # tolerable; leaving the directory locked is not
    with open_store(data) as s2:  # same process: the lock and the index must have been released
        assert all(s2.get(key_for(i)) == payload_for(i) for i in range(3))
    del escaped


def test_missing_parent_directories_are_created(tmp_path):
    data = tmp_path / "a" / "b" / "c" / "data"
    with open_store(data) as s:
        fill(s, range(3))
    with open_store(data) as s:
        assert all(s.get(key_for(i)) == payload_for(i) for i in range(3))


def test_data_directory_that_is_a_file_is_a_clear_store_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    for data in (tmp_path / "file", tmp_path / "file" / "data"):
        with pytest.raises(StoreError, match="cannot use data directory") as e:
            BlockStore(make_config(data))
        assert str(data) in str(e.value)


_HOLDER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    from test_faults import open_store
    with open_store({data!r}):
        print("READY", flush=True)
        sys.stdin.readline()
""")


def test_second_process_gets_store_locked_error(tmp_path):
    data = tmp_path / "d"
    with open_store(data) as s:
        fill(s, range(3))
    code = _HOLDER.format(here=os.path.dirname(os.path.abspath(__file__)), data=str(data))
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "READY", holder.stderr.read()
        for _ in range(2):  # refused every time, and a refusal does not disturb the holder
            with pytest.raises(StoreLockedError) as e:
                BlockStore(make_config(data))
            msg = str(e.value)
            assert str(data) in msg and f"pid {holder.pid}" in msg, msg
        assert isinstance(e.value, StoreError)
    finally:
        out, err = holder.communicate("\n", timeout=60)
    assert holder.returncode == 0, err
    with open_store(data) as s:  # the holder is gone: the directory is free again
        assert all(s.get(key_for(i)) == payload_for(i) for i in range(3))
