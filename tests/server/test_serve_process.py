"""The real `kvcache serve` process: start-up, graceful stop, SIGKILL under load, refusals."""

import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from kvcache.kvstore import Namespace
from tests.daemon_proc import DaemonProcess, free_port

NS = Namespace("proc-model@1", "raw/v1", 16, name="proc")


class Daemon(DaemonProcess):
    """A `kvcache serve` process (tests/daemon_proc.py) that puts this module's blocks. Its port
    comes from this module's free_port, which a test may fix (to restart on the same port)."""

    def __init__(self, data_dir, *extra, env=None):
        super().__init__(data_dir, *extra, env=env, port=free_port())

    def put(self, i: int) -> dict:
        status, body = self.call("PUT", f"/v1/blocks/{key(i).hex()}", payload(i),
                                 {"X-KVCache-Namespace": NS.id.hex()})
        assert status == 200, body
        return json.loads(body)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(i: int) -> bytes:
    return (i.to_bytes(4, "little") * 2048)[: 4096 + i % 4000]


@pytest.fixture
def daemon(tmp_path):
    """start(*args, env=...) -> a ready Daemon on tmp_path/data; every one started is killed after."""
    with contextlib.ExitStack() as started:
        yield lambda *extra, **kw: started.enter_context(Daemon(tmp_path / "data", *extra, **kw))


def test_start_serve_stop_restart(daemon):
    d = daemon()
    status, body = d.call("POST", "/v1/namespaces", NS.to_dict())
    assert status == 200 and json.loads(body)["id"] == NS.id.hex()
    for i in range(20):
        assert d.put(i)["durable"]
    out = d.stop()
    assert d.proc.returncode == 0 and "kvcache serving http://127.0.0.1" in out and "stopped cleanly" in out
    d2 = daemon()
    for i in range(20):
        status, body = d2.call("GET", f"/v1/blocks/{key(i).hex()}")
        assert status == 200 and body == payload(i)
    status, body = d2.call("GET", "/metrics")
    assert status == 200 and b"kvcache_index_blocks 20.0" in body


def test_sigkill_under_load_keeps_acknowledged_blocks(daemon):
    d = daemon()
    d.call("POST", "/v1/namespaces", NS.to_dict())
    acked: list[int] = []
    stop = threading.Event()

    def writer(base):
        i = base
        while not stop.is_set():
            try:
                if d.put(i)["durable"]:
                    acked.append(i)
            except (OSError, AssertionError):
                return  # the daemon died under us: that put was never acknowledged
            i += 1

    threads = [threading.Thread(target=writer, args=(b,)) for b in (0, 1_000_000)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    d.proc.kill()
    d.proc.wait()
    stop.set()
    for t in threads:
        t.join()
    assert len(acked) > 20, "the writers acknowledged too little to test anything"
    d2 = daemon()
    for i in acked:
        status, body = d2.call("GET", f"/v1/blocks/{key(i).hex()}")
        assert status == 200 and body == payload(i), f"acknowledged block {i} lost or wrong"
    status, body = d2.call("GET", "/metrics")
    assert b"kvcache_quarantined_total 0.0" in body


def test_refuses_public_bind_without_tokens(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvcache.cli.main", "serve", "--data-dir", str(tmp_path),
                        "--host", "0.0.0.0", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "KVCACHE_TOKENS": ""})
    assert r.returncode == 2 and "without auth" in r.stderr


def test_tokens_from_environment_are_enforced(daemon):
    token = "t" * 40
    d = daemon(env={"KVCACHE_TOKENS": f"{token}:acme:admin"})
    assert d.call("GET", "/v1/stats")[0] == 401
    status, body = d.call("GET", "/v1/stats", headers={"Authorization": f"Bearer {token}"})
    assert status == 200 and json.loads(body)["namespaces"] == 0


def test_help_describes_the_default():
    out = subprocess.run([sys.executable, "-m", "kvcache.cli.main", "serve", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "127.0.0.1:8790" in out and "KVCACHE_TOKENS" in out and "SIGTERM" in out


def test_unix_socket_serves_the_same_store(daemon, tmp_path):
    from kvcache.client.open_store import open_store
    sock = tmp_path / "kv.sock"
    d = daemon("--unix-socket", str(sock))
    with open_store(f"unix://{sock}") as client:
        client.register_namespace(NS)
        client.put(key(7), payload(7), NS.id)
    status, body = d.call("GET", f"/v1/blocks/{key(7).hex()}")
    assert status == 200 and body == payload(7)


def test_object_store_outage_never_fails_a_request(daemon, tmp_path):
    """`kvcache serve` with an S3 tier (moto_server in its own process) keeps serving when the
    S3 server dies: puts are acknowledged durably from NVMe, gets still hit, nothing errors."""
    from tests.tiering.object_helpers import MotoServer, _need_moto
    _need_moto()
    s3 = MotoServer().start()
    try:
        s3.create_bucket("kvcache-e2e")
        cfg = tmp_path / "serve.toml"
        cfg.write_text(
            '[object]\nurl = "s3://kvcache-e2e/cache"\npack_linger_s = 0.1\ntimeout_s = 2.0\n'
            'breaker_failures = 2\nbreaker_cooldown_s = 60.0\n'
            f'[object.storage_options]\nendpoint_url = "{s3.url}"\nkey = "test"\nsecret = "test"\n')
        d = daemon("--config", str(cfg))
        d.call("POST", "/v1/namespaces", NS.to_dict())
        for i in range(10):
            d.put(i)
        deadline = time.monotonic() + 20      # the packs land in S3
        while json.loads(d.call("GET", "/v1/stats")[1])["counters"].get("object_stored", 0) < 10:
            assert time.monotonic() < deadline, "nothing reached the object tier"
            time.sleep(0.1)
        s3.stop()                             # outage
        t0 = time.monotonic()
        for i in range(10, 30):
            assert d.put(i)["durable"]
        for i in range(30):
            status, body = d.call("GET", f"/v1/blocks/{key(i).hex()}")
            assert status == 200 and body == payload(i)
        assert time.monotonic() - t0 < 30, "the outage made requests crawl"
        status, body = d.call("GET", "/metrics")
        assert status == 200 and b"kvcache_quarantined_total 0.0" in body
    finally:
        s3.stop()


def test_the_daemons_files_are_its_users_alone(daemon, tmp_path):
    """umask 077 at start: segments, index and event logs are 0600 and directories 0700, since
    they hold every tenant's blocks; a data directory left open to others is warned about."""
    (tmp_path / "data").mkdir(mode=0o755)
    os.chmod(tmp_path / "data", 0o755)
    d = daemon()
    assert d.call("POST", "/v1/namespaces", NS.to_dict())[0] == 200
    d.put(1)
    out = d.stop()
    assert "has mode 755" in out and "chmod -R go=" in out
    made = [p for p in (tmp_path / "data").rglob("*")]
    assert any(p.suffix == ".seg" or "seg" in p.name for p in made), [p.name for p in made]
    for p in made:
        assert os.stat(p).st_mode & 0o077 == 0, (p, oct(os.stat(p).st_mode))
