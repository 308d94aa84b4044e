"""The NVMe tier's shared read descriptors: never closed under a read in flight."""

import os

import pytest

from kvcache.tiering.segment_readers import SegmentReaders


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
        return False
    except OSError:
        return True


def test_a_descriptor_evicted_or_dropped_mid_read_stays_open_until_the_read_ends(tmp_path):
    for i in range(4):
        (tmp_path / f"{i}.seg").write_bytes(bytes([i]) * 64)
    readers = SegmentReaders(lambda sid: str(tmp_path / f"{sid}.seg"), limit=2)
    with readers.open(0) as fd0:
        with readers.open(1), readers.open(2):       # over the limit: segment 0's descriptor is evicted
            pass
        assert os.pread(fd0, 4, 0) == b"\x00" * 4   # still segment 0's, still open (EBADF before)
    assert _closed(fd0)                              # closed by the read that held it
    with readers.open(3) as fd3:
        readers.drop(3)                              # the segment is being removed
        assert os.pread(fd3, 1, 0) == b"\x03"
    assert _closed(fd3)
    with readers.open(2) as fd2:                     # still cached: the same descriptor, reused
        with readers.open(2) as again:
            assert again == fd2
    readers.close_all()
    assert _closed(fd2)
    with readers.open(9) as missing:
        assert missing is None


@pytest.mark.parametrize("limit", [1, 3])
def test_many_readers_never_read_a_closed_or_reused_descriptor(tmp_path, limit):
    import threading
    for i in range(8):
        (tmp_path / f"{i}.seg").write_bytes(bytes([i]) * 4096)
    readers = SegmentReaders(lambda sid: str(tmp_path / f"{sid}.seg"), limit=limit)
    errors = []

    def work(t):
        for j in range(300):
            sid = (t * 7 + j) % 8
            with readers.open(sid) as fd:
                if os.pread(fd, 4096, 0) != bytes([sid]) * 4096:
                    errors.append(sid)
    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    readers.close_all()
    assert not errors
