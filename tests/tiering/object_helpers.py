"""Shared by the object-tier tests: block writers, a moto S3 server in its own process, a flaky filesystem."""


from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import numpy as np
import pytest

from kvcache.kvstore.types import TensorSpec, raw_layout
from kvcache.tiering.base import BlockWrite
from kvcache.tiering.config import ObjectConfig
from kvcache.tiering.object_store import ObjectTier

pytest.importorskip("fsspec", reason="the object tier needs fsspec: pip install fsspec")
from fsspec.implementations.local import LocalFileSystem  # noqa: E402

NS_ID = bytes(range(16))
SIZES = [1, 7, 4096, 65536, 65537, 1 << 20]


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _write(i: int, n: int) -> BlockWrite:
    payload = (i.to_bytes(4, "little") * (n // 4 + 1))[:n]
    return BlockWrite(_key(i), NS_ID, payload, raw_layout(n), 1.0)


def _bf16_write(i: int, elems: int = 1 << 17) -> BlockWrite:
    """bf16-like KV: random normal float32 truncated to its high 16 bits."""
    x = np.random.default_rng(i).standard_normal(elems, dtype=np.float32)
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)
    return BlockWrite(_key(i), NS_ID, bf16.tobytes(), (TensorSpec("kv", "bfloat16", (elems,)),), 1.0)


# ---------------------------------------------------------------- S3 test server
class MotoServer:
    """moto_server as a separate process on 127.0.0.1 (in-memory: a restart loses data)."""

    def __init__(self, port: int | None = None):
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port, self.url, self.proc = port, f"http://127.0.0.1:{port}", None

    def start(self) -> "MotoServer":
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(self.url + "/moto-api/", timeout=0.5).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on port {self.port}")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def create_bucket(self, name: str) -> None:
        import boto3
        boto3.client("s3", endpoint_url=self.url, aws_access_key_id="test", aws_secret_access_key="test",
                     region_name="us-east-1").create_bucket(Bucket=name)

    def options(self) -> dict:
        return {"endpoint_url": self.url, "key": "test", "secret": "test"}


def _need_moto() -> None:
    try:
        import boto3  # noqa: F401
        import flask  # noqa: F401  (moto[server])
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as e:
        pytest.skip(f"S3 tests need moto[server], boto3 and s3fs (pip install 'moto[server]' s3fs): {e}")


@pytest.fixture(scope="session")
def moto():
    _need_moto()
    server = MotoServer().start()
    server.create_bucket("kvcache-test")
    yield server
    server.stop()


def _s3_config(server: MotoServer, bucket: str = "kvcache-test", **kw) -> ObjectConfig:
    return ObjectConfig(url=f"s3://{bucket}/{uuid.uuid4().hex[:8]}", storage_options=server.options(), **kw)


class FlakyFS(LocalFileSystem):
    """Local files that fail (or stall) on demand, to drive the breaker without a network."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.fail, self.delay = False, 0.0

    def _maybe_fail(self):
        if self.delay:
            time.sleep(self.delay)
        if self.fail:
            raise ConnectionError("injected outage")

    def pipe_file(self, *a, **kw):
        self._maybe_fail()
        return super().pipe_file(*a, **kw)

    def cat_file(self, *a, **kw):
        self._maybe_fail()
        return super().cat_file(*a, **kw)


def _flaky_tier(tmp_path, **kw):
    """A tier over FlakyFS; `t.landed` collects on_stored, `t.dropped` on_dropped (key, why)."""
    fs = FlakyFS(skip_instance_cache=True)
    defaults = dict(timeout_s=2.0, breaker_failures=2, breaker_cooldown_s=0.2, pack_bytes=256 << 10,
                    max_queue_bytes=1 << 20, pack_linger_s=0.05)
    cfg = ObjectConfig(url=f"file://{tmp_path}/flaky", **{**defaults, **kw})
    landed, dropped = [], []
    t = ObjectTier(cfg, fs=fs, on_stored=landed.extend,
                   on_dropped=lambda keys, why: dropped.extend((k, why) for k in keys))
    t.landed, t.dropped = landed, dropped
    return t, fs
