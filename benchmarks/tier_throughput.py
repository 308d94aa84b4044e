#!/usr/bin/env python3
"""Tier throughput benchmark: DRAM and NVMe tiers against memcpy and raw disk I/O.

    python benchmarks/tier_throughput.py                       # 64K,256K,1M,4M x 256 MiB
    python benchmarks/tier_throughput.py --sizes 1M --total-mib 64 --index-blocks 100000

Same as `kvcache bench tiers`; the logic lives in kvcache.tiering.bench_tiers (installed).
Writes benchmarks/results/tier_throughput-<UTC time>.json and tier_throughput-latest.json.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvcache.tiering import bench_tiers

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tier_throughput.py", description=bench_tiers.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_tiers.add_arguments(p, default_out_dir=RESULTS)
    return p


def main(argv: list[str] | None = None) -> int:
    bench_tiers.run_from_args(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
