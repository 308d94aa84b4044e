"""The real `kvcache serve` process for tests: `DaemonProcess` starts
`python -m kvcache.cli.main serve --data-dir DIR --port PORT *args` on a free loopback port, with
extra CLI args and environment, waits until GET /healthz answers 200, and stops it.

    with DaemonProcess(tmp_path / "data", "--config", str(cfg), env={"KVCACHE_TOKENS": ...}) as d:
        ... d.url, d.port, d.proc (its Popen), d.call("GET", "/v1/stats") ...
    # killed on the way out if still running; d.stop() instead stops it gracefully and returns its output

`with` waits for readiness on the way in; without it the process still starts at construction,
and the test calls `wait_ready()` and, in a finally, `kill()` itself. Its output goes to an
unlinked temporary file, not a pipe, so a daemon that logs a lot never blocks on a pipe nobody
reads; `output()` reads it, `stop()` returns it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Callable


def free_port() -> int:
    """A loopback TCP port nothing listens on now (the kernel's pick; free until someone binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonProcess:
    """One `kvcache serve` child process on 127.0.0.1:`port` (a free one unless given); `args` are
    appended to its command line, `env` added to this process's environment, `preexec_fn` runs
    in the child before exec (e.g. to drop capabilities)."""

    def __init__(self, data_dir, *args: str, env: dict[str, str] | None = None, port: int | None = None,
                 preexec_fn: Callable[[], None] | None = None):
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "kvcache.cli.main", "serve", "--data-dir", str(data_dir),
                     "--port", str(self.port), *args]
        fd, path = tempfile.mkstemp(prefix="kvcache-serve-", suffix=".log")
        os.unlink(path)
        self._log_fd = fd
        self.proc = subprocess.Popen(self.argv, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, preexec_fn=preexec_fn)

    def __enter__(self) -> "DaemonProcess":
        try:
            self.wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def __del__(self) -> None:
        if getattr(self, "_log_fd", None) is not None:
            os.close(self._log_fd)
            self._log_fd = None

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until /healthz answers 200; a loaded machine prefaults the daemon's DRAM slowly, hence
        the long default. AssertionError with the output if it exits or never answers."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}: {self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"daemon never became healthy in {timeout:g} s: {self.output()[-4000:]}")

    def call(self, method: str, path: str, body=None, headers: dict | None = None) -> tuple[int, bytes]:
        """One HTTP request: (status, body), error statuses included. A dict body is sent as JSON."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def output(self) -> str:
        """Everything it printed so far (stdout and stderr together)."""
        return os.pread(self._log_fd, os.fstat(self._log_fd).st_size, 0).decode(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> str:
        """Send `sig` (SIGTERM: the graceful stop), wait for the exit, return the output."""
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)
        return self.output()

    def kill(self) -> None:
        """SIGKILL it if it still runs, and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
