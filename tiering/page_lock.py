"""Page-locking host memory for fast host-to-device copies: cudaHostRegister, reached through ctypes.

The store never loads torch (tests/test_layering.py), so the CUDA runtime is found by hand, in
this order: the dynamic linker's cache (ctypes.util.find_library), the runtime's sonames (found
through LD_LIBRARY_PATH, or already loaded by torch in this process), then the pip wheels'
`nvidia/*/lib` directories (nvidia-cuda-runtime: `nvidia/cuda_runtime/lib`), located with
importlib.util.find_spec, which imports nothing; the first of them that sees a device is used.
No library, or no device behind any, means memory stays pageable: the caller decides whether
that is an error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
from dataclasses import dataclass
from typing import Iterator

SONAMES = ("libcudart.so.12", "libcudart.so.13", "libcudart.so")


@dataclass(frozen=True)
class CudaRuntime:
    """The calls of libcudart that page-locking needs."""
    lib: ctypes.CDLL

    def device_count(self) -> int:
        """Visible CUDA devices; 0 when the runtime finds no driver or no device."""
        n = ctypes.c_int(0)
        return n.value if self.lib.cudaGetDeviceCount(ctypes.byref(n)) == 0 else 0

    def host_register(self, addr: int, size: int) -> int:
        """cudaHostRegister(addr, size, cudaHostRegisterDefault); its cudaError_t (0: success)."""
        return self.lib.cudaHostRegister(ctypes.c_void_p(addr), ctypes.c_size_t(size), ctypes.c_uint(0))

    def host_unregister(self, addr: int) -> int:
        """cudaHostUnregister(addr): before the memory is unmapped, or a later mapping at the same
        address cannot be registered (cudaErrorHostMemoryAlreadyRegistered); its cudaError_t."""
        return self.lib.cudaHostUnregister(ctypes.c_void_p(addr))


def load_cuda_runtime() -> CudaRuntime | None:
    """The first CUDA runtime that loads, has both calls and sees a device; else the first that
    loads (it sees no device), or None. A runtime newer than the driver sees no device
    (cudaErrorInsufficientDriver) where an older one on the same host does: a system toolkit's
    libcudart.so.13 found first, beside a driver for CUDA 12 and torch's wheel runtime."""
    first = None
    for name in dict.fromkeys(_candidates()):       # in order, each name once
        runtime = _open(name)
        if runtime is None:
            continue
        if runtime.device_count() > 0:
            return runtime
        first = first or runtime
    return first


def _open(name: str) -> CudaRuntime | None:
    try:
        lib = ctypes.CDLL(name)
        lib.cudaGetDeviceCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError):    # not there, or a library without the runtime's calls
        return None
    lib.cudaGetDeviceCount.restype = lib.cudaHostRegister.restype = lib.cudaHostUnregister.restype = ctypes.c_int
    return CudaRuntime(lib)


def _candidates() -> Iterator[str]:
    found = ctypes.util.find_library("cudart")
    if found:
        yield found
    yield from SONAMES
    yield from _wheel_libraries()


def _wheel_libraries() -> list[str]:
    """libcudart files shipped in the `nvidia` namespace package of the CUDA pip wheels: the
    runtime wheel's own directory first, then any other wheel's (CUDA 13's `cu13/lib`)."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    paths: list[str] = []
    for d in (spec.submodule_search_locations or []) if spec is not None else []:
        own = sorted(glob.glob(os.path.join(d, "cuda_runtime", "lib", "libcudart.so*")))
        paths += own + sorted(set(glob.glob(os.path.join(d, "*", "lib", "libcudart.so*"))) - set(own))
    return paths
