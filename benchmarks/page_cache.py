"""Evicting files from the OS page cache, so that the next read of them comes from the device.

What the benchmarks do before timing a cold read: write dirty pages back first (DONTNEED
leaves dirty pages where they are), then posix_fadvise(DONTNEED) every file under a directory.
Pages a process still has mapped (an open LMDB index) stay resident: the kernel skips them.
"""

from __future__ import annotations

import os


def evict_page_cache(root: str) -> int:
    """Write back, then evict every file under `root`; how many files were evicted."""
    os.sync()
    n = 0
    for d, _, files in os.walk(root):
        for f in files:
            try:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
            except OSError:        # removed meanwhile, or not ours to read: nothing to evict
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n
