"""`kvcache bench cold-warm` / `python -m kvcache.benchmarks.cold_warm`: what the cache buys, cold
against warm from each tier, with each cost measured on its own and the floor each tier allows.

    workload "document": a shared prefix of L tokens (2k, 8k, ...) + a 32-token question
      cold          an engine without cache (its second run: cold compute on warm memory)
      fill          an engine that saves to the store (cold + the cost of saving); then the same
                    long-lived engine for every warm scenario, the same prompt each time:
      warm_pool     again at once: the prefix from the engine's own block pool (HBM tier)
      warm_dram     the pool's prefixes forgotten (reset_prefix_cache): the store's DRAM
      warm_nvme     + the store under the engine reopened (its DRAM empty), its files evicted
                    from the page cache
      restart       the store closed and reopened and a new engine built on it (a restart of
                    both; one discarded request of another prompt first, so that its cost model
                    has a prefill speed): NVMe, DRAM empty; the new engine serves warm_object too
      warm_object   + the store reopened on an empty data directory that shares the bucket (its
                    index rebuilt from the packs: DRAM and NVMe empty), the object files
                    (file:// packs) evicted
    warm_nvme, restart and warm_object reopen the store before every run (with the store's
    public API only: benchmarks/cold_warm_store.py), so no run's promotions into DRAM serve the next.
    workload "chat": turn 2 = turn 1 + its answer + a new message (warm from DRAM vs cold)
    workload "shared": 8 users, one system prompt, different messages, submitted together

    floor(tier) = bytes loaded / that tier's raw read bandwidth (measured in the same run: memcpy,
                  os.read of the evicted segment / pack files) + the warm_pool TTFT (the compute
                  that remains once the prefix is in the pool: the question and the snapshot restore)
    breakeven   = the prefix length where a tier's warm TTFT meets the cold TTFT (linear fits over
                  the measured lengths)

Exact mode (tail snapshots): every warm run's tokens are checked equal to the cold run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import os
import resource
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

from kvcache.benchmarks import verbs
from kvcache.benchmarks.cold_warm_report import chat_workload, format_table, shared_workload, write_report
from kvcache.benchmarks.cold_warm_store import ReopenableStore
from kvcache.benchmarks.page_cache import evict_page_cache
from kvcache.engine.config import CacheConfig, EngineConfig
from kvcache.engine.llm import LLM
from kvcache.engine.sampling import SamplingParams

TIER_SCENARIOS = {"warm_dram": "dram", "warm_nvme": "nvme", "warm_object": "object", "restart": "nvme"}
TARGETS = {"warm_dram_ttft_vs_cold": 0.1, "warm_nvme_ttft_vs_cold": 0.15, "warm_object_ttft_vs_cold": 0.3,
           "worst_warm_ttft_vs_floor": 1.5}


def _read_bandwidth(root: str, nbytes: int) -> float:
    """Bytes/s of plain reads of the files under root right after evicting them (up to nbytes)."""
    evict_page_cache(root)
    buf, got, t0 = bytearray(8 << 20), 0, time.perf_counter()
    for d, _, files in os.walk(root):
        for f in sorted(files):
            with open(os.path.join(d, f), "rb", buffering=0) as fh:
                while got < nbytes and (n := fh.readinto(buf)):
                    got += n
    return got / max(time.perf_counter() - t0, 1e-9) if got else float("nan")


def _memcpy_bandwidth(nbytes: int) -> float:
    src = np.ones(max(nbytes, 1 << 20), np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return src.nbytes / best


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _measure(llm: LLM, prompt: list[int], out_tokens: int) -> dict:
    c = llm.generate([prompt], SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True))[0][0]
    req = llm.engine.requests[c.request_id]
    m, u = c.metrics, req.usage
    decode_s = (m.finished - m.first_token) if out_tokens > 1 else 0.0
    return {"ttft_s": m.ttft_s, "prefill_tokens_computed": m.tokens_computed - (out_tokens - 1),
            "prompt_tokens": len(prompt), "cached_tokens": dict(u.cached_tokens) if u else {},
            "bytes_loaded": u.bytes_loaded if u else 0, "load_s": u.load_s if u else 0.0,
            "decode_tokens_per_s": (out_tokens - 1) / decode_s if decode_s > 0 else None,
            "rss_bytes": _rss_bytes(), "tokens": c.token_ids}


def _footprint(store, root: str) -> dict:
    """Bytes the cache holds per tier, peak RSS, accelerator memory."""
    out = {f"{t.tier}_bytes": t.used_bytes for t in store.stats().tiers}
    out["object_bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(root, "bucket"))
                              for f in fs)
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["accelerator_bytes"] = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return out


def _median(runs: list[dict]) -> dict:
    """The run with the median TTFT (each warm scenario runs `repeats` times)."""
    runs = sorted(runs, key=lambda r: r["ttft_s"])
    return {**runs[len(runs) // 2], "ttft_runs_s": [r["ttft_s"] for r in runs]}


def document_workload(model, cfg: EngineConfig, length: int, out_tokens: int, root: str, seed: int,
                      repeats: int = 3) -> dict:
    """Cold, fill, warm from each tier and after a restart, for one prefix length."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed + length)
    doc = torch.randint(3, vocab, (length,), generator=g).tolist()
    prompt = doc + torch.randint(3, vocab, (32,), generator=g).tolist()     # one prompt: outputs must agree
    cached = dataclasses.replace(cfg, cache=CacheConfig(mode="exact"))
    res, store = {}, ReopenableStore(root, fresh=True)
    plain = LLM(model=model, config=cfg)                  # no cache: the second run is cold on warm memory
    _measure(plain, prompt, 2)
    res["cold"] = _measure(plain, prompt, out_tokens)
    del plain
    llm = LLM(model=model, config=cached, store=store)    # one long-lived engine for every warm scenario
    res["fill"] = _measure(llm, prompt, out_tokens)
    res["warm_pool"] = _median([_measure(llm, prompt, out_tokens) for _ in range(repeats)])

    def warm(name: str, reopen=None) -> None:
        runs = []
        for _ in range(repeats):
            llm.engine.cache.connector.flush()
            store.flush()
            llm.engine.reset_prefix_cache()               # nothing left in the engine's own pool
            if reopen is not None:
                reopen()                                  # the faster tiers' copies out of reach
            evict_page_cache(root)
            runs.append(_measure(llm, prompt, out_tokens))
        res[name] = _median(runs)
    warm("warm_dram")
    warm("warm_nvme", store.reopen)
    res["footprint"] = _footprint(store, root)
    llm.engine.cache.connector.flush()
    llm.close()
    del llm
    gc.collect()
    store.reopen()                                        # restart: the index from disk, DRAM empty,
    llm = LLM(model=model, config=cached, store=store)    # and a new engine on it (warm() sees both)
    # A new engine has not measured its prefill speed, so its cost model is off and it would load
    # every hit whatever the tier costs; one discarded request first (another prompt of the same
    # length, all computed), as a restarted server serves others before this prompt comes again,
    # lets it weigh loading against recomputing as the long-lived engine did
    other = torch.Generator().manual_seed(seed + length + 1)
    _measure(llm, torch.randint(3, vocab, (len(prompt),), generator=other).tolist(), 1)
    warm("restart", store.reopen)                         # every run as right after it: DRAM empty
    warm("warm_object", lambda: store.reopen(bucket_only=True))
    llm.close()
    store.close()
    want = res["cold"]["tokens"]
    res["exact"] = {k: v["tokens"] == want for k, v in res.items() if isinstance(v, dict) and "tokens" in v
                    and k != "cold"}
    return res


def _floors(res: dict, bw: dict) -> dict:
    base = res["warm_pool"]["ttft_s"]
    out = {}
    for name, tier in TIER_SCENARIOS.items():
        b = res[name]["bytes_loaded"]
        out[name] = {"tier": tier, "floor_s": b / bw[tier] + base, "ttft_s": res[name]["ttft_s"],
                     "ttft_vs_floor": res[name]["ttft_s"] / (b / bw[tier] + base)}
    return out


def _breakeven(per_length: dict) -> dict:
    """Prefix length where warm meets cold, from linear fits over the measured lengths."""
    lengths = sorted(per_length)
    if len(lengths) < 2:
        return {}
    out = {}
    cold = np.polyfit(lengths, [per_length[n]["cold"]["ttft_s"] for n in lengths], 1)
    for name in ("warm_pool", *TIER_SCENARIOS):
        warm = np.polyfit(lengths, [per_length[n][name]["ttft_s"] for n in lengths], 1)
        slope = cold[0] - warm[0]
        out[name] = float((warm[1] - cold[1]) / slope) if slope > 0 else None
    return out


def run(config: str = "v4-small", lengths=(2048, 8192, 32768), out_tokens: int = 16,
        out_dir: str = "benchmarks/results", seed: int = 0, progress: bool = True,
        workloads=("document", "chat", "shared")) -> dict:
    from tqdm import tqdm
    from kvcache.benchmarks.model import CONFIG_DIR
    from kvcache.engine.checkpoint.init import random_weights
    from kvcache.engine.model_config import ModelConfig
    from kvcache.engine.models import build_model
    from kvcache.benchmarks.record import machine_info, write_results
    torch.manual_seed(seed)
    mc = ModelConfig.load(os.path.join(CONFIG_DIR, f"{config}.json"))
    model = random_weights(build_model(mc), seed).eval()
    block = max(r for r in mc.compress_ratios if r > 0)
    cfg = EngineConfig(block_size=block, num_blocks=max(256, 3 * (max(lengths) + 256) // block),
                       max_tokens_per_step=512, max_running=16)
    os.makedirs(out_dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix=".kvcache-coldwarm-", dir=os.path.abspath(out_dir))
    started, doc = time.perf_counter(), {}
    try:
        steps = len(lengths) + len([w for w in workloads if w != "document"])
        with tqdm(total=steps, desc="cold-warm benchmark", unit="run", disable=not progress) as bar:
            per_length = {}
            for n in lengths:
                bar.set_postfix_str(f"document {n}")
                per_length[n] = document_workload(model, cfg, n, out_tokens, root, seed)
                bar.update(1)
            nbytes = max(r["warm_nvme"]["bytes_loaded"] for r in per_length.values()) or (1 << 20)
            bw = {"dram": _memcpy_bandwidth(nbytes), "nvme": _read_bandwidth(os.path.join(root, "data"), nbytes),
                  "object": _read_bandwidth(os.path.join(root, "bucket"), nbytes)}
            extra = {}
            if "chat" in workloads:
                bar.set_postfix_str("chat")
                extra["chat"] = chat_workload(model, cfg, min(lengths), out_tokens, root, seed)
                bar.update(1)
            if "shared" in workloads:
                bar.set_postfix_str("shared")
                extra["shared"] = shared_workload(model, cfg, min(lengths), out_tokens, root, seed)
                bar.update(1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ref = 8192 if 8192 in per_length else max(per_length)
    r = per_length[ref]
    floors = {n: _floors(v, bw) for n, v in per_length.items()}
    doc = {"benchmark": "cold_warm", "time_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
           "elapsed_s": time.perf_counter() - started,
           "machine": {**machine_info(out_dir), "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
           "config": {"model": config, "weights": "random (demo)", "lengths": list(lengths), "question_tokens": 32,
                      "output_tokens": out_tokens, "engine": dataclasses.asdict(cfg), "cache_mode": "exact",
                      "store": "in-process BlockStore: DRAM 1 GiB, NVMe fsync always, object file:// packs",
                      "reference_length": ref},
           "tier_bandwidth_bytes_per_s": bw,
           "results": {str(n): {k: ({kk: vv for kk, vv in v.items() if kk != "tokens"} if isinstance(v, dict) else v)
                                for k, v in res.items()} for n, res in per_length.items()},
           "floors": {str(n): f for n, f in floors.items()}, "breakeven_prefix_tokens": _breakeven(per_length),
           "workloads": extra, "targets": TARGETS}
    for name, key in (("warm_dram", "warm_dram_ttft_vs_cold"), ("warm_nvme", "warm_nvme_ttft_vs_cold"),
                      ("warm_object", "warm_object_ttft_vs_cold")):
        doc[key] = r[name]["ttft_s"] / r["cold"]["ttft_s"]
    doc["worst_warm_ttft_vs_floor"] = max(f["ttft_vs_floor"] for f in floors[ref].values())
    doc["warm_matches_cold"] = all(all(v["exact"].values()) for v in per_length.values())
    write_results(doc, out_dir, "cold_warm")
    write_report(doc, out_dir)
    return doc



# ---------------------------------------------------------------- CLI
def run_args(args: argparse.Namespace) -> int:
    doc = run(args.config, tuple(args.lengths), args.output_tokens,
              args.out_dir, args.seed, progress=not args.no_progress,
              workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()))
    print(format_table(doc))
    print(f"\nwrote {doc['files']['json']}\n  and {os.path.join(args.out_dir, 'cold_warm-latest.md')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return verbs.main("cold_warm", argv)


if __name__ == "__main__":
    sys.exit(main())
