"""`kvcache bench engine` / `python -m kvcache.benchmarks.engine`: offline throughput and latency
of the engine against transformers' `generate` on the same V4 weights, in the same run.

    per config (v4-tiny, v4-small) and batch (1, 8, 32): `batch` prompts of `prompt_tokens` random
    ids, greedy, `output_tokens` new tokens each (EOS ignored)
        prefill  = the run with max_tokens 1        (ours: LLM.generate; transformers: generate)
        decode   = full run - prefill               decode tokens/s = batch x (output - 1) / decode
        TTFT, TPOT from the engine's request metrics
    ours = the engine with compiled layers (engine/compiled.py) after a warm-up run that compiles
    (--cuda-graphs: and its decode steps replayed as CUDA graphs, engine/decode_graphs.py);
    ours_eager = the same engine uncompiled, in the same run; each of the three runs untimed once first
    device: cpu (fp32) or cuda / npu (bf16 weights, both engines; results file engine_throughput_<device>)
    ratios: decode_tokens_per_s_vs_hf_b{batch} (ours / transformers; `_eager`: uncompiled), per config
    ceiling: the memory-bandwidth bound on decode tokens/s at each batch (engine/roofline.py), and
    the highest ratio against transformers that bound allows (max_decode_ratio_vs_hf_b{batch})
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time

import torch

from kvcache.benchmarks import verbs
from kvcache.benchmarks.model import CONFIG_DIR, hf_twin
from kvcache.engine.checkpoint.init import random_weights
from kvcache.engine.model_config import ModelConfig
from kvcache.engine.device import Placement, select, synchronize
from kvcache.engine.llm import LLM
from kvcache.engine.config import EngineConfig
from kvcache.engine.models import build_model
from kvcache.engine.roofline import ceiling, read_bandwidth
from kvcache.engine.sampling import SamplingParams


def _ours(model, prompts: list[list[int]], out_tokens: int, block: int, compile_: bool,
          device_experts: bool | None = None, cuda_graphs: bool = False) -> dict:
    cfg = EngineConfig(block_size=block, num_blocks=max(64, len(prompts) * (len(prompts[0]) + out_tokens) // block + 8),
                       max_tokens_per_step=max(512, len(prompts[0])), max_running=len(prompts), compile=compile_,
                       device_experts=device_experts, cuda_graphs=cuda_graphs)

    def run(n):
        llm = LLM(model=model, config=cfg)
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - t, outs        # (tokens reach the host each step: no sync needed)
    t0 = time.perf_counter()
    # untimed first: the compiled engine compiles at start (warm_up) and one full run meets every
    # step shape; the eager one loads its kernels and libraries (on a GPU the first run's cuBLAS
    # and allocator set-up would otherwise land in the timed prefill)
    run(out_tokens if compile_ else 2)
    warmup_s = time.perf_counter() - t0 if compile_ else 0.0
    prefill_s, _ = run(1)
    total_s, outs = run(out_tokens)
    ttft = statistics.median(o[0].metrics.ttft_s for o in outs)
    tpot = statistics.median(o[0].metrics.tpot_s(out_tokens) or 0 for o in outs)
    return {"prefill_s": prefill_s, "total_s": total_s, "ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3,
            "compile_warmup_s": warmup_s, "tokens": [o[0].token_ids for o in outs]}


def _theirs(hf, prompts: list[list[int]], out_tokens: int) -> dict:
    device = next(hf.parameters()).device
    ids = torch.tensor(prompts, device=device)

    def run(n):
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids),
                        pad_token_id=0)
        synchronize(device)
        return time.perf_counter() - t
    run(2)                                  # untimed, as for ours
    return {"prefill_s": run(1), "total_s": run(out_tokens)}


def _agreement(a: list[list[int]], b: list[list[int]] | None) -> float | None:
    """The share of token positions where two greedy runs agree, up to the first difference per request."""
    if b is None:
        return None
    same = 0
    for x, y in zip(a, b):
        same += next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
    return same / max(sum(len(x) for x in a), 1)


def _rates(r: dict, batch: int, prompt: int, out_tokens: int) -> dict:
    decode_s = max(r["total_s"] - r["prefill_s"], 1e-9)
    return {**r, "prompt_tokens_per_s": batch * prompt / r["prefill_s"],
            "decode_tokens_per_s": batch * (out_tokens - 1) / decode_s}


def bench_config(name: str, batches: list[int], prompt_tokens: int, out_tokens: int, seed: int, bar=None,
                 bandwidth: float | None = None, compile_: bool = True,
                 place: Placement = Placement("cpu", torch.float32), device_experts: bool | None = None,
                 cuda_graphs: bool = False) -> dict:
    config = ModelConfig.load(os.path.join(CONFIG_DIR, f"{name}.json"))
    model = random_weights(build_model(config), seed).eval()
    hf = hf_twin(model, config).to(place.device, place.dtype)        # the same weights, same precision
    model = model.to(place.device, place.dtype)
    block = max(r for r in config.compress_ratios if r > 0)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for b in batches:
        prompts = torch.randint(3, config.vocab_size, (b, prompt_tokens), generator=g).tolist()
        eager = _rates(_ours(model, prompts, out_tokens, block, False, device_experts), b, prompt_tokens, out_tokens)
        ours = _rates(_ours(model, prompts, out_tokens, block, True, device_experts, cuda_graphs), b, prompt_tokens,
                      out_tokens) if compile_ else eager
        # compiled kernels round differently from eager ones: in fp32 the greedy tokens agree, in
        # bf16 a near tie can part them; the share that agrees is reported, not assumed
        agree = _agreement(ours.pop("tokens"), eager.pop("tokens") if ours is not eager else None)
        theirs = _rates(_theirs(hf, prompts, out_tokens), b, prompt_tokens, out_tokens)
        out[f"b{b}"] = {"ours": ours, "ours_eager": eager, "transformers": theirs,
                        "decode_ratio": ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"],
                        "decode_ratio_eager": eager["decode_tokens_per_s"] / theirs["decode_tokens_per_s"],
                        "prompt_ratio": ours["prompt_tokens_per_s"] / theirs["prompt_tokens_per_s"],
                        "greedy_tokens_compiled_eq_eager": agree}
        if bandwidth:
            top = ceiling(model, b, bandwidth)
            out[f"b{b}"]["ceiling"] = top
            out[f"b{b}"]["max_decode_ratio_vs_hf"] = top["max_decode_tokens_per_s"] / theirs["decode_tokens_per_s"]
        if bar is not None:
            bar.update(1)
    return out


def run(configs: list[str], batches: list[int], out_dir: str, prompt_tokens: int = 128, out_tokens: int = 32,
        seed: int = 0, progress: bool = True, compile_: bool = True, device: str = "cpu",
        device_experts: bool | None = None, cuda_graphs: bool = False) -> dict:
    """compile_=False: "ours" is the eager engine (no C++ compiler, or a quick look)."""
    from tqdm import tqdm
    from kvcache.benchmarks.record import machine_info, write_results
    os.makedirs(out_dir, exist_ok=True)
    place = select(device)
    started = time.perf_counter()
    bandwidth = read_bandwidth(device=place.device)
    with tqdm(total=len(configs) * len(batches), desc="engine benchmark", unit="run", disable=not progress) as bar:
        results = {n: bench_config(n, batches, prompt_tokens, out_tokens, seed, bar, bandwidth, compile_, place,
                                   device_experts, cuda_graphs) for n in configs}
    doc = {"benchmark": "engine_throughput", "time_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
           "elapsed_s": time.perf_counter() - started,
           "machine": {**machine_info(out_dir), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                       "accelerator": _accelerator(place.device)},
           "config": {"configs": configs, "batches": batches, "prompt_tokens": prompt_tokens,
                      "output_tokens": out_tokens, "seed": seed, "device": place.device,
                      "device_experts": {None: "auto", True: "on", False: "off"}[device_experts],
                      "cuda_graphs": cuda_graphs, "dtype": f"{str(place.dtype).removeprefix('torch.')} weights",
                      "sampling": "greedy",
                      "ours": ("EngineConfig(compile=True) after a warm-up run that compiles (compile_warmup_s); "
                               "ours_eager: the same engine uncompiled") if compile_ else "the eager engine (--eager)",
                      "baseline": "transformers DeepseekV4ForCausalLM.generate, same weights, eager attention"},
           "results": results, "targets": {"decode_tokens_per_s_vs_hf_b1": 3.0, "decode_tokens_per_s_vs_hf_b8": 10.0}}
    ref = "v4-small" if "v4-small" in results else configs[-1]
    for b in (1, 8):
        if f"b{b}" in results[ref]:
            doc[f"decode_tokens_per_s_vs_hf_b{b}"] = results[ref][f"b{b}"]["decode_ratio"]
            doc[f"decode_tokens_per_s_vs_hf_b{b}_eager"] = results[ref][f"b{b}"]["decode_ratio_eager"]
            doc[f"max_decode_ratio_vs_hf_b{b}"] = results[ref][f"b{b}"]["max_decode_ratio_vs_hf"]
    kind = place.device.split(":")[0]
    write_results(doc, out_dir, "engine_throughput" if kind == "cpu" else f"engine_throughput_{kind}")
    return doc


def _accelerator(device: str) -> str | None:
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(torch.device(device))
        return f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, CUDA {torch.version.cuda}"
    return None if device == "cpu" else device


def format_table(doc: dict) -> str:
    lines = ["decode tokens/s (ours compiled | transformers | ratio; eager ratio), prompt tokens/s ratio, "
             "TTFT / TPOT (ours compiled):"]
    for name, r in doc["results"].items():
        for b, row in r.items():
            o, t = row["ours"], row["transformers"]
            lines.append(f"  {name:<9} {b:>4}  {o['decode_tokens_per_s']:8.1f} | {t['decode_tokens_per_s']:8.1f} | "
                         f"{row['decode_ratio']:5.2f}x; eager {row['decode_ratio_eager']:5.2f}x   prompt "
                         f"{row['prompt_ratio']:5.2f}x   TTFT {o['ttft_ms']:7.0f} ms  TPOT {o['tpot_ms']:6.1f} ms")
    for k, target in doc["targets"].items():
        if k in doc:
            top = doc.get(k.replace("decode_tokens_per_s_vs_hf", "max_decode_ratio_vs_hf"))
            reach = "" if top is None else (f"; this machine's memory bandwidth allows at most {top:.1f}"
                                            + (" (target out of reach here)" if top < target else ""))
            lines.append(f"  {k} = {doc[k]:.2f} (target >= {target}: {'PASS' if doc[k] >= target else 'MISS'}{reach})")
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI
def run_args(args: argparse.Namespace) -> int:
    doc = run(args.configs,
              args.batches, args.out_dir, args.prompt_tokens,
              args.output_tokens, args.seed, progress=not args.no_progress, compile_=not args.eager,
              device=args.device, device_experts=verbs.EXPERTS[args.device_experts],
              cuda_graphs=args.cuda_graphs)
    print(format_table(doc))
    print(f"\nwrote {doc['files']['json']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return verbs.main("engine", argv)


if __name__ == "__main__":
    sys.exit(main())
