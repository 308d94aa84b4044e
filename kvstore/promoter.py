"""Background promotion of NVMe blocks into DRAM, while the store is idle.

A local client that read blocks straight from the segment files (client/shm_files.py) will
likely read them again; their next read is cheaper from DRAM (no checksum, no syscall). But
the copy must not compete with reads in progress: on a small machine a promotion thread takes
the GIL and a core from the control threads answering the client, which halved the reads it
was meant to help. So blocks queue here and are copied only once no read came for `idle_s`.

    note_read() ── every shared read ──> last_read = now
    submit(blocks) ── bounded queue (oldest dropped) ──> worker: wait until idle, promote one
                                                          block, yield, repeat
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable


class Promoter:
    def __init__(self, promote: Callable[[bytes, object], object], max_queued: int = 65536,
                 idle_s: float = 0.05, clock: Callable[[], float] = time.monotonic):
        self._promote, self._idle_s, self._clock = promote, idle_s, clock
        self._queue: collections.deque = collections.deque(maxlen=max_queued)
        self._wake = threading.Condition()
        self._last_read = 0.0
        self._closed = False
        self.promoted = 0
        self._thread = threading.Thread(target=self._run, name="kvcache-promote", daemon=True)
        self._thread.start()

    def note_read(self) -> None:
        self._last_read = self._clock()

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
            wait = self._last_read + self._idle_s - self._clock()
            if wait > 0:
                time.sleep(wait)
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
