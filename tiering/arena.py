"""The DRAM tier's memory: one preallocated arena, private or shared with local clients.

    private:  mmap(-1)                       only this process sees it
    shared:   memfd_create -> mmap(fd)       local clients open /proc/<pid>/fd/<fd> read-only
                                             and copy payloads out themselves (docs/api.md, /v1/shm)

A shared arena is a memfd, not a file in /dev/shm: it has no name to clean up, so a daemon
killed with SIGKILL leaves nothing behind, and only processes allowed to read the daemon's
/proc entries (same user, not hardened away) can map it. Clients check the inode and size they
were told, so a recycled pid can never hand them some other process's memory.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass

from kvcache.kvstore.errors import StoreError


@dataclass(frozen=True)
class ArenaInfo:
    """What a local client needs to map a shared arena (the JSON of GET /v1/shm)."""
    pid: int
    fd: int
    size: int
    inode: int

    @property
    def path(self) -> str:
        return f"/proc/{self.pid}/fd/{self.fd}"


class Arena:
    def __init__(self, size: int, *, shared: bool = False, prefault: bool = True, pin_memory: str = "off"):
        self.size = size
        self.fd: int | None = None
        if shared:
            if not hasattr(os, "memfd_create"):
                raise StoreError("dram.shared_memory needs Linux (memfd_create); set it to false")
            self.fd = os.memfd_create("kvcache-dram", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, size)
            self.buf = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        else:
            self.buf = mmap.mmap(-1, size)
        if prefault:
            self._prefault()
        self.pinned = _pin(self.buf, pin_memory)
        self.view = memoryview(self.buf)

    @property
    def shared(self) -> bool:
        return self.fd is not None

    def info(self) -> ArenaInfo | None:
        if self.fd is None:
            return None
        return ArenaInfo(os.getpid(), self.fd, self.size, os.fstat(self.fd).st_ino)

    def _prefault(self) -> None:
        """Touch every page now: fresh memory is slow to touch on our VMs, and a put must not pay for it."""
        try:  # Linux >= 5.14; Python 3.11's mmap module lacks the constant
            self.buf.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))
        except (OSError, ValueError):
            zeros = bytes(1 << 20)
            for off in range(0, len(self.buf), len(zeros)):
                n = min(len(zeros), len(self.buf) - off)
                self.buf[off: off + n] = zeros[:n]

    def close(self) -> bool:
        """Release the mapping; False if a caller still holds a view (the GC frees it later)."""
        self.view.release()
        try:
            self.buf.close()
        except BufferError:
            return False
        finally:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
        return True


def _pin(buf: mmap.mmap, mode: str) -> bool:
    """Page-lock the arena for fast host->device copies; only CUDA can do that here."""
    if mode == "off":
        return False
    try:  # lazy: the store never needs torch
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        if mode == "on":
            raise StoreError("dram.pin_memory = 'on' needs a CUDA device; use 'auto' or 'off' on CPU-only hosts")
        return False
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    rc = torch.cuda.cudart().cudaHostRegister(addr, len(buf), 0)
    if int(rc) != 0:
        raise StoreError(f"cudaHostRegister failed with code {int(rc)}; set dram.pin_memory = 'off'")
    return True
