"""Space set aside on the data directory's filesystem, so that a delete still works on a full disk.

A delete writes tombstones to a segment before the index forgets the blocks: an index
rebuilt from the segments after a crash must not bring deleted blocks back. On a full disk
that write fails, and a store that cannot delete can never free anything. So a few MiB are
kept in a preallocated file (real blocks, not a sparse hole) that only a delete may spend.
It is allocated once the filesystem's free space falls below TAKE_BELOW_FREE (a store on a
roomy disk keeps no such file: test suites open thousands of stores):

    free < TAKE_BELOW_FREE (checked on each put) ──> reserve.bin allocated
    put on a full disk ──> 507; the reserve is not touched (puts never spend it)
    delete on a full disk:
        tombstones ──ENOSPC──> release reserve.bin ──> tombstones again ──> index commit
    GC compacts, space is back (free >= 2 x reserve) ──> reserve.bin allocated again

The order of tombstone and index commit never changes: the reserve only makes room for it,
so crash safety is the same as on a disk with space. The store calls `release` under its
lock, so no put can take the released space before the delete that needed it.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
TAKE_BELOW_FREE = 1 << 30


class SpaceReserve:
    def __init__(self, path: str, nbytes: int):
        self.path, self.nbytes = path, nbytes
        self.held = nbytes > 0 and _size(path) >= nbytes     # kept from the last run

    def keep(self, free_bytes: int) -> None:
        """Called with the filesystem's free space: allocate the reserve when the disk runs low,
        if there is room for it and some to spare (no retry per put on a disk that is full)."""
        if not self.held and self.nbytes > 0 and 2 * self.nbytes <= free_bytes < TAKE_BELOW_FREE:
            self.take()

    def take(self) -> bool:
        """Allocate the reserve if it is not held; whether it is held now."""
        if self.held or self.nbytes <= 0:
            return self.held
        tmp = self.path + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.nbytes)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as e:          # the disk is full still: tried again when GC frees a segment
            log.info("no room yet for the %d-byte delete reserve %s: %s", self.nbytes, self.path, e.strerror)
            _unlink(tmp)
            return False
        self.held = True
        return True

    def release(self) -> bool:
        """Give the reserved space back to the filesystem; whether there was any to give."""
        if not self.held:
            return False
        _unlink(self.path)
        self.held = False
        log.warning("the disk under %s is full: the delete reserve was released so deletes can proceed; "
                    "free space or lower nvme.capacity_bytes", os.path.dirname(self.path))
        return True


def _size(path: str) -> int:
    try:
        return os.stat(path).st_blocks * 512        # allocated, not apparent, size
    except FileNotFoundError:
        return 0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
