"""The tier benchmark runs end to end on tiny sizes and writes a complete JSON report.
(Only the report's shape is checked: throughput targets are not asserted here.)"""

import argparse
import json
import math
import platform

import pytest

from kvcache.cli import bench
from kvcache.benchmarks import args, tiers

MIB = 1 << 20
RATIOS = ("dram_get_vs_memcpy", "nvme_put_vs_raw_write", "nvme_get_vs_raw_read")


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_parse_sizes():
    assert args.parse_sizes("64K, 256k,1M,4MiB") == [64 << 10, 256 << 10, MIB, 4 * MIB]
    assert args.size_label(256 << 10) == "256K" and args.size_label(4 * MIB) == "4M"
    with pytest.raises(ValueError):
        args.parse_size("lots")
    with pytest.raises(ValueError):
        args.parse_size("0K")


def test_run_writes_report(tmp_path):
    out_dir = tmp_path / "results"
    tiers.run([64 << 10], 2 * MIB, str(out_dir), repeats=1, batch_bytes=MIB,
              data_dir=str(tmp_path / "data"), index_blocks=3000, hash_runs=1, lookup_runs=1,
              progress=False)
    latest = out_dir / "tier_throughput-latest.json"
    stamped = [p for p in out_dir.glob("tier_throughput-*.json") if p != latest]
    assert latest.exists() and len(stamped) == 1
    report = json.loads(latest.read_text())
    assert report == json.loads(stamped[0].read_text())
    for key in ("machine", "config", "sizes", "ratios_per_size", "targets", *RATIOS,
                "hash_128k_ms", "lookup_1000_in_1M_ms"):
        assert key in report, key
    for key in ("cpu", "cpu_count", "mem_total_bytes", "filesystem", "python", "kvcache", "uname"):
        assert key in report["machine"], key
    cpu = report["machine"]["cpu"]                  # x86 Linux runners list at least AVX2's pair
    assert cpu["model"] and (platform.machine() != "x86_64" or {"avx2", "fma"} <= set(cpu["matmul_flags"]))
    for name in (*RATIOS, "hash_128k_ms", "hash_128k_sha256_ms", "lookup_1000_in_1M_ms"):
        assert _positive(report[name]), name
    r = report["sizes"]["64K"]
    assert r["blocks"] == 32
    for tier, ops in (("dram", ("store_get", "tier_get", "memcpy_get", "store_put", "tier_put", "memcpy_put")),
                      ("nvme", ("store_put", "tier_put", "raw_write", "store_get", "tier_get", "raw_read"))):
        for op in ops:
            assert _positive(r[tier][op]), (tier, op)
    for name in RATIOS:
        assert report["ratios_per_size"][name] == {"64K": report[name]}
        assert isinstance(report["targets"][name]["pass"], bool)
    assert report["lookup"]["lookup_blocks"] == 1000 and report["lookup"]["index_blocks"] == 3000
    assert not list((tmp_path / "data").iterdir())  # scratch files are cleaned up
    table = tiers.format_table(report)
    assert "nvme cold get (store)" in table and "target nvme_put_vs_raw_write" in table


def test_cli_bench_tiers(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="kvcache")
    bench.add_parser(parser.add_subparsers(dest="command", required=True))
    parsed = parser.parse_args(["bench", "tiers", "--sizes", "64K", "--total-mib", "1", "--repeats", "1",
                                "--index-blocks", "1500", "--data-dir", str(tmp_path / "d"),
                                "--out-dir", str(tmp_path / "r"), "--no-progress"])
    assert parsed.func(parsed) == 0
    assert "dram get (store)" in capsys.readouterr().out
    assert (tmp_path / "r" / "tier_throughput-latest.json").exists()
