"""`kvcache bench vllm`: what the KV connector buys a vLLM user, against vLLM's own prefix cache.

A prefix of several thousand tokens, repeated with different short suffixes, on a random-weight
Llama made here (integrations/tiny_llama.py, deep enough that prefill costs seconds on a CPU),
each engine in its own process (benchmarks/vllm_runner.py), `kvcache serve` in another:

    cold        vLLM, prefix caching off, no connector: every prompt computes the prefix
    vllm cache  vLLM's own prefix cache on: the first prompt computes, the others hit in its pool
    connector   prefix caching off, the connector on: the first prompt computes and saves, the
                others load the prefix from the daemon (DRAM, over shared memory)

TTFT is the time of a generate() of one token (the whole prefill). The connector's load
throughput (bytes loaded / time from the load's start to its last block copied into vLLM's KV)
is compared with the daemon's own get throughput: get_many_into of blocks of the same size by a
KVClient on the same host, in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from kvcache.benchmarks.daemon_servers import MissingDependency, print_report, start_daemon
from kvcache.benchmarks.record import load_now, machine_info, write_results
from kvcache.integrations.tiny_llama import TinyLlama

BLOCK = 128
SUFFIX = 8
TARGETS = {"vllm_warm_ttft_vs_cold": ("<=", 0.3), "connector_load_vs_daemon_get": (">=", 0.8)}


def bench_model(layers: int) -> TinyLlama:
    return TinyLlama(hidden=512, layers=layers, heads=8, kv_heads=8, head_dim=64, intermediate=1408, vocab=2048,
                     max_positions=32768)


def vllm_python(explicit: str | None) -> str:
    """A Python with vLLM: --vllm-python, $KVCACHE_VLLM_PYTHON, or this one if it has vLLM."""
    for cand in (explicit, os.environ.get("KVCACHE_VLLM_PYTHON")):
        if cand:
            return cand
    import importlib.util
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise MissingDependency("vLLM is not installed here: `pip install -e '.[vllm]'` (a venv of its own; see the "
                            "README), then pass its python with --vllm-python or $KVCACHE_VLLM_PYTHON")


def run_engine(python: str, cfg: dict, log_path: str) -> tuple[list[dict], dict]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    with open(log_path, "w") as log:
        p = subprocess.run([python, "-m", "kvcache.benchmarks.vllm_runner", "-"], input=json.dumps(cfg),
                           stdout=subprocess.PIPE, stderr=log, text=True, env=env, timeout=1800)
    if p.returncode:
        with open(log_path, errors="replace") as f:
            raise RuntimeError(f"the vLLM run failed ({p.returncode}); its log:\n{f.read()[-3000:]}")
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    return [x for x in lines if "prompt" in x], next((x for x in lines if "worker" in x), {})


def daemon_get_gbps(url: str, payload_bytes: int, blocks: int, repeats: int) -> float:
    """The daemon's own get_many_into throughput for blocks of `payload_bytes` (a local KVClient)."""
    from kvcache.client.open_store import open_store
    from kvcache.kvstore.hashing import Namespace
    from kvcache.kvstore.types import PutItem
    ns = Namespace("bench-vllm-baseline", "raw", BLOCK)
    rng = np.random.default_rng(0)
    keys = [rng.bytes(16) for _ in range(blocks)]
    payload = rng.bytes(payload_bytes)
    outs = [bytearray(payload_bytes) for _ in range(blocks)]
    best = 0.0
    with open_store(url) as store:
        nid = store.register_namespace(ns)
        store.put_many([PutItem(k, payload, nid) for k in keys])
        store.get_many_into(keys, outs)                       # warm-up: attach shared memory, page in
        for _ in range(repeats):
            t = time.perf_counter()
            got = store.get_many_into(keys, outs)
            dt_s = time.perf_counter() - t
            assert all(n == payload_bytes for n in got)
            best = max(best, blocks * payload_bytes / dt_s / 1e9)
    return best


def run(prefix_tokens: int, repeats: int, layers: int, out_dir: str, python: str | None = None,
        data_dir: str | None = None) -> dict:
    py = vllm_python(python)
    started, load = time.perf_counter(), load_now()
    root = tempfile.mkdtemp(prefix="kvcache-bench-vllm-", dir=data_dir)
    model = bench_model(layers)
    try:
        path = str(model.write(os.path.join(root, "model")))
        rng = np.random.default_rng(1)
        prefix = rng.integers(3, model.vocab, prefix_tokens).tolist()
        prompts = [prefix + rng.integers(3, model.vocab, SUFFIX).tolist() for _ in range(repeats + 1)]
        common = {"model": path, "prompts": prompts, "max_tokens": 1, "block_size": BLOCK,
                  "kv_bytes": max(256 << 20, 4 * prefix_tokens * model_kv_bytes_per_token(model)),
                  "max_model_len": prefix_tokens + 512, "max_batched_tokens": prefix_tokens + 512}
        with contextlib.ExitStack() as cleanup:
            daemon = start_daemon(cleanup, root, root, {"store": {"write_policy": "write-through"}})
            runs = {}
            for name, extra in (("cold", {}), ("vllm_cache", {"prefix_caching": True}),
                                ("connector", {"store": daemon["url"], "flush": True})):
                runs[name] = run_engine(py, {**common, **extra}, os.path.join(root, f"{name}.log"))
            payload = model_kv_bytes_per_token(model) * BLOCK
            daemon_gbps = daemon_get_gbps(daemon["url"], payload, prefix_tokens // BLOCK, max(3, repeats))
        machine = {**machine_info(root), "load_at_start": load}
    finally:
        shutil.rmtree(root, True)
    return report(runs, daemon_gbps, model, prefix_tokens, repeats, py, machine, out_dir, started)


def model_kv_bytes_per_token(model: TinyLlama) -> int:
    return model.layers * 2 * model.kv_heads * model.head_dim * 4          # fp32 K and V


def report(runs: dict, daemon_gbps: float, model: TinyLlama, prefix_tokens: int, repeats: int, py: str,
           machine: dict, out_dir: str, started: float) -> dict:
    ttft = {name: [r["seconds"] for r in results] for name, (results, _) in runs.items()}
    cached = {name: [r["cached"] for r in results] for name, (results, _) in runs.items()}
    cold = statistics.median(ttft["cold"])
    warm_vllm = statistics.median(ttft["vllm_cache"][1:])
    warm_conn = statistics.median(ttft["connector"][1:])
    w = runs["connector"][1].get("worker", {})
    # the first load attaches the client to the daemon's shared memory: the later ones are the rate
    steady = w.get("loads", [])[1:] or w.get("loads", [])
    conn_gbps = statistics.median(b / s / 1e9 for b, s in steady) if steady else 0.0
    same = [a["tokens"] == b["tokens"] for a, b in zip(runs["cold"][0], runs["connector"][0])]
    ratios = {"vllm_warm_ttft_vs_cold": warm_conn / cold, "vllm_prefix_cache_ttft_vs_cold": warm_vllm / cold,
              "connector_vs_vllm_prefix_cache_ttft": warm_conn / warm_vllm,
              "connector_load_vs_daemon_get": conn_gbps / daemon_gbps if daemon_gbps else 0.0}
    doc = {"benchmark": "vllm", "time_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
           "elapsed_s": time.perf_counter() - started, "machine": machine,
           "config": {"prefix_tokens": prefix_tokens, "suffix_tokens": SUFFIX, "warm_prompts": repeats,
                      "block_size": BLOCK, "model": model.config(), "vllm_python": py,
                      "kv_bytes_per_block": model_kv_bytes_per_token(model) * BLOCK,
                      "units": "seconds per generate() of one token; GB/s = 1e9 bytes/s"},
           "notes": [__doc__.split("\n\n", 1)[1].replace("\n", " ").strip()],
           "ttft_s": ttft, "cached_tokens": cached, "same_first_token_as_cold": all(same),
           "ttft_median_s": {"cold": cold, "vllm_cache_warm": warm_vllm, "connector_warm": warm_conn},
           "load": {"connector_gbps": conn_gbps, "daemon_get_gbps": daemon_gbps, "connector": w,
                    "seam": runs["connector"][1].get("seam", {})},
           "ratios": ratios,
           "targets": {k: {"target": f"{op} {v}", "met": ratios[k] <= v if op == "<=" else ratios[k] >= v}
                       for k, (op, v) in TARGETS.items()}}
    write_results(doc, out_dir, "vllm_connector")
    return doc


def format_table(doc: dict) -> str:
    t, r, ld = doc["ttft_median_s"], doc["ratios"], doc["load"]
    rows = [f"vLLM + kvcache connector, {doc['config']['prefix_tokens']}-token prefix "
            f"({doc['config']['model']['num_hidden_layers']} layers, fp32 KV)",
            f"  TTFT cold (prefix caching off)        {t['cold']:8.3f} s",
            f"  TTFT warm, vLLM's own prefix cache    {t['vllm_cache_warm']:8.3f} s   "
            f"{r['vllm_prefix_cache_ttft_vs_cold']:.3f} x cold",
            f"  TTFT warm, from the daemon            {t['connector_warm']:8.3f} s   "
            f"{r['vllm_warm_ttft_vs_cold']:.3f} x cold (target <= 0.3)",
            f"  connector load {ld['connector_gbps']:.2f} GB/s vs daemon get {ld['daemon_get_gbps']:.2f} GB/s: "
            f"{r['connector_load_vs_daemon_get']:.2f} (target >= 0.8)",
            f"  cached tokens {doc['cached_tokens']}; same first token as cold: {doc['same_first_token_as_cold']}"]
    return "\n".join(rows)


def run_args(args: argparse.Namespace) -> int:
    return print_report("vllm", lambda: run(args.prefix_tokens, args.repeats, args.layers, args.out_dir,
                                            python=args.vllm_python, data_dir=args.data_dir), format_table)


def main(argv: list[str] | None = None) -> int:
    from kvcache.benchmarks import verbs
    return verbs.main("vllm_bench", argv)


if __name__ == "__main__":
    sys.exit(main())
