#!/usr/bin/env python3
"""Daemon throughput benchmark: `kvcache serve` (HTTP, unix socket) against redis-server and memcpy.

    python benchmarks/daemon_throughput.py                 # 256K,1M,4M x 128 MiB each
    python benchmarks/daemon_throughput.py --sizes 1M --total-mib 32 --repeats 1

The same as `kvcache bench daemon`, except that reports go to benchmarks/results/ beside
this file wherever it is run from. Needs redis-server (apt-get install redis-server) and
redis-py (pip install redis). The logic lives in kvcache.benchmarks.daemon
(importable: `run(sizes, total_bytes, out_dir, repeats, ...) -> dict`).
"""

from __future__ import annotations

import argparse
import os
import sys

from kvcache.benchmarks.daemon import EPILOG, add_arguments, run, run_daemon  # noqa: F401  (run: re-exported)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="daemon_throughput.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    add_arguments(p, default_out_dir=RESULTS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_daemon(args)
    except KeyboardInterrupt:   # processes and scratch directories are already cleaned up
        return 130


if __name__ == "__main__":
    sys.exit(main())
