"""The `kvcache` store commands through the command line's main() (the same parsing, output and
exit status as from a shell); a real process for the entry point, and beside a running daemon."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np

from kvcache.kvstore import Namespace, hash_blocks
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.types import PutItem
from kvcache.tiering.config import NvmeConfig
from tests.cli.command import kv, kv_process


def kvcache(*args, check=False):
    return kv(*args, check=check)


def kvcache_process(*args, check=False):
    return kv_process(*args, check=check, timeout=120)


def _populate(path, n=40):
    s = BlockStore(StoreConfig(str(path), dram=None, nvme=NvmeConfig(segment_bytes=1 << 20)))
    ns = Namespace("m", "raw/v1", 16, name="demo")
    s.register_namespace(ns)
    keys = hash_blocks(ns, np.arange(16 * n))
    s.put_many([PutItem(k, os.urandom(32768), ns.id) for k in keys])
    s.pin(keys[:2])
    s.close()
    return keys


def test_help_explains_every_command():
    out = kvcache_process("--help", check=True).stdout
    for cmd in ("stats", "check", "gc"):
        assert cmd in out
    assert "--fix" in kvcache("check", "--help", check=True).stdout


def test_stats_table_and_json(tmp_path):
    _populate(tmp_path)
    out = kvcache("stats", str(tmp_path), check=True).stdout
    assert "blocks" in out and "40" in out and "pinned blocks" in out
    data = json.loads(kvcache("stats", str(tmp_path), "--json", check=True).stdout)
    assert data["index_blocks"] == 40 and data["pinned_blocks"] == 2 and data["namespaces"] == 1


def test_stats_reads_as_a_table_and_reports_the_configured_tiers_as_the_daemon_does(tmp_path):
    _populate(tmp_path / "d")
    cfg = tmp_path / "store.toml"
    cfg.write_text("[dram]\ncapacity_mib = 32\nprefault = false\n[nvme]\ncapacity_mib = 48\n")
    lines = kvcache("stats", str(tmp_path / "d"), "--config", str(cfg), check=True).stdout.splitlines()
    col = lines[0].index(str(tmp_path / "d"))                   # every value starts in one column
    valued = [line for line in lines if len(line) > col]
    assert len(valued) > 10 and all(line[col - 2:col] == "  " and line[col] != " " for line in valued), lines
    text = "\n".join(lines)
    assert "tenant_" not in text and "blocks of tenant (anonymous)" in text and "32.0 MiB configured" in text
    offline = json.loads(kvcache("stats", str(tmp_path / "d"), "--config", str(cfg), "--json", check=True).stdout)
    with BlockStore(StoreConfig.load(str(cfg), str(tmp_path / "d"))) as store:
        live = store.stats().to_dict()
    assert offline["offline"] and not live["offline"]
    assert [(t["tier"], t["capacity_bytes"]) for t in offline["tiers"]] == [
        (t["tier"], t["capacity_bytes"]) for t in live["tiers"]] == [("dram", 32 << 20), ("nvme", 48 << 20)]
    dram = offline["tiers"][0]
    assert dram["blocks"] == dram["used_bytes"] == -1            # a daemon's DRAM: not in the directory
    assert offline["tiers"][1]["blocks"] == live["tiers"][1]["blocks"] == 40


def test_check_exit_codes_and_fix(tmp_path):
    _populate(tmp_path)
    assert kvcache("check", str(tmp_path)).returncode == 0
    seg = sorted(p for p in os.listdir(tmp_path / "nvme") if p.endswith(".kvs"))[0]
    with open(tmp_path / "nvme" / seg, "r+b") as f:
        f.seek(5000)
        f.write(b"garbage!")
    r = kvcache("check", str(tmp_path), "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["bad_blocks"]
    assert kvcache("check", str(tmp_path), "--fix").returncode == 0
    assert kvcache("check", str(tmp_path)).returncode == 0


def test_check_rebuild_and_gc(tmp_path):
    _populate(tmp_path)
    r = kvcache("check", str(tmp_path), "--rebuild", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["blocks_checked"] == 40
    gc = json.loads(kvcache("gc", str(tmp_path), "--json", check=True).stdout)
    assert gc["expired"] == 0 and gc["wrapped"]


def test_check_and_gc_on_a_daemons_directory_say_what_to_do_and_gc_runs_in_the_daemon(tmp_path):
    _populate(tmp_path / "d")
    cfg = tmp_path / "store.toml"
    cfg.write_text("[dram]\ncapacity_mib = 32\nprefault = false\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = subprocess.Popen([sys.executable, "-m", "kvcache.cli.main", "serve", "--config", str(cfg), "--data-dir",
                               str(tmp_path / "d"), "--port", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/healthz", timeout=1).close()
                break
            except OSError:
                assert daemon.poll() is None
                time.sleep(0.1)
        r = kvcache_process("gc", str(tmp_path / "d"))
        assert r.returncode == 2 and f"pid {daemon.pid}" in r.stderr and "kvcache gc --url" in r.stderr, r.stderr
        r = kvcache_process("check", str(tmp_path / "d"), "--rebuild")
        assert r.returncode == 2 and "stop the daemon" in r.stderr and "kvcache stats" in r.stderr, r.stderr
        assert (tmp_path / "d" / "index" / "data.mdb").exists()      # --rebuild left the live index alone
        rep = json.loads(kvcache_process("gc", "--url", url, "--json", check=True).stdout)
        assert rep["wrapped"] and rep["expired"] == 0
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
    r = kvcache("gc")
    assert r.returncode == 2 and "--url" in r.stderr


def test_errors_are_clear_not_tracebacks(tmp_path):
    r = kvcache("stats", str(tmp_path / "nope"))
    assert r.returncode == 2 and "holds no kvcache index" in r.stderr and "Traceback" not in r.stderr
    r = kvcache("check", str(tmp_path / "nope"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[dram\n")
    _populate(tmp_path / "d")
    r = kvcache("gc", str(tmp_path / "d"), "--config", str(bad))
    assert r.returncode == 2 and "not valid TOML" in r.stderr


def test_json_logs(tmp_path):
    _populate(tmp_path)
    import shutil
    shutil.rmtree(tmp_path / "index")
    r = kvcache("--log-format", "json", "check", str(tmp_path), "--json")
    lines = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    assert any("rebuil" in line["message"] for line in lines)
