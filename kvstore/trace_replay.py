"""Replay a Mooncake-format request trace against the real store and its tiering policy.

    trace line: {"timestamp": ms, "input_length": tokens, "output_length": ..., "hash_ids": [...]}
                one hash id per 512-token block of the prompt; equal ids at equal positions = a
                shared prefix (the Mooncake FAST'25 traces: repository kvcache-ai/Mooncake,
                folder FAST25-release/traces/)

    per request, in arrival order, on a simulated clock (BlockStore with a fake clock):
        lookup(keys)            the cached prefix and the tier of each block: hits per tier
        get_many_into(hits)     what the engine would load (promotes NVMe hits into DRAM)
        put_many(missed blocks) what the engine would save after prefill
    blocks are `block_bytes` long: a model's KV bytes per token x 512, divided by `scale` so the
    replay fits a dev machine (capacities are divided by the same factor, so ratios hold), then
    rounded up to a DRAM size class: a full-size block nearly fills its chunk (V4.1-Flash: 445
    KiB in 456 KiB) where its 1/64 would waste 13 % of each (7 KiB in 8), and DRAM would hold
    that much less than its capacity says

The collector is handed in (`maintenance=kvcache.gc.collector.Collector`, as to BlockStore): the
replay studies the store's eviction, and kvstore never imports GC.

Baselines computed on the same trace: the unlimited-capacity hit rate (no eviction, no expiry),
a plain LRU cache of the same capacity and the offline optimum's rule (Belady: evict the block
used farthest in the future), both simulated (kvstore/policy_sim.py, about a second a capacity);
`bounds` runs the simulated policies alone on a grid of capacities. Rates are token-weighted
prefix hit rates.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from kvcache.kvstore.store import MaintenanceFactory

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    time_s: float
    input_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self) -> list[int]:
        """Tokens of each prompt block (the last one may be partial)."""
        n = len(self.hash_ids)
        last = self.input_length - (n - 1) * TRACE_BLOCK_TOKENS
        return [TRACE_BLOCK_TOKENS] * (n - 1) + [max(1, min(TRACE_BLOCK_TOKENS, last))] if n else []


def load_trace(path: str, limit: int | None = None) -> list[TraceRequest]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            r = json.loads(line)
            out.append(TraceRequest(r["timestamp"] / 1000.0, int(r["input_length"]), tuple(r["hash_ids"])))
    return out


def _prefix_hits(req: TraceRequest, present) -> int:
    n = 0
    for h in req.hash_ids:
        if not present(h):
            break
        n += 1
    return n


def unlimited_hit_rate(trace: list[TraceRequest]) -> dict:
    seen: set[int] = set()
    hit_tok = total_tok = hit_blocks = 0
    for req in trace:
        toks = req.block_tokens()
        n = _prefix_hits(req, seen.__contains__)
        hit_blocks += n
        hit_tok += sum(toks[:n])
        total_tok += sum(toks)
        seen.update(req.hash_ids)
    return {"token_hit_rate": hit_tok / total_tok, "block_hits": hit_blocks,
            "blocks": sum(len(r.hash_ids) for r in trace), "distinct_blocks": len(seen), "tokens": total_tok}


def lru_hit_rate(trace: list[TraceRequest], capacity_blocks: int, stream=None) -> float:
    """A plain LRU cache of `capacity_blocks` blocks: prefix hits refresh, misses are inserted
    (policy_sim's LRU; `stream`: the trace's, if already built)."""
    from kvcache.kvstore.policy_sim import LRU, simulate
    return simulate(stream or trace_stream(trace), LRU(capacity_blocks))["token_hit_rate"]


def trace_stream(trace: list[TraceRequest]):
    from kvcache.kvstore.policy_sim import Stream
    return Stream.of((r.hash_ids, r.block_tokens()) for r in trace)


OFFLINE = ("belady", "hindsight")     # simulated policies that know the future: bounds, not contenders


def bounds(trace: list[TraceRequest], capacity_tokens: list[int], names=None, stream=None) -> dict:
    """The simulated policies (policy_sim.POLICIES, LRU and Belady among them) at each capacity:
    token hit rates, each policy against LRU and Belady, and LRU against Belady; the worst ratio
    to LRU of each online policy over the grid, and the capacities where LRU is at most half of
    Belady; with "hindsight" among them, each online policy against the best fixed set too."""
    from kvcache.kvstore.policy_sim import POLICIES, simulate
    names = list(names or POLICIES)
    for must in ("lru", "belady"):
        if must not in names:
            names.append(must)
    stream = stream or trace_stream(trace)
    rows = []
    for tokens in capacity_tokens:
        cap = max(1, tokens // TRACE_BLOCK_TOKENS)
        rates = {n: simulate(stream, POLICIES[n](cap, stream))["token_hit_rate"] for n in names}
        row = {"capacity_tokens": tokens, "capacity_blocks": cap, "rates": rates,
               "lru_vs_belady": _ratio(rates["lru"], rates["belady"])}
        for n in names:
            if n not in ("lru", "belady"):
                row[f"{n}_vs_lru"], row[f"{n}_vs_belady"] = _ratio(rates[n], rates["lru"]), _ratio(rates[n],
                                                                                                    rates["belady"])
            if n not in OFFLINE and "hindsight" in rates:
                row[f"{n}_vs_hindsight"] = _ratio(rates[n], rates["hindsight"])
        rows.append(row)
    worst = {n: min(r[f"{n}_vs_lru"] for r in rows) for n in names if n not in ("lru", *OFFLINE)}
    return {"policies": names, "capacities": rows, "worst_vs_lru": worst,
            "scarce_capacity_tokens": [r["capacity_tokens"] for r in rows if r["lru_vs_belady"] <= 0.5]}


def _belady(stream, blocks: int) -> float:
    from kvcache.kvstore.policy_sim import Belady, simulate
    return simulate(stream, Belady(blocks, stream.next_use))["token_hit_rate"]


def _ratio(a: float, b: float) -> float:
    return a / b if b else 1.0


def _key(hash_id: int) -> bytes:
    return hash_id.to_bytes(8, "little") + b"mooncake"


def _page_for(nbytes: int) -> int:
    """The DRAM page size a replay of `nbytes` blocks uses: a power of two that holds one."""
    return max(1 << 20, 1 << (nbytes - 1).bit_length())


def _chunk_sized(nbytes: int) -> int:
    """`nbytes` rounded up to the DRAM chunk a block of that size takes (tiering/slab.py)."""
    from kvcache.tiering.slab import size_classes
    return next(c for c in size_classes(_page_for(nbytes)) if c >= nbytes)


def store_replay(trace: list[TraceRequest], block_bytes: int, dram_bytes: int, nvme_bytes: int,
                 retention_hours: float = 72.0, bucket_s: float = 300.0, progress=None,
                 admission: str = "always", eviction: str = "lru", *, maintenance: MaintenanceFactory,
                 restart_at: int | None = None) -> dict:
    """Hit rates per tier (token-weighted) of the real store over the trace, and over time, with
    the DRAM tier's `eviction` order and `admission`; `maintenance` is the store's collector (see
    the module docstring). `restart_at`: close and reopen the store before that request."""
    from kvcache.kvstore.retention import RetentionPolicy, RetentionRule
    from kvcache.kvstore.config import StoreConfig
    from kvcache.kvstore.hashing import Namespace
    from kvcache.kvstore.store import BlockStore
    from kvcache.kvstore.types import PutItem
    from kvcache.kvstore.types import Tier
    from kvcache.tiering.config import DramConfig
    from kvcache.tiering.config import NvmeConfig

    class Clock:
        t = 1_700_000_000.0

        def __call__(self) -> float:
            return self.t
    clock = Clock()
    root = tempfile.mkdtemp(prefix="kvcache-replay-")
    page = _page_for(block_bytes)
    segment = max(1 << 20, 8 * block_bytes, min(16 << 20, nvme_bytes // 16))   # 16+ segments: some sealed
    cfg = StoreConfig(root, dram=DramConfig(capacity_bytes=max(dram_bytes, 2 * page), page_bytes=page, prefault=False,
                                            pin_memory="off", admission=admission, eviction=eviction),
                      nvme=NvmeConfig(capacity_bytes=nvme_bytes, segment_bytes=segment,
                                      fsync="never"),
                      retention=RetentionPolicy(RetentionRule(ttl_s=retention_hours * 3600)), event_log=False)
    ns = Namespace("trace-replay", f"synthetic/{block_bytes}", TRACE_BLOCK_TOKENS, name="replay")
    payload = memoryview(np.random.default_rng(0).integers(0, 256, block_bytes, dtype=np.uint8).tobytes())
    buf = bytearray(block_bytes)
    hits = {"dram": 0, "nvme": 0}
    total_tok = 0
    buckets: dict[int, dict] = {}
    started = time.perf_counter()
    try:
        store = BlockStore(cfg, clock=clock, maintenance=maintenance)
        store.register_namespace(ns)
        with contextlib.ExitStack() as open_store:
            open_store.callback(lambda: store.close())
            t0 = trace[0].time_s if trace else 0.0
            for i, req in enumerate(trace):
                if i == restart_at:                  # a daemon restart: DRAM empties, the index stays
                    store.close()
                    store = BlockStore(cfg, clock=clock, maintenance=maintenance)
                clock.t = 1_700_000_000.0 + req.time_s
                keys = [_key(h) for h in req.hash_ids]
                toks = req.block_tokens()
                look = store.lookup(keys)
                b = buckets.setdefault(int((req.time_s - t0) // bucket_s), {"tokens": 0, "dram": 0, "nvme": 0})
                for tok, tier in zip(toks, look.tiers):
                    name = "dram" if tier == Tier.DRAM else "nvme"
                    hits[name] += tok
                    b[name] += tok
                if look.num_hits:
                    store.get_many_into(keys[: look.num_hits], [buf] * look.num_hits)
                missing = keys[look.num_hits:]
                if missing:
                    store.put_many([PutItem(k, payload, ns.id) for k in missing])
                total_tok += sum(toks)
                b["tokens"] += sum(toks)
                if progress is not None:
                    progress.update(1)
            usage = {t.tier: {"blocks": t.blocks, "used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes}
                     for t in store.stats().tiers}
            policy_state = store.dram.policy_state()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    over_time = [{"start_s": k * bucket_s, "tokens": v["tokens"],
                  "hit_rate": (v["dram"] + v["nvme"]) / v["tokens"] if v["tokens"] else None,
                  "dram_hit_rate": v["dram"] / v["tokens"] if v["tokens"] else None}
                 for k, v in sorted(buckets.items())]
    return {"token_hit_rate": (hits["dram"] + hits["nvme"]) / total_tok, "dram_hit_rate": hits["dram"] / total_tok,
            "nvme_hit_rate": hits["nvme"] / total_tok, "over_time": over_time, "tier_usage_at_end": usage,
            "dram_policy_state": policy_state, "replay_s": time.perf_counter() - started}


def store_variant(spec: str) -> tuple[str, str]:
    """A store run's DRAM policy, written EVICTION[+second-hit] (`lru`, `duel+second-hit`):
    (eviction, admission)."""
    from kvcache.policy import NAMES
    eviction, _, admission = spec.partition("+")
    if eviction not in NAMES or admission not in ("", "second-hit"):
        raise ValueError(f"unknown store policy {spec!r}: write EVICTION[+second-hit], EVICTION one of "
                         f"{', '.join(NAMES)}")
    return eviction, admission or "always"


def run(trace_path: str, kv_bytes_per_token: float, dram_tokens: list[int], nvme_tokens: int, scale: int = 64,
        limit: int | None = None, retention_hours: float = 72.0, progress: bool | Callable[[int], Any] = True,
        variants: tuple[str, ...] = ("lru", "lru+second-hit"), grid: list[int] = (), policies=None, *,
        maintenance: MaintenanceFactory) -> dict:
    """The whole study: unlimited rate, then per DRAM capacity the store with each DRAM policy of
    `variants` (`store_variant`; the first is "the policy"), LRU and Belady, and the simulated
    `policies` on the `grid` of capacities (tokens; `bounds`).
    `progress`: a tqdm bar (True), none (False), or a factory given the number of request
    replays that returns a context manager with tqdm's update(n). `maintenance`: the stores' collector."""
    trace = load_trace(trace_path, limit)
    stream = trace_stream(trace)
    block_real = kv_bytes_per_token * TRACE_BLOCK_TOKENS
    block_bytes = _chunk_sized(max(64, int(round(block_real / scale))))
    per_block = block_bytes / TRACE_BLOCK_TOKENS                # scaled bytes per token
    unlimited = unlimited_hit_rate(trace)
    results = []
    parsed = {v: store_variant(v) for v in variants}
    with _progress_bar(progress, len(trace) * len(dram_tokens) * len(variants)) as bar:
        for dram in dram_tokens:
            runs = {v: store_replay(trace, block_bytes, int(dram * per_block), int(nvme_tokens * per_block),
                                    retention_hours, progress=bar, admission=a, eviction=e, maintenance=maintenance)
                    for v, (e, a) in parsed.items()}
            dram_blocks = max(1, dram // TRACE_BLOCK_TOKENS)
            total_blocks = max(1, max(dram, nvme_tokens) // TRACE_BLOCK_TOKENS)    # NVMe holds DRAM's too
            row = {"dram_tokens": dram, "nvme_tokens": nvme_tokens, "policy": runs[variants[0]], "policies": runs,
                   "lru_dram_only_hit_rate": lru_hit_rate(trace, dram_blocks, stream),
                   "lru_same_total_hit_rate": lru_hit_rate(trace, total_blocks, stream),
                   "belady_dram_only_hit_rate": _belady(stream, dram_blocks),
                   "belady_same_total_hit_rate": _belady(stream, total_blocks)}
            store = row["policy"]["token_hit_rate"]
            row.update(policy_vs_lru=_ratio(store, row["lru_same_total_hit_rate"]),
                       policy_vs_belady=_ratio(store, row["belady_same_total_hit_rate"]),
                       lru_vs_belady=_ratio(row["lru_same_total_hit_rate"], row["belady_same_total_hit_rate"]),
                       dram_policy_vs_lru=_ratio(row["policy"]["dram_hit_rate"], row["lru_dram_only_hit_rate"]),
                       dram_policy_vs_belady=_ratio(row["policy"]["dram_hit_rate"], row["belady_dram_only_hit_rate"]),
                       dram_vs_lru={v: _ratio(r["dram_hit_rate"], row["lru_dram_only_hit_rate"])
                                    for v, r in runs.items()})
            results.append(row)
    return {"trace": os.path.abspath(trace_path), "requests": len(trace), "kv_bytes_per_token": kv_bytes_per_token,
            "block_bytes_real": block_real, "scale": scale, "block_bytes_replayed": block_bytes,
            "unlimited_hit_rate": unlimited["token_hit_rate"], "unlimited": unlimited, "capacities": results,
            "worst_policy_vs_lru": min((r["policy_vs_lru"] for r in results), default=None),
            "worst_dram_policy_vs_lru": min((r["dram_policy_vs_lru"] for r in results), default=None),
            "bounds": bounds(trace, list(grid), policies, stream) if grid else None}


def _progress_bar(progress: bool | Callable[[int], Any], total: int):
    if callable(progress):
        return progress(total)
    from tqdm import tqdm
    return tqdm(total=total, desc="replaying", unit="req", disable=not progress)
