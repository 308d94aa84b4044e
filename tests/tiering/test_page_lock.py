"""Page-locking the DRAM arena through libcudart (ctypes, never torch): a host without the
runtime or without a device keeps pageable memory, a device registers the whole arena."""

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

from kvcache.kvstore.errors import StoreError
from kvcache.tiering import arena, page_lock
from kvcache.tiering.arena import Arena
from kvcache.tiering.page_lock import CudaRuntime


class FakeCudart:
    """libcudart's two calls as page_lock makes them (ctypes arguments), recorded."""

    def __init__(self, devices: int = 1, register_rc: int = 0, unregister_rc: int = 0):
        self.devices, self.register_rc, self.registered = devices, register_rc, []
        self.unregister_rc, self.unregistered = unregister_rc, []

    def cudaGetDeviceCount(self, count):
        count._obj.value = self.devices
        return 0 if self.devices else 100          # cudaErrorNoDevice

    def cudaHostRegister(self, addr, size, flags):
        self.registered.append((addr.value, size.value, flags.value))
        return self.register_rc

    def cudaHostUnregister(self, addr):
        self.unregistered.append(addr.value)
        return self.unregister_rc


def _with_runtime(monkeypatch, runtime):
    monkeypatch.setattr(arena, "load_cuda_runtime", lambda: runtime)


@pytest.mark.parametrize("runtime", [None, CudaRuntime(FakeCudart(devices=0))], ids=["no libcudart", "no device"])
def test_without_cuda_the_arena_stays_pageable(monkeypatch, runtime):
    _with_runtime(monkeypatch, runtime)
    assert not Arena(1 << 20, prefault=False, pin_memory="auto").pinned
    with pytest.raises(StoreError, match="pin_memory = 'on' needs a CUDA device"):
        Arena(1 << 20, prefault=False, pin_memory="on")


def test_off_never_looks_for_the_runtime(monkeypatch):
    def refuse():
        raise AssertionError("pin_memory = 'off' loaded the CUDA runtime")
    monkeypatch.setattr(arena, "load_cuda_runtime", refuse)
    assert not Arena(1 << 20, prefault=False, pin_memory="off").pinned


def test_a_device_registers_the_whole_arena(monkeypatch):
    lib = FakeCudart()
    _with_runtime(monkeypatch, CudaRuntime(lib))
    a = Arena(1 << 20, prefault=False, pin_memory="auto")
    assert a.pinned
    assert lib.registered == [(ctypes.addressof(ctypes.c_char.from_buffer(a.buf)), 1 << 20, 0)]


def test_close_unregisters_the_arena_once_before_unmapping(monkeypatch):
    """A registration outliving its mapping would make the next arena mapped at that address
    fail to register (cudaErrorHostMemoryAlreadyRegistered): close() unregisters first."""
    lib = FakeCudart()
    _with_runtime(monkeypatch, CudaRuntime(lib))
    a = Arena(1 << 20, prefault=False, pin_memory="auto")
    addr = lib.registered[0][0]
    assert a.close() and lib.unregistered == [addr]
    a.close()
    assert lib.unregistered == [addr]


def test_a_failed_unregister_still_unmaps(monkeypatch, caplog):
    lib = FakeCudart(unregister_rc=1)
    _with_runtime(monkeypatch, CudaRuntime(lib))
    a = Arena(1 << 20, prefault=False, pin_memory="auto")
    assert a.close()
    assert "cudaHostUnregister failed with code 1" in caplog.text


def test_an_unpinned_arena_unregisters_nothing(monkeypatch):
    lib = FakeCudart(devices=0)
    _with_runtime(monkeypatch, CudaRuntime(lib))
    assert Arena(1 << 20, prefault=False, pin_memory="auto").close() and lib.unregistered == []


def test_a_failed_register_is_a_clear_error(monkeypatch):
    _with_runtime(monkeypatch, CudaRuntime(FakeCudart(register_rc=2)))
    with pytest.raises(StoreError, match="cudaHostRegister failed with code 2"):
        Arena(1 << 20, prefault=False, pin_memory="auto")


def test_libraries_that_are_not_the_runtime_are_skipped(monkeypatch, tmp_path):
    fake = tmp_path / "libcudart.so.12"
    fake.write_bytes(b"not an ELF file")
    libc = ctypes.util.find_library("c")           # loads, but has no cudaGetDeviceCount
    monkeypatch.setattr(page_lock, "_candidates", lambda: iter([str(fake), *([libc] if libc else [])]))
    assert page_lock.load_cuda_runtime() is None


class FakeLibrary:
    """libcudart as ctypes.CDLL loads it: plain functions, so argtypes and restype can be set."""

    def __init__(self, devices: int):
        self.registered = []

        def get_device_count(count):
            count._obj.value = devices
            return 0 if devices else 35            # cudaErrorInsufficientDriver: newer than the driver

        def host_register(addr, size, flags):
            self.registered.append((addr.value, size.value, flags.value))
            return 0
        def host_unregister(addr):
            return 0
        self.cudaGetDeviceCount, self.cudaHostRegister = get_device_count, host_register
        self.cudaHostUnregister = host_unregister


def test_a_runtime_that_sees_no_device_gives_way_to_one_that_does(monkeypatch):
    """A system toolkit's libcudart newer than the driver sees no device where torch's wheel
    runtime on the same host does: the arena is page-locked through the one that sees it."""
    libs = {"libcudart.so.13": FakeLibrary(devices=0), "libcudart.so.12": FakeLibrary(devices=1)}
    monkeypatch.setattr(page_lock, "_candidates", lambda: iter(libs))
    monkeypatch.setattr(page_lock.ctypes, "CDLL", lambda name: libs[name])
    runtime = page_lock.load_cuda_runtime()
    assert runtime is not None and runtime.lib is libs["libcudart.so.12"]
    assert Arena(1 << 20, prefault=False, pin_memory="on").pinned
    assert len(libs["libcudart.so.12"].registered) == 1 and not libs["libcudart.so.13"].registered


def test_with_no_runtime_seeing_a_device_the_first_that_loads_answers(monkeypatch):
    libs = {"libcudart.so.13": FakeLibrary(devices=0), "libcudart.so.12": FakeLibrary(devices=0)}
    monkeypatch.setattr(page_lock, "_candidates", lambda: iter(libs))
    monkeypatch.setattr(page_lock.ctypes, "CDLL", lambda name: libs[name])
    runtime = page_lock.load_cuda_runtime()
    assert runtime is not None and runtime.lib is libs["libcudart.so.13"] and runtime.device_count() == 0
    with pytest.raises(StoreError, match="pin_memory = 'on' needs a CUDA device"):
        Arena(1 << 20, prefault=False, pin_memory="on")


def test_the_pip_wheels_runtime_is_found_without_importing_it(monkeypatch, tmp_path):
    for sub, name in (("cuda_runtime", "libcudart.so.12"), ("cu13", "libcudart.so.13"), ("cublas", "libcublas.so")):
        (tmp_path / "nvidia" / sub / "lib").mkdir(parents=True)
        (tmp_path / "nvidia" / sub / "lib" / name).write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    imported_before = "nvidia" in sys.modules
    found = [p for p in page_lock._wheel_libraries() if p.startswith(str(tmp_path))]
    assert found == [str(tmp_path / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12"),
                     str(tmp_path / "nvidia" / "cu13" / "lib" / "libcudart.so.13")]
    assert imported_before or "nvidia" not in sys.modules      # found, not imported


def test_looking_for_the_runtime_never_loads_torch():
    code = ("import sys; from kvcache.tiering.arena import Arena; Arena(1 << 20, prefault=False, "
            "pin_memory='auto'); assert 'torch' not in sys.modules, 'torch was loaded'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_real_device_pins_the_arena():
    """Runs where libcudart and a CUDA device are present (skipped elsewhere)."""
    runtime = page_lock.load_cuda_runtime()
    if runtime is None or runtime.device_count() == 0:
        pytest.skip("no CUDA runtime with a device on this host")
    a = Arena(8 << 20, prefault=True, pin_memory="on")
    assert a.pinned
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():                  # torch agrees the pages are page-locked
        t = torch.frombuffer(a.buf, dtype=torch.uint8)
        assert t.is_pinned()
        del t
    assert a.close()
    for _ in range(3):       # unregistered at close: a new arena (often at the same address) registers again
        assert Arena(8 << 20, prefault=False, pin_memory="on").close()
