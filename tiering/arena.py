"""The DRAM tier's memory: one preallocated arena, private or shared with local clients.

    private:  mmap(-1)                            only this process sees it
    shared:   memfd_create(ALLOW_SEALING)
              -> mmap(fd, PROT_WRITE, MAP_SHARED)   the daemon's one writable view
              -> F_ADD_SEALS FUTURE_WRITE | SHRINK | GROW | SEAL
              -> open(/proc/self/fd/<fd>, O_RDONLY) the read-only description that local
                                                    clients receive over the control socket
                                                    (SCM_RIGHTS, after an accepted HELLO)

Why sealed: without it, any process that gets hold of the memfd (a client that was handed it, or
a process of the daemon's OS user reopening /proc/<pid>/fd/<fd> O_RDWR) could write into blocks
that the daemon serves from DRAM without checking them again. F_SEAL_FUTURE_WRITE makes every
write() and every new writable shared mapping of the inode fail with EPERM, whichever file
description it comes through, while the mapping made before the seal keeps writing; SEAL forbids
lifting it, SHRINK and GROW keep the size clients were told. So the bytes in a shared arena are
only ever the bytes the daemon itself copied in: a put's payload as its tenant sent it, or a
block promoted from NVMe or object storage after its checksums were verified there. That is why
DRAM reads need no re-verification. Needs Linux >= 5.1; an older kernel cannot share the arena
(dram.shared_memory = false), because an unsealed arena would let a reader forge blocks.

A memfd, not a file in /dev/shm: it has no name to clean up, so a daemon killed with SIGKILL
leaves nothing behind. Clients check the inode and size they were told, so an fd can never hand
them some other memory.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import logging
import os
from dataclasses import dataclass

from kvcache.kvstore.errors import StoreError
from kvcache.tiering.page_lock import CudaRuntime, load_cuda_runtime

log = logging.getLogger(__name__)

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)   # Python's fcntl lacks it before 3.13
SEALS = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@dataclass(frozen=True)
class ArenaInfo:
    """How a local client recognises a shared arena it received (the JSON of GET /v1/shm). pid
    and fd say where it lives in the daemon, for people; clients map the fd they are sent."""
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
        self.read_fd: int | None = None     # a read-only description of the memfd, for clients
        if shared:
            self.fd, self.buf = _sealed_memfd(size)
            self.read_fd = _read_only(self.fd)
        else:
            self.buf = mmap.mmap(-1, size)
        if prefault:
            self._prefault()
        self._pin_runtime, self._pin_addr = _pin(self.buf, pin_memory)
        self.pinned = self._pin_runtime is not None
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
        self._unpin()
        try:
            self.buf.close()
        except BufferError:
            return False
        finally:
            for fd in (self.fd, self.read_fd):
                if fd is not None:
                    os.close(fd)
            self.fd = self.read_fd = None
        return True


    def _unpin(self) -> None:
        """Unregister a page-locked arena before it is unmapped (once; a failure is only logged:
        the mapping goes either way)."""
        runtime, self._pin_runtime = self._pin_runtime, None
        if runtime is not None:
            rc = runtime.host_unregister(self._pin_addr)
            if rc != 0:
                log.warning("cudaHostUnregister failed with code %d while closing the DRAM arena", rc)


def _sealed_memfd(size: int) -> tuple[int, mmap.mmap]:
    """A memfd of `size` bytes, its writable mapping, and seals that leave it the only one."""
    if not hasattr(os, "memfd_create"):
        raise StoreError("dram.shared_memory needs Linux (memfd_create); set it to false")
    fd = os.memfd_create("kvcache-dram", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)   # before the seal
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        except OSError as e:
            buf.close()
            if e.errno != errno.EINVAL:
                raise
            raise StoreError(f"this kernel ({os.uname().release}) cannot seal the shared DRAM arena against "
                             "writes (F_SEAL_FUTURE_WRITE needs Linux >= 5.1), and an unsealed arena would let "
                             "local readers forge blocks; set dram.shared_memory = false") from None
    except BaseException:
        os.close(fd)
        raise
    return fd, buf


def _read_only(fd: int) -> int:
    """A read-only description of the memfd. Without /proc (a bare chroot), a duplicate of the
    writable one: the seal still refuses every write through it."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return os.dup(fd)


def _pin(buf: mmap.mmap, mode: str) -> tuple[CudaRuntime | None, int]:
    """Page-lock the arena for fast host->device copies; only CUDA can do that here. The runtime
    that registered it and the address (to unregister at close), or (None, 0): not pinned."""
    if mode == "off":
        return None, 0
    cudart = load_cuda_runtime()
    if cudart is None or cudart.device_count() == 0:
        if mode == "on":
            raise StoreError("dram.pin_memory = 'on' needs a CUDA device; use 'auto' or 'off' on CPU-only hosts")
        return None, 0
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    rc = cudart.host_register(addr, len(buf))
    if rc != 0:
        raise StoreError(f"cudaHostRegister failed with code {rc}; set dram.pin_memory = 'off'")
    return cudart, addr
