"""`kvcache bench decode-profile` / `python -m kvcache.benchmarks.decode_profile`: where a decode
step's time goes (torch.profiler): host time per step, kernel launches and device syncs per step,
how long the device is busy, and the ops with the most host time. aten op calls are counted nested
(aten::to -> aten::_to_copy -> aten::copy_ is 3). The profiled run includes its prefill step; the
numbers are per step over all of them. The report (JSON, with the machine description) goes to
OUT_DIR/decode_profile_<device>-<time>.json and -latest.json; examples in verbs.PROFILE_EPILOG.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvcache.benchmarks import verbs
from kvcache.benchmarks.model import CONFIG_DIR
from kvcache.benchmarks.record import machine_info, write_results
from kvcache.engine.checkpoint.init import random_weights
from kvcache.engine.model_config import ModelConfig
from kvcache.engine.device import select
from kvcache.engine.llm import LLM
from kvcache.engine.config import EngineConfig
from kvcache.engine.models import build_model
from kvcache.engine.sampling import SamplingParams

LAUNCHES = ("cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profile_decode(config: str, device: str, batch: int, steps: int, compile_: bool, device_experts,
                   planned_decode: bool = True, cuda_graphs: bool = False) -> dict:
    place = select(device)
    cfg = ModelConfig.load(os.path.join(CONFIG_DIR, f"{config}.json"))
    model = random_weights(build_model(cfg), 0).eval().to(place.device, place.dtype)
    block = max(r for r in cfg.compress_ratios if r > 0)
    prompts = [[3 + (i * 7919 + r * 31) % (cfg.vocab_size - 3) for i in range(128)] for r in range(batch)]
    llm = LLM(model=model, config=EngineConfig(block_size=block, num_blocks=max(64, batch * 4 + 8),
                                               max_tokens_per_step=max(512, 128 * batch), max_running=batch,
                                               compile=compile_, device_experts=device_experts,
                                               planned_decode=planned_decode, cuda_graphs=cuda_graphs))
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    llm.generate(prompts, params)                                  # every kernel and graph met once
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    tpot = statistics.median(o[0].metrics.tpot_s(steps + 1) for o in outs)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if place.device != "cpu" else [])
    with profile(activities=activities) as prof:
        llm.generate(prompts, params)
    events = prof.key_averages()
    n = steps + 1                                                  # the prefill step is in there too
    ops = [e for e in events if e.key.startswith("aten::")]
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:20]
    return {"tpot_ms": tpot * 1e3, "generate_s": wall, "steps_profiled": n,
            "launches_per_step": sum(e.count for e in events if e.key in LAUNCHES) / n,
            "syncs_per_step": sum(e.count for e in events if e.key in SYNCS) / n,
            "aten_calls_per_step": sum(e.count for e in ops) / n,
            "device_busy_ms_per_step": sum(e.self_device_time_total for e in events) / 1e3 / n,
            "top_host_ops": [{"op": e.key[:80], "calls_per_step": e.count / n,
                              "self_host_ms_per_step": e.self_cpu_time_total / 1e3 / n} for e in top]}


def run(config: str, device: str, batch: int, steps: int, compile_: bool, device_experts, out_dir: str,
        planned_decode: bool = True, cuda_graphs: bool = False) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    r = profile_decode(config, device, batch, steps, compile_, device_experts, planned_decode, cuda_graphs)
    doc = {"benchmark": "decode_profile", "time_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
           "machine": {**machine_info(out_dir), "torch": torch.__version__},
           "config": {"config": config, "device": device, "batch": batch, "steps": steps, "compiled": compile_,
                      "device_experts": {None: "auto", True: "on", False: "off"}[device_experts],
                      "planned_decode": planned_decode, "cuda_graphs": cuda_graphs},
           "results": r}
    write_results(doc, out_dir, f"decode_profile_{device.split(':')[0]}")
    return doc


def format_report(doc: dict) -> str:
    c, r = doc["config"], doc["results"]
    planned = c.get("planned_decode", c.get("block_decode", True))    # older results say block_decode
    how = (("compiled" if c["compiled"] else "eager") + ("" if planned else ", general decode")
           + (", CUDA graphs" if c.get("cuda_graphs") else ""))
    lines = [f"{c['config']} b{c['batch']} on {c['device']} ({how}): TPOT "
             f"{r['tpot_ms']:.2f} ms, {r['launches_per_step']:.0f} launches, {r['syncs_per_step']:.0f} syncs, "
             f"{r['aten_calls_per_step']:.0f} aten op calls a step; "
             f"device busy {r['device_busy_ms_per_step']:.2f} ms a step"]
    lines += [f"  {op['op']:<60} {op['calls_per_step']:7.1f} calls  {op['self_host_ms_per_step']:7.3f} ms"
              for op in r["top_host_ops"][:12]]
    return "\n".join(lines)



# ---------------------------------------------------------------- CLI
def run_args(args: argparse.Namespace) -> int:
    doc = run(args.config, args.device, args.batch, args.steps, not args.eager, verbs.EXPERTS[args.device_experts],
              args.out_dir, planned_decode=not args.general_decode, cuda_graphs=args.cuda_graphs)
    print(format_report(doc))
    print(f"wrote {doc['files']['json']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return verbs.main("decode_profile", argv)


if __name__ == "__main__":
    sys.exit(main())
