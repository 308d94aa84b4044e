"""`kvcache bench daemon` end to end at a tiny size: real daemon, real redis-server, JSON report.

Needs redis-server on PATH (apt-get install redis-server) and redis-py (the `redis` package);
skipped otherwise, except the missing-dependency checks, which need neither.
"""

import argparse
import importlib.util
import json
import os
import shutil

import pytest

from kvcache.benchmarks import daemon, daemon_report, daemon_servers, verbs

HAVE_REDIS = shutil.which("redis-server") is not None and importlib.util.find_spec("redis") is not None
needs_redis = pytest.mark.skipif(not HAVE_REDIS, reason="needs redis-server on PATH (apt-get install redis-server) "
                                                        "and the redis Python client (pip install redis)")


def _positive(d: dict) -> None:
    for k, v in d.items():
        if k != "rounds_s":
            assert isinstance(v, float) and v > 0, (k, v)


@needs_redis
def test_tiny_run_writes_the_report(tmp_path):
    out_dir = tmp_path / "results"
    doc = daemon.run("256K", 2 << 20, str(out_dir), repeats=1, batch_bytes=1 << 20, data_dir=str(tmp_path),
                     lookup_runs=5, progress=False, restart_rounds=1)
    on_disk = json.loads((out_dir / "daemon_throughput-latest.json").read_text())
    assert on_disk == json.loads(json.dumps(doc))
    assert len(list(out_dir.glob("daemon_throughput-2*.json"))) == 1

    r = on_disk["sizes"]["256K"]
    assert r["blocks"] == 8 and r["batches"] == 2
    served = r["daemon_gets_served_from"]   # the DRAM tier holds every block: gets never touch the disk
    assert sum(served.values()) == 16 and all("dram" in tier for tier in served)
    assert set(r["put"]) - {"rounds_s"} == set(daemon_report.SIDES) - {"daemon_shm", "memcpy_arena", "loopback_tcp"}
    assert set(r["get"]) - {"rounds_s"} == {"memcpy", "memcpy_arena", "daemon_http", "daemon_unix", "daemon_shm",
                                            "redis_tcp", "redis_unix", "loopback_tcp"}
    _positive(r["put"])
    _positive(r["get"])
    for name in ("daemon_get_vs_redis", "daemon_put_vs_redis", "unix_get_vs_redis", "local_get_vs_memcpy",
                 "local_get_vs_private_memcpy",
                 "daemon_put_vs_redis_durable", "durable_put_vs_redis_memory", "shm_get_vs_redis",
                 "http_get_vs_loopback"):
        assert on_disk[name] > 0 and on_disk["ratios_per_size"][name]["256K"] == on_disk[name]
    restart = r["restart"]                 # read back after restarts, from NVMe only
    assert restart["blocks"] == 8 and set(restart["rounds_s"]) == {
        "pread_cached", "pread_verify_cached", "pread_cold", "shm_cached", "shm_cold", "http_cached"}
    _positive({k: v for k, v in restart.items() if k != "blocks"})
    for name in ("nvme_get_after_restart_vs_pread", "nvme_get_after_restart_cold_vs_pread",
                 "http_get_after_restart_vs_pread"):
        assert on_disk["ratios_per_size"][name]["256K"] == on_disk[name] > 0
    assert set(on_disk["targets"]) == set(daemon_report.TARGETS)
    for lk in ("daemon_http", "redis_pipelined_exists"):
        assert 0 < on_disk["lookup"][lk]["p50_ms"] <= on_disk["lookup"][lk]["p99_ms"]
    assert on_disk["lookup_1000_p50_ms"] == on_disk["lookup"]["daemon_http"]["p50_ms"]
    assert "fsync 'always'" in on_disk["setups"]["daemon"]["durability"]
    assert "--appendonly no" in on_disk["setups"]["redis"]["durability"]
    assert "shared-memory arena" in " ".join(on_disk["notes"])
    assert "write-back" in on_disk["setups"]["daemon_memory"]["durability"]
    assert on_disk["machine"]["cpu_count"] and on_disk["machine"]["load_at_start"]
    # everything it started is gone: scratch directory (and with it the daemon's data)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".kvcache-bench-")]
    table = daemon_report.format_table(doc)
    assert "daemon http" in table and "after a restart" in table and "daemon shm cold" in table


def _args(tmp_path, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    verbs.add_daemon_arguments(p, default_out_dir=str(tmp_path))
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_missing_redis_server_exits_2_with_the_install_hint(tmp_path, capsys):
    assert daemon.run_args(_args(tmp_path, redis_server=str(tmp_path / "no-redis-server"))) == 2
    err = capsys.readouterr().err
    assert "apt-get install redis-server" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())   # nothing started, nothing written


def test_missing_redis_module_is_a_clear_error(monkeypatch):
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server on PATH to get past the first check")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "redis" else real(name, *a))
    with pytest.raises(daemon_servers.MissingDependency, match="pip install redis"):
        daemon_servers.check_dependencies("redis-server")
