#!/usr/bin/env python3
"""Tier throughput benchmark: DRAM and NVMe tiers against memcpy and raw disk I/O.

    python benchmarks/tier_throughput.py                  # 64K,256K,1M,4M x 256 MiB each
    python benchmarks/tier_throughput.py --sizes 1M --total-mib 64 --index-blocks 100000

The same as `kvcache bench tiers`, except that reports go to benchmarks/results/ beside
this file wherever it is run from. The logic lives in kvcache.benchmarks.tiers
(importable: `run(sizes, total_bytes, out_dir, repeats, ...) -> dict`).
"""

from __future__ import annotations

import argparse
import os
import sys

from kvcache.cli.bench import TIERS_EPILOG, add_tiers_arguments, run_tiers
from kvcache.benchmarks.tiers import run  # noqa: F401  (re-exported for importers)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tier_throughput.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=TIERS_EPILOG)
    add_tiers_arguments(p, default_out_dir=RESULTS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_tiers(args)


if __name__ == "__main__":
    sys.exit(main())
