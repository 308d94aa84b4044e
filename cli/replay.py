"""`kvcache replay TRACE.jsonl`: prefix hit rates of the real store on a request trace, at several
DRAM capacities, next to the unlimited-capacity rate, a plain LRU and the offline optimum's rule
(Belady) of the same capacity; and, on a grid of capacities, simulated policies (LRU, S3-FIFO,
ARC, the duel) against LRU, Belady and the best fixed set chosen with hindsight."""

from __future__ import annotations

import argparse
import json
import os

EPILOG = """examples:
  curl -LO https://github.com/kvcache-ai/Mooncake/raw/main/FAST25-release/traces/conversation_trace.jsonl
  kvcache replay conversation_trace.jsonl
  kvcache replay trace.jsonl --model v41-flash --dram-tokens 1M,3M,10M --nvme-tokens 30M --json out.json
  kvcache replay trace.jsonl --kv-bytes-per-token 3850 --limit 2000
  kvcache replay trace.jsonl --dram-tokens 1M --policy duel,lru,s3fifo+second-hit   # DRAM orders compared
  kvcache replay trace.jsonl --bounds-only --grid 300K,1M,3M,10M,30M --plot bounds.png   # seconds

Block sizes come from the model's KV layout (history bytes per token x 512 tokens per trace block),
divided by --scale so the replay fits a laptop, rounded up to their DRAM size class; capacities
are scaled the same way.
The Mooncake FAST'25 traces (repository kvcache-ai/Mooncake, folder FAST25-release/traces/, Apache-2.0)
have this format; the store's replay of the whole conversation trace takes about a minute per
capacity and policy on 2 cores (--limit for a first look), the simulated policies seconds each.
Progress goes to stderr: a bar on a terminal, a line every 10 s otherwise (a log, CI).
"""


DEFAULT_STORE_POLICIES = "duel,lru"


def _tokens(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1_000, "M": 1_000_000, "G": 1_000_000_000}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay a Mooncake-format trace against the store (hit rates per tier)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    p.add_argument("trace", help="JSONL trace: timestamp (ms), input_length, hash_ids (one per 512 tokens)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="v41-flash", help="model config whose KV bytes per token size the blocks")
    src.add_argument("--kv-bytes-per-token", type=float, help="bytes of KV history per token (instead of --model)")
    p.add_argument("--format", default=None, help="KV row format for --model (default: the model's compact one)")
    p.add_argument("--dram-tokens", default="1M,3M,10M", help="DRAM capacities to try, in tokens")
    p.add_argument("--nvme-tokens", default="30M", help="NVMe capacity in tokens")
    p.add_argument("--retention-hours", type=float, default=72.0)
    p.add_argument("--scale", type=int, default=64, help="divide block bytes and capacities by this (default 64)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--policy", default=DEFAULT_STORE_POLICIES,
                   help="the store's DRAM policies to replay, each EVICTION[+second-hit] with EVICTION one of "
                        "lru, fifo, s3fifo, duel (dram.eviction; +second-hit is dram.admission); the first is "
                        "the one measured against the bounds (default: %(default)s)")
    p.add_argument("--grid", default="300K,1M,3M,10M,30M", help="capacities for the simulated policies, in tokens")
    p.add_argument("--policies", default="lru,belady,hindsight,s3fifo,arc,duel",
                   help="simulated policies to compare (kvstore/policy_sim.py; LRU and Belady always run)")
    p.add_argument("--bounds-only", action="store_true", help="only the simulated policies (no store replay)")
    p.add_argument("--plot", metavar="PNG", help="hit rate against capacity: each policy a line, the store a point")
    p.add_argument("--json", metavar="FILE", help="write the full results here")
    p.set_defaults(func=cmd_replay)


def _bytes_per_token(args) -> tuple[float, str]:
    if args.kv_bytes_per_token:
        return args.kv_bytes_per_token, "given"
    from kvcache.cli.model import resolve_config
    from kvcache.engine.model_config import ModelConfig
    from kvcache.engine.kv_layout import kv_layout
    config = ModelConfig.load(resolve_config(args.model))
    fmt = args.format or ("v41_fp4+mxfp4_index" if config.is_v41 else "fp8_ds_mla+fp8_index")
    return kv_layout(config).bytes_per_token(fmt), f"{args.model} ({fmt})"


def _progress():
    """tqdm's bar on a terminal; elsewhere a line every 10 s (a redrawn bar is one endless line in a log)."""
    import sys
    if sys.stderr.isatty():
        return True
    from kvcache.cli.fmt import LineProgress
    return lambda total: LineProgress(total, "replaying", "requests")


def cmd_replay(args) -> int:
    from kvcache.gc.collector import Collector
    from kvcache.kvstore.policy_sim import POLICIES
    from kvcache.kvstore.trace_replay import bounds, load_trace, run, store_variant, unlimited_hit_rate
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    variants = tuple(v.strip() for v in args.policy.split(",") if v.strip())
    for v in variants:
        store_variant(v)
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise ValueError(f"unknown --policies {unknown}; known: {sorted(POLICIES)}")
    grid = [_tokens(t) for t in args.grid.split(",")]
    if args.bounds_only:
        trace = load_trace(args.trace, args.limit)
        doc = {"trace": args.trace, "requests": len(trace), "unlimited_hit_rate": unlimited_hit_rate(trace)[
            "token_hit_rate"], "capacities": [], "bounds": bounds(trace, grid, names)}
    else:
        bpt, source = _bytes_per_token(args)
        doc = run(args.trace, bpt, [_tokens(t) for t in args.dram_tokens.split(",")], _tokens(args.nvme_tokens),
                  args.scale, args.limit, args.retention_hours, progress=_progress(), grid=grid, policies=names,
                  variants=variants,
                  maintenance=Collector)
        doc["kv_bytes_source"] = source
        print(f"{doc['requests']:,} requests, {doc['unlimited']['tokens']:,} prompt tokens, KV {bpt:.0f} B/token "
              f"({source}): a 512-token block is {doc['block_bytes_real'] / 1024:.0f} KiB (replayed at 1/{args.scale})")
    print(f"unlimited capacity, no expiry: {doc['unlimited_hit_rate']:.1%} of prompt tokens hit")
    if doc["capacities"]:
        _store_table(doc)
    _bounds_table(doc["bounds"])
    if args.plot:
        write_plot(doc, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _store_table(doc: dict) -> None:
    print(f"{'DRAM':>8} {'NVMe':>8}  {'DRAM policy':<18}  {'store':>6} {'(DRAM':>6} {'NVMe)':>6}   "
          f"{'LRU DRAM':>8} {'LRU total':>9} {'Belady total':>12}")
    for c in doc["capacities"]:
        for name, pol in c["policies"].items():
            print(f"{c['dram_tokens'] / 1e6:>7.1f}M {c['nvme_tokens'] / 1e6:>7.1f}M  {name:<18}  "
                  f"{pol['token_hit_rate']:>6.1%} {pol['dram_hit_rate']:>6.1%} {pol['nvme_hit_rate']:>6.1%}   "
                  f"{c['lru_dram_only_hit_rate']:>8.1%} {c['lru_same_total_hit_rate']:>9.1%} "
                  f"{c['belady_same_total_hit_rate']:>12.1%}")


def _bounds_table(b: dict) -> None:
    names = b["policies"]
    print("simulated policies, token hit rate by capacity (x LRU):")
    print(f"{'capacity':>9}  " + " ".join(f"{n:>14}" for n in names))
    for r in b["capacities"]:
        cells = [f"{r['rates'][n]:>6.1%}" + (f" ({r[n + '_vs_lru']:.2f})" if n + "_vs_lru" in r else " " * 7)
                 for n in names]
        print(f"{r['capacity_tokens'] / 1e6:>8.1f}M  " + " ".join(f"{c:>14}" for c in cells))
    print("worst against LRU over the grid: " + ", ".join(f"{n} {v:.2f}" for n, v in b["worst_vs_lru"].items()))


def write_plot(doc: dict, path: str) -> None:
    """Token hit rate against capacity (log): a line per simulated policy, a point per store run
    (at its total capacity), the unlimited rate dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvcache.kvstore.trace_replay import OFFLINE
    b = doc["bounds"]
    xs = [r["capacity_tokens"] for r in b["capacities"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for n in b["policies"]:
        ax.plot(xs, [r["rates"][n] for r in b["capacities"]], marker="o", label=n,
                linestyle="--" if n in OFFLINE else "-")
    for c in doc["capacities"]:
        ax.scatter([max(c["dram_tokens"], c["nvme_tokens"])], [c["policy"]["token_hit_rate"]], marker="*", s=120,
                   color="black", zorder=3, label=f"store (DRAM {c['dram_tokens'] / 1e6:g}M)")
    ax.axhline(doc["unlimited_hit_rate"], color="grey", linestyle=":", label="unlimited")
    ax.set_xscale("log")
    ax.set_xlabel("capacity, tokens (log)")
    ax.set_ylabel("token prefix hit rate")
    ax.set_title(f"{os.path.basename(doc['trace'])}: {doc['requests']:,} requests")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
