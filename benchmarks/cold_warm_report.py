"""The cold-versus-warm benchmark's other workloads (multi-turn chat, many users sharing a system
prompt) and its Markdown report with a plot (benchmarks/cold_warm.py runs them)."""

from __future__ import annotations

import dataclasses
import os
import statistics

import torch

from kvcache.benchmarks.cold_warm_store import bench_store
from kvcache.engine.config import CacheConfig
from kvcache.engine.llm import LLM
from kvcache.engine.sampling import SamplingParams

SCENARIOS = ("cold", "fill", "warm_pool", "warm_dram", "warm_nvme", "warm_object", "restart")


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def chat_workload(model, cfg, length: int, out_tokens: int, root: str, seed: int) -> dict:
    """Turn 2 of a chat (turn 1 + its answer + a new message): cold, then warm from the store's
    DRAM after turn 1 ran in another engine (exact mode)."""
    g = torch.Generator().manual_seed(seed + 1)
    vocab = model.config.vocab_size
    turn1 = torch.randint(3, vocab, (length,), generator=g).tolist()
    store = bench_store(os.path.join(root, "chat"), fresh=True)
    cached = dataclasses.replace(cfg, cache=CacheConfig(mode="exact"))
    with LLM(model=model, config=cached, store=store) as first:
        answer = first.generate([turn1], _greedy(out_tokens))[0][0].token_ids
    turn2 = turn1 + answer + torch.randint(3, vocab, (48,), generator=g).tolist()
    cold = LLM(model=model, config=cfg).generate([turn2], _greedy(out_tokens))[0][0]
    with LLM(model=model, config=cached, store=store) as warm:
        hot = warm.generate([turn2], _greedy(out_tokens))[0][0]
        usage = warm.engine.requests[hot.request_id].usage
    store.close()
    return {"turn2_tokens": len(turn2), "cold_ttft_s": cold.metrics.ttft_s, "warm_ttft_s": hot.metrics.ttft_s,
            "ttft_ratio": hot.metrics.ttft_s / cold.metrics.ttft_s, "cached_tokens": dict(usage.cached_tokens),
            "exact": hot.token_ids == cold.token_ids}


def shared_workload(model, cfg, length: int, out_tokens: int, root: str, seed: int, users: int = 8) -> dict:
    """`users` requests with one system prompt and different messages, submitted together: cold
    (nothing cached) against warm (the system prompt stored by an earlier engine); the prefix is
    fetched once for all of them."""
    g = torch.Generator().manual_seed(seed + 2)
    vocab = model.config.vocab_size
    system = torch.randint(3, vocab, (length,), generator=g).tolist()
    prompts = [system + torch.randint(3, vocab, (24,), generator=g).tolist() for _ in range(users + 1)]
    store = bench_store(os.path.join(root, "shared"), fresh=True)
    cached = dataclasses.replace(cfg, cache=CacheConfig(mode="exact"))
    with LLM(model=model, config=cached, store=store) as first:
        first.generate(prompts[:1], _greedy(2))
    cold = LLM(model=model, config=cfg).generate(prompts[1:], _greedy(out_tokens))
    with LLM(model=model, config=cached, store=store) as warm:
        hot = warm.generate(prompts[1:], _greedy(out_tokens))
        fetched = warm.engine.cache.connector.stats["fetched_blocks"]
    store.close()
    ttft = lambda outs: statistics.mean(o[0].metrics.ttft_s for o in outs)  # noqa: E731
    return {"users": users, "system_tokens": length, "cold_mean_ttft_s": ttft(cold), "warm_mean_ttft_s": ttft(hot),
            "ttft_ratio": ttft(hot) / ttft(cold), "blocks_fetched": fetched,
            "prefix_blocks": length // cfg.block_size,
            "exact": [o[0].token_ids for o in hot] == [o[0].token_ids for o in cold]}


def format_table(doc: dict) -> str:
    lines = ["time to first token, ms (prefill tokens computed; cached tokens by tier):"]
    for n, res in doc["results"].items():
        lines.append(f"  prefix {n} tokens")
        for name in SCENARIOS:
            r = res[name]
            cached = ", ".join(f"{t} {k}" for t, k in r["cached_tokens"].items()) or "-"
            floor = doc["floors"][n].get(name)
            extra = f"   floor {floor['floor_s'] * 1e3:7.1f} ms ({floor['ttft_vs_floor']:.2f}x)" if floor else ""
            lines.append(f"    {name:<12} {r['ttft_s'] * 1e3:9.1f}   computed {r['prefill_tokens_computed']:6d}   "
                         f"cached {cached:<18} loaded {r['bytes_loaded'] / 1e6:7.2f} MB{extra}")
    for k, target in doc["targets"].items():
        lines.append(f"  {k} = {doc[k]:.3f} (target <= {target}: {'PASS' if doc[k] <= target else 'MISS'})")
    lines.append(f"  warm output identical to cold (exact mode): {doc['warm_matches_cold']}")
    be = {k: v for k, v in doc["breakeven_prefix_tokens"].items() if v is not None}
    if be:
        low = min(int(n) for n in doc["results"])
        lines.append("  breakeven prefix (tokens, linear fit): " + ", ".join(
            f"{k} {v:.0f}" if v >= low else f"{k} below {low}" for k, v in be.items()))
    for name, w in doc["workloads"].items():
        lines.append(f"  workload {name}: warm/cold TTFT {w['ttft_ratio']:.3f}, exact {w['exact']}")
    return "\n".join(lines)


def write_report(doc: dict, out_dir: str) -> str:
    """cold_warm-latest.md with a PNG plot of TTFT per scenario and prefix length."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lengths = list(doc["results"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(lengths)
    for i, n in enumerate(lengths):
        vals = [doc["results"][n][s]["ttft_s"] * 1e3 for s in SCENARIOS]
        ax.bar([j + i * width for j in range(len(SCENARIOS))], vals, width, label=f"prefix {n}")
    ax.set_xticks([j + width * (len(lengths) - 1) / 2 for j in range(len(SCENARIOS))], SCENARIOS, rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("time to first token, ms (log)")
    ax.set_title(f"cold vs warm, {doc['config']['model']} ({doc['config']['weights']}), CPU")
    ax.legend()
    fig.tight_layout()
    png = os.path.join(out_dir, "cold_warm-latest.png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    md = os.path.join(out_dir, "cold_warm-latest.md")
    with open(md, "w") as f:
        f.write(f"# Cold versus warm ({doc['time_utc'][:19]} UTC)\n\n![TTFT per scenario](cold_warm-latest.png)\n\n")
        f.write("```\n" + format_table(doc) + "\n```\n\n")
        bw = ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in doc["tier_bandwidth_bytes_per_s"].items())
        f.write(f"Tier read bandwidth measured in the same run: {bw}.\n\nMachine: {doc['machine']['cpu_count']} "
                f"CPUs, torch {doc['machine']['torch']}. JSON: `{os.path.basename(doc['files']['json'])}`.\n")
    return md
