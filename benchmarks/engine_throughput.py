#!/usr/bin/env python3
"""Engine throughput benchmark: offline generation against transformers' generate, same weights.

    python benchmarks/engine_throughput.py                        # v4-tiny, v4-small at batch 1, 8, 32
    python benchmarks/engine_throughput.py --configs v4-tiny --batches 1,8

The same as `kvcache bench engine`, with reports in benchmarks/results/ beside this file. The logic
lives in kvcache.benchmarks.engine (`run(configs, batches, out_dir, ...) -> dict`).
"""

from __future__ import annotations

import argparse
import os
import sys

from kvcache.cli.bench import ENGINE_EPILOG, add_engine_arguments, run_engine

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="engine_throughput.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=ENGINE_EPILOG)
    add_engine_arguments(p, default_out_dir=RESULTS)
    return run_engine(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
