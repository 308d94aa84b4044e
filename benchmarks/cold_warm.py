#!/usr/bin/env python3
"""Cold-versus-warm benchmark: what the prefix cache buys, from each tier, against each tier's floor.

    python benchmarks/cold_warm.py                                  # v4-small, 2k, 8k and 32k prefixes
    python benchmarks/cold_warm.py --lengths 2048,8192

The same as `kvcache bench cold-warm`, with reports in benchmarks/results/ beside this file. The logic
lives in kvcache.engine.bench_cold_warm (`run(config, lengths, ...) -> dict`).
"""

from __future__ import annotations

import argparse
import os
import sys

from kvcache.cli.bench import COLD_WARM_EPILOG, add_cold_warm_arguments, run_cold_warm

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cold_warm.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=COLD_WARM_EPILOG)
    add_cold_warm_arguments(p, default_out_dir=RESULTS)
    return run_cold_warm(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
