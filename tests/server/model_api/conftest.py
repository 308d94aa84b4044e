"""The model server for the SDK tests: one real `kvcache serve --model demo:v41-tiny` process per
test module (tests/daemon_proc.py), and prompts long enough to leave cached prefixes.

The demo checkpoint is built under the module's data directory on first use (a few seconds),
which is the path the README's first command takes; the port opens before, so a test waits for
/ready (wait_model_ready). Cached-prefix tests need prompts past one
exact-mode snapshot point (cache.snapshot_interval = 512 tokens by default): `long_text` makes
such text from a fixed vocabulary, so every run sends the same prompts.
"""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from tests.daemon_proc import DaemonProcess

MODEL = "v41-tiny"
NO_THINKING = {"thinking": {"type": "disabled"}}
WORDS = ("cache", "block", "tier", "prefix", "window", "token", "layer", "expert", "tenant", "store", "index",
         "segment", "record", "lease", "pin", "snapshot", "namespace", "engine", "request", "stream")


def long_text(words: int, seed: int) -> str:
    """Deterministic prose of `words` words (about 1.5 tokens each with the demo tokenizer)."""
    return " ".join(WORDS[(i * 7 + seed * 13 + i // 5) % len(WORDS)] + str((i + seed) % 10) for i in range(words))


def start_server(tmp_path_factory, *args: str, env: dict | None = None) -> DaemonProcess:
    data = tmp_path_factory.mktemp("model-server")
    return model_server(data / "data", *args, env=env)


def model_server(data_dir, *args: str, env: dict | None = None) -> DaemonProcess:
    """`kvcache serve --model demo:v41-tiny *args` on `data_dir`, once its model is ready."""
    server = DaemonProcess(data_dir, "--model", f"demo:{MODEL}", *args, env=env)
    try:
        wait_model_ready(server)
    except BaseException:
        server.kill()
        raise
    return server


def wait_model_ready(server: DaemonProcess, timeout: float = 240) -> None:
    """Until GET /ready answers 200 (the port opens first; the demo checkpoint is built and the
    engine warmed up after). AssertionError with the output if it exits or never gets there."""
    server.wait_ready(timeout=timeout)
    deadline = time.time() + timeout
    while server.call("GET", "/ready")[0] != 200:
        if server.proc.poll() is not None:
            raise AssertionError(f"model server exited with {server.proc.returncode}: {server.output()[-4000:]}")
        assert time.time() < deadline, f"model never became ready in {timeout:g} s: {server.output()[-4000:]}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory)
    yield s
    s.kill()


def metric(url: str, series: str, labels: str = "", headers: dict | None = None) -> float:
    """One series' value from /metrics (`labels`: a regex the series' labels must contain)."""
    req = urllib.request.Request(url + "/metrics", headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    m = re.search(rf'^{re.escape(series)}\{{[^}}]*{labels}[^}}]*\}} (\S+)$', text, re.M)
    assert m, f"no {series}{{{labels}}} in /metrics"
    return float(m.group(1))


def running_requests(url: str, headers: dict | None = None) -> int:
    """kvcache:num_requests_running from /metrics."""
    return int(metric(url, "kvcache:num_requests_running", headers=headers))
