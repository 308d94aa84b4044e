"""The real daemon is not dumpable, so no local process opens its arena through /proc: the arena
reaches a client only through an accepted HELLO (tests/client/test_shm_security.py).

Tests run as root here, and root (CAP_SYS_PTRACE) may open a non-dumpable process's /proc
entries: the daemon's non-dumpability is probed from a child that drops CAP_SYS_PTRACE, which is
what a process of the daemon's user without privileges has."""

import ctypes
import subprocess
import sys
import time

import pytest

from kvcache.client.sync_client import KVClient
from tests.client.test_shm_security import shm_json
from tests.conftest import NS, make_keys, payload_for, put_blocks
from tests.daemon_proc import DaemonProcess


def without_ptrace() -> None:
    """preexec_fn: this process and what it execs lose CAP_SYS_PTRACE (bounding set), which
    root needs to open a non-dumpable process's /proc entries. Not root: nothing to drop."""
    ctypes.CDLL(None).prctl(24, 19, 0, 0, 0)      # PR_CAPBSET_DROP, CAP_SYS_PTRACE


def probe_opens(*paths: str) -> list[str]:
    """Open each path from a process of this user without CAP_SYS_PTRACE: "opened" or the error."""
    code = ("import os, sys\nfor p in sys.argv[1:]:\n    try:\n"
            "        os.close(os.open(p, os.O_RDONLY)); print('opened')\n"
            "    except OSError as e:\n        print(type(e).__name__)")
    out = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=30,
                         preexec_fn=without_ptrace)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.slow
def test_the_real_daemon_is_not_dumpable_and_hands_its_arena_only_over_hello(tmp_path):
    """Daemon, probe and witness all run without CAP_SYS_PTRACE (a root process may not inspect
    one with more capabilities than its own either): the witness, an ordinary process, shows the
    probe can open /proc/<pid>/fd/* of its peers, so the daemon's refusal is its non-dumpability."""
    cfg = tmp_path / "store.toml"
    cfg.write_text("[dram]\ncapacity_mib = 16\nprefault = false\n")
    sock = tmp_path / "kv.sock"
    with DaemonProcess(tmp_path / "data", "--config", str(cfg), "--unix-socket", str(sock),
                       preexec_fn=without_ptrace) as d:
        witness = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                                   preexec_fn=without_ptrace)
        try:
            info = shm_json(d.url, None)
            arena = f"/proc/{d.proc.pid}/fd/{info['fd']}"
            assert probe_opens(f"/proc/{witness.pid}/fd/0", f"/proc/{witness.pid}/mem", arena,
                               f"/proc/{d.proc.pid}/mem") == ["opened", "opened", "PermissionError", "PermissionError"]
            for _ in range(100):
                if sock.exists():
                    break
                time.sleep(0.05)
            with KVClient("http://x", unix_socket=str(sock), shared_memory="on") as c:   # yet clients map it
                c.register_namespace(NS)
                keys = make_keys(4)
                put_blocks(c, keys)
                assert c.get_many(keys) == [payload_for(k) for k in keys] and c._client._arena is not None
        finally:
            witness.kill()
            witness.wait()
        out = d.stop()
    assert "stopped cleanly" in out


def test_undumpable_sets_the_flag():
    code = ("import ctypes; from kvcache.server.daemon import undumpable; libc = ctypes.CDLL(None);"
            "print(libc.prctl(3, 0, 0, 0, 0), undumpable(), libc.prctl(3, 0, 0, 0, 0))")   # PR_GET_DUMPABLE
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["1", "True", "0"], out.stderr
