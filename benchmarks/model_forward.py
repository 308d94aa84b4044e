#!/usr/bin/env python3
"""Model forward benchmark: the engine's DeepSeek-V4 against transformers on the same weights.

    python benchmarks/model_forward.py                       # v4-tiny, v4-small at 512 / 2k / 8k tokens
    python benchmarks/model_forward.py --configs v4-tiny --lengths 128,512

The same as `kvcache bench model`, with reports in benchmarks/results/ beside this file. The
logic lives in kvcache.benchmarks.model (`run(configs, lengths, out_dir, ...) -> dict`).
"""

from __future__ import annotations

import argparse
import os
import sys

from kvcache.cli.bench import MODEL_EPILOG, add_model_arguments, run_model

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="model_forward.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=MODEL_EPILOG)
    add_model_arguments(p, default_out_dir=RESULTS)
    return run_model(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
