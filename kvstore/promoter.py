"""Background promotion of NVMe blocks into DRAM, while the store is idle.

A local client that read blocks straight from the segment files (client/shm_files.py) will
likely read them again; their next read is cheaper from DRAM (no checksum, no syscall). But
the copy must not compete with reads in progress: on a small machine a promotion thread takes
the GIL and a core from the control threads answering the client, which halved the reads it
was meant to help. So blocks queue here and are copied only once the store is quiet: no read
came for `idle_s`, and the client has had time to read what it was last given.

    note_read(nbytes) ── every shared read ──> busy_until = max(busy_until, now) + nbytes / SLOW_READ
                                               quiet_from = busy_until + idle_s
    submit(blocks) ── bounded queue (oldest dropped) ──> worker: wait until quiet_from, promote
                                                          one block, yield, repeat

The second term matters on a cold page cache: a client reading a lease's blocks (MiBs) from disk asks
for its next lease tens of milliseconds later, past `idle_s`, and a promotion that starts then
reads the same disk. On the 2-core VM that cut cold reads of 1 MiB blocks from ~2 GB/s to 0.6.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

SLOW_READ_BYTES_PER_S = 500e6    # how fast a client reads its file slots at worst (a slow disk)
POLL_S = 0.01                    # the worker looks at the clock again at least this often


class Promoter:
    def __init__(self, promote: Callable[[bytes, object], object], max_queued: int = 65536,
                 idle_s: float = 0.05, clock: Callable[[], float] = time.monotonic):
        self._promote, self._idle_s, self._clock = promote, idle_s, clock
        self._queue: collections.deque = collections.deque(maxlen=max_queued)
        self._wake = threading.Condition()
        self._busy_until = self._quiet_from = 0.0
        self._note = threading.Lock()     # control threads note reads concurrently
        self._closed = False
        self.promoted = 0
        self._thread = threading.Thread(target=self._run, name="kvcache-promote", daemon=True)
        self._thread.start()

    def note_read(self, nbytes: int = 0) -> None:
        """A shared read began; `nbytes`: what the client will read from the segment files. A
        client keeps one lease in flight ahead of its reads, so their read times add up."""
        now = self._clock()
        with self._note:
            self._busy_until = max(self._busy_until, now) + nbytes / SLOW_READ_BYTES_PER_S
            self._quiet_from = self._busy_until + self._idle_s

    def submit(self, blocks: list[tuple[bytes, object]]) -> None:
        with self._wake:
            self._queue.extend(blocks)
            self._wake.notify()

    def pending(self) -> int:
        return len(self._queue)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
            wait = self._quiet_from - self._clock()
            if wait > 0:
                time.sleep(min(wait, POLL_S))
                continue
            try:
                key, meta = self._queue.popleft()
            except IndexError:
                continue
            self._promote(key, meta)
            self.promoted += 1
            time.sleep(0)            # let a control thread that wants the GIL have it now

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=5)
