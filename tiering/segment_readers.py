"""Read descriptors of the NVMe tier's segment files, shared by concurrent reads.

At most `limit` stay open (least recently opened closed first). A descriptor is closed only
when no read is using it: one evicted, or whose segment is removed, while reads are in flight
is closed by the last of those reads. Closing it under a read made its preadv fail with EBADF,
or read another segment that had reused the descriptor number, and the healthy block it was
reading was quarantined as corrupt.

    open(sid) ─> users += 1 ─> pread ... ─> users -= 1 ─> detached and users == 0 ? close
    evict / drop(sid): out of the table; closed now if users == 0, else detached
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Callable, Iterator


@dataclass
class _Fd:
    fd: int
    users: int = 0
    detached: bool = False


class SegmentReaders:
    def __init__(self, path_of: Callable[[int], str], limit: int = 256):
        self._path_of, self._limit = path_of, limit
        self._lock = threading.Lock()
        self._open: dict[int, _Fd] = {}

    @contextlib.contextmanager
    def open(self, segment_id: int) -> Iterator[int | None]:
        """A read descriptor for the segment for the duration of the block (None: no such file)."""
        with self._lock:
            entry = self._open.get(segment_id)
            if entry is None:
                try:
                    entry = _Fd(os.open(self._path_of(segment_id), os.O_RDONLY))
                except FileNotFoundError:
                    entry = None
                else:
                    while len(self._open) >= self._limit:
                        self._detach(self._open.pop(next(iter(self._open))))
                    self._open[segment_id] = entry
            if entry is not None:
                entry.users += 1
        if entry is None:
            yield None
            return
        try:
            yield entry.fd
        finally:
            with self._lock:
                entry.users -= 1
                if entry.detached and entry.users == 0:
                    os.close(entry.fd)

    def drop(self, segment_id: int) -> None:
        """The segment is going away: its descriptor closes once no read uses it."""
        with self._lock:
            entry = self._open.pop(segment_id, None)
            if entry is not None:
                self._detach(entry)

    def close_all(self) -> None:
        with self._lock:
            for entry in self._open.values():
                self._detach(entry)
            self._open.clear()

    @staticmethod
    def _detach(entry: _Fd) -> None:
        entry.detached = True
        if entry.users == 0:
            os.close(entry.fd)
