"""The baselines and timing helpers of the store benchmarks (`kvcache bench tiers`, `kvcache bench
daemon`): what a tier is measured against (memcpy, write()+fdatasync, pread()) and how ops
share a noisy machine fairly (interleaved, rotating order).
"""

from __future__ import annotations

import mmap
import os
import statistics
import tempfile
import time
from typing import Callable


def median_s(fn: Callable[[], object], runs: int) -> float:
    """Median seconds of `runs` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleave(acc: dict[str, float], steps: dict[str, Callable[[], object]], j: int) -> None:
    """Time each step once, adding to acc; batch j starts at step j, so each op runs
    first, middle and last equally often and bursts of noise hit all ops alike, and odd
    batches run the cycle backwards, so each op also runs before and after each other op
    about equally often (the first to read bytes another process just wrote pays for cold caches)."""
    names = list(steps)
    if j % 2:
        names.reverse()
    for name in names[j % len(names):] + names[: j % len(names)]:
        t0 = time.perf_counter()
        steps[name]()
        acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0


def dest_buffer(size: int) -> memoryview:
    """The buffer a benchmark reads into, every side alike: `size` bytes, touched, starting half
    a page past a page boundary. Where it starts matters. A copy of up to a few hundred KiB whose
    destination starts 1-63 bytes past where its source does, within a 4 KiB page, ran at ~2.4
    GB/s on the VM this was written on, against 5.5-7.5 GB/s at any other distance (the copy's
    loads alias its recent stores in the CPU's 4 KiB address check; memoryview, numpy and memmove
    alike). The sources here sit near a page's start: DRAM arena chunks and the page cache at 0,
    a large bytes object at 48, a large bytearray or numpy array at 16 (mmap'd by malloc). A
    destination at 64 made the memcpy baseline 2.5x slower; one at 16 did that to the daemon's
    reads; half a page is far from all of them."""
    buf = memoryview(mmap.mmap(-1, size + 4096))[2048: 2048 + size]
    buf[:] = bytes(size)
    return buf


def copy_each(blocks: list[memoryview], dst: memoryview) -> None:
    for b in blocks:
        dst[:] = b


def copy_all(blocks: list[memoryview], region: memoryview) -> None:
    pos = 0
    for b in blocks:
        region[pos: pos + b.nbytes] = b
        pos += b.nbytes


def raw_write(fd: int, blocks: list[memoryview]) -> None:
    """The baseline put: write() each block, then one fdatasync for the batch."""
    for b in blocks:
        if os.write(fd, b) != b.nbytes:
            raise RuntimeError("short write in the raw baseline")
    os.fdatasync(fd)


def raw_read(fd: int, dst: memoryview, offset: int, n: int) -> None:
    for i in range(n):
        if os.preadv(fd, [dst], offset + i * dst.nbytes) != dst.nbytes:
            raise RuntimeError("short read in the raw baseline")


def scratch_dir(data_dir: str | None) -> str:
    """A fresh directory for the run's files inside `data_dir` (default: the current directory,
    so the disk measured is the one you run from; /tmp is often tmpfs)."""
    parent = data_dir or os.getcwd()
    if data_dir is None and not os.access(parent, os.W_OK):
        parent = tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=".kvcache-bench-", dir=parent)
