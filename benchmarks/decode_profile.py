#!/usr/bin/env python3
"""Where a decode step's time goes: host time per step, kernel launches and device syncs per step,
how long the device itself is busy, and the ops that cost the most host time (torch.profiler).

    python benchmarks/decode_profile.py --device cuda --batch 1              # compiled engine, v4-small
    python benchmarks/decode_profile.py --device cuda --batch 8 --eager --device-experts off
    python benchmarks/decode_profile.py --device cuda --batch 1 --cuda-graphs  # decode steps as CUDA graphs
    python benchmarks/decode_profile.py --device cpu --batch 1                # CPU: op calls instead of launches
    python benchmarks/decode_profile.py --device cpu --batch 1 --general-decode   # the A/B for block decode

A step that is mostly host time (launches, Python, guards) with the device idle is what CUDA
graphs or fewer, larger kernels fix; a busy device is what faster kernels fix. Writes
results/decode_profile_<device>-<time>.json (and -latest.json) with the machine description.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvcache.engine.bench_decode_profile import format_report, run

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="v4-small")
    p.add_argument("--device", default="cpu", help="cpu, cuda[:i] or npu[:i]")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=16, help="decode steps per run (default 16)")
    p.add_argument("--eager", action="store_true", help="the uncompiled engine")
    p.add_argument("--device-experts", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--general-decode", action="store_true",
                   help="decode steps by the general path (EngineConfig(block_decode=False)), for the A/B")
    p.add_argument("--cuda-graphs", action="store_true", help="decode steps replayed as CUDA graphs")
    p.add_argument("--out-dir", default=RESULTS)
    a = p.parse_args(argv)
    doc = run(a.config, a.device, a.batch, a.steps, not a.eager,
              {"auto": None, "on": True, "off": False}[a.device_experts], a.out_dir,
              block_decode=not a.general_decode, cuda_graphs=a.cuda_graphs)
    print(format_report(doc))
    print(f"wrote {doc['files']['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
