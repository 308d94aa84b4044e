"""The servers `kvcache bench daemon` starts and stops: `kvcache serve` daemons and
redis-servers, each in its own session with its output in a log file, stopped on the way out
(also when the benchmark dies: PR_SET_PDEATHSIG), and a dependency check with install hints.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Callable

from kvcache.tiering.slab import SlabAllocator

_LIBC = ctypes.CDLL(None, use_errno=True)   # resolved here: the forked child only calls prctl


class MissingDependency(RuntimeError):
    """redis-server or redis-py is not installed (the CLI exits with status 2)."""


def check_dependencies(redis_server: str) -> str:
    path = shutil.which(redis_server)
    if path is None:
        raise MissingDependency(f"redis-server not found ({redis_server!r} is not on PATH): install it with "
                                "`apt-get install redis-server` (Debian/Ubuntu), or pass --redis-server PATH")
    if importlib.util.find_spec("redis") is None:
        raise MissingDependency("the redis Python client is not installed: `pip install redis`")
    return path


def print_report(verb: str, make: Callable[[], dict], table: Callable[[dict], str]) -> int:
    """A benchmark's `run_args` tail: make the report, print its table and where it was written;
    exit status 2 with the install hint when a dependency is missing."""
    try:
        doc = make()
    except MissingDependency as e:
        print(f"kvcache bench {verb}: {e}", file=sys.stderr)
        return 2
    print(table(doc))
    print(f"\nwrote {doc['files']['json']}\n  and {doc['files']['latest']}")
    return 0


# ---------------------------------------------------------------- processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(cleanup: contextlib.ExitStack, argv: list[str], log_path: str) -> subprocess.Popen:
    """Start argv in its own session (Ctrl-C reaches only us, and we stop it), output to log_path;
    it gets SIGTERM if this process dies without cleaning up (PR_SET_PDEATHSIG)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=lambda: _LIBC.prctl(1, signal.SIGTERM))
    cleanup.callback(_stop, proc)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen, ready, log_path: str, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(Exception):
            if ready():
                return
        time.sleep(0.05)
    why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not ready in {timeout_s:g} s"
    with open(log_path, errors="replace") as f:
        raise RuntimeError(f"{what} did not start ({why}); its output:\n{f.read()[-2000:]}")


def daemon_config(sizes: list[int], total_bytes: int, repeats: int, policy: str = "write-through") -> dict:
    """DRAM that holds both key sets of every size below the watermarks (no eviction while
    timing); NVMe room for every round; write-through with fsync "always" (durable puts), or
    write-back (puts acknowledged from DRAM, like a memory-only redis)."""
    page, need = max(16 << 20, max(sizes)), 0
    for size in sizes:
        chunk, n = SlabAllocator(page, page).chunk_size(size), 2 * max(1, total_bytes // size)
        need += -(-n // (page // chunk)) * page
    written = 2 * total_bytes * len(sizes) * (repeats + 1)
    return {"store": {"write_policy": policy},
            "dram": {"capacity_bytes": int(need / 0.85) + 4 * page, "page_bytes": page, "pin_memory": "off"},
            "nvme": {"fsync": "always", "capacity_bytes": max(4 << 30, 2 * written)}}


def start_daemon(cleanup, root: str, sock_dir: str, cfg: dict, name: str = "daemon") -> dict:
    path, port, sock = os.path.join(root, f"{name}.toml"), _free_port(), os.path.join(sock_dir, f"{name}.sock")
    with open(path, "w") as f:
        f.write("".join(f"[{sec}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in kv.items())
                        for sec, kv in cfg.items()))
    data = os.path.join(root, f"{name}-data")
    argv = [sys.executable, "-m", "kvcache.cli.main", "serve", "--config", path, "--data-dir", data,
            "--port", str(port), "--unix-socket", sock, "--gc-interval", "3600"]
    log, url = os.path.join(root, f"{name}.log"), f"http://127.0.0.1:{port}"
    proc = _spawn(cleanup, argv, log)
    _wait_ready(proc, lambda: urllib.request.urlopen(url + "/healthz", timeout=1).status == 200
                and os.path.exists(sock), log, "kvcache serve")
    return {"url": url, "unix_socket": sock, "argv": argv[1:], "config": cfg, "data_dir": data, "proc": proc}


def stop_daemon(daemon: dict) -> None:
    """Stop a daemon start_daemon started (SIGTERM: it shuts down cleanly), and wait for it."""
    _stop(daemon["proc"])


def start_redis(cleanup, binary: str, root: str, sock_dir: str, name: str, durable: bool) -> dict:
    d, port, sock = os.path.join(root, name), _free_port(), os.path.join(sock_dir, f"{name}.sock")
    os.makedirs(d)
    persistence = (["--appendonly", "yes", "--appendfsync", "always", "--auto-aof-rewrite-percentage", "0"]
                   if durable else ["--appendonly", "no"])
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--unixsocket", sock, "--unixsocketperm", "700",
            "--dir", d, "--save", "", *persistence, "--daemonize", "no", "--protected-mode", "yes"]
    log = os.path.join(root, f"{name}.log")
    proc = _spawn(cleanup, argv, log)
    import redis
    tcp = redis.Redis(port=port, socket_timeout=120)
    cleanup.callback(tcp.close)
    _wait_ready(proc, tcp.ping, log, name)
    unix = redis.Redis(unix_socket_path=sock, socket_timeout=120)
    cleanup.callback(unix.close)
    return {"tcp": tcp, "unix": unix, "argv": argv[1:]}
