"""`kvcache bench model` / `python -m kvcache.benchmarks.model`: prefill and decode speed of our V4
against transformers' DeepseekV4ForCausalLM on the same weights in the same run, plus KV bytes per token
of the real Flash configs against the architecture reference's figures.

    per config (v4-tiny, v4-small) and prompt length (512 / 2k / 8k):
        prefill tokens/s  ours and transformers (eager, its own DynamicCache)   ratio ours / theirs
        decode ms/token   after a 512-token prefill, median of --decode-steps   ratio theirs / ours
    KV history bytes per token, V4-Flash and V4.1-Flash configs, in each published row format
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
from kvcache.engine.checkpoint.hf_names import to_transformers
from kvcache.engine.checkpoint.init import random_weights
from kvcache.engine.model_config import ModelConfig
from kvcache.engine.kv_layout import kv_layout
from kvcache.engine.models import build_model

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "models")
# deepseek-v4-architecture.md section 3.3 (bytes of history per token)
REFERENCE_KV = {"v4-flash": {"bf16": 6880, "fp8_ds_mla+fp8_index": 3850, "fp8_ds_mla+mxfp4_index": 3514},
                "v41-flash": {"v41_fp4+mxfp4_index": 890}}


def hf_twin(model, config: ModelConfig):
    """transformers' V4 with our model's weights (the baseline), eager attention."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    n = config.num_hidden_layers
    hca = sorted({r for r in config.compress_ratios if r not in (0, 4)}) or [128]
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", hca[0]: "heavily_compressed_attention"}
    y = config.yarn
    rope = ({"rope_type": "yarn", "factor": y.factor,
             "original_max_position_embeddings": y.original_max_position_embeddings,
             "beta_fast": y.beta_fast, "beta_slow": y.beta_slow} if y else None)
    hc = DeepseekV4Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=n,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=1, head_dim=config.head_dim,
        q_lora_rank=config.q_lora_rank, o_groups=config.o_groups, o_lora_rank=config.o_lora_rank,
        sliding_window=config.sliding_window, layer_types=[kinds[r] for r in config.compress_ratios],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca[0]},
        mlp_layer_types=["hash_moe"] * config.num_hash_layers + ["moe"] * (n - config.num_hash_layers),
        n_routed_experts=config.n_routed_experts, n_shared_experts=config.n_shared_experts,
        num_experts_per_tok=config.num_experts_per_tok, moe_intermediate_size=config.moe_intermediate_size,
        index_n_heads=config.index_n_heads, index_head_dim=config.index_head_dim, index_topk=config.index_topk,
        hc_mult=config.hc_mult, hc_sinkhorn_iters=config.hc_sinkhorn_iters, hc_eps=config.hc_eps,
        rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta, compress_rope_theta=config.compress_rope_theta,
        rope_parameters=rope, partial_rotary_factor=config.qk_rope_head_dim / config.head_dim,
        max_position_embeddings=config.max_position_embeddings, routed_scaling_factor=config.routed_scaling_factor,
        swiglu_limit=config.swiglu_limit, attn_implementation="eager")
    hf = DeepseekV4ForCausalLM(hc).eval()
    hf.load_state_dict(to_transformers(model.state_dict()), strict=False)
    return hf


@torch.no_grad()
def _ours(model, ids: torch.Tensor, decode_steps: int) -> tuple[float, list[float]]:
    t = time.perf_counter()
    state = model.new_state()
    model(ids, state)
    prefill = time.perf_counter() - t
    steps = []
    for i in range(decode_steps):
        t = time.perf_counter()
        model(ids[:, i:i + 1], state)
        steps.append(time.perf_counter() - t)
    return prefill, steps


@torch.no_grad()
def _theirs(hf, ids: torch.Tensor, decode_steps: int) -> tuple[float, list[float]]:
    t = time.perf_counter()
    out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - t
    cache, steps = out.cache, []
    for i in range(decode_steps):
        t = time.perf_counter()
        cache = hf(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).cache
        steps.append(time.perf_counter() - t)
    return prefill, steps


def bench_config(name: str, lengths: list[int], decode_steps: int, baseline_max: int, seed: int, bar=None) -> dict:
    config = ModelConfig.load(os.path.join(CONFIG_DIR, f"{name}.json"))
    model = random_weights(build_model(config), seed).eval()
    hf = hf_twin(model, config)
    g = torch.Generator().manual_seed(seed)
    out = {"parameters": sum(p.numel() for p in model.parameters()), "lengths": {}}
    _ours(model, torch.randint(3, config.vocab_size, (1, 64), generator=g), 2)          # warm-up
    _theirs(hf, torch.randint(3, config.vocab_size, (1, 64), generator=g), 2)
    for T in lengths:
        ids = torch.randint(3, config.vocab_size, (1, T), generator=g)
        steps = decode_steps if T == min(lengths) else 0
        p_ours, d_ours = _ours(model, ids, steps)
        row = {"prefill_tokens_per_s": {"ours": T / p_ours}, "prefill_s": {"ours": p_ours}}
        if T <= baseline_max:
            p_hf, d_hf = _theirs(hf, ids, steps)
            row["prefill_tokens_per_s"]["transformers"] = T / p_hf
            row["prefill_s"]["transformers"] = p_hf
            row["prefill_ratio_ours_vs_transformers"] = p_hf / p_ours
            if steps:
                row["decode_ms_per_token"] = {"ours": 1e3 * statistics.median(d_ours),
                                              "transformers": 1e3 * statistics.median(d_hf)}
                row["decode_ratio_ours_vs_transformers"] = statistics.median(d_hf) / statistics.median(d_ours)
        out["lengths"][str(T)] = row
        if bar is not None:
            bar.update(1)
    return out


def kv_bytes() -> dict:
    out = {}
    for name, ref in REFERENCE_KV.items():
        layout = kv_layout(ModelConfig.load(os.path.join(CONFIG_DIR, f"{name}.json")))
        out[name] = {fmt: {"computed": layout.bytes_per_token(fmt), "reference": value,
                           "ratio": layout.bytes_per_token(fmt) / value} for fmt, value in ref.items()}
        out[name]["groups"] = layout.describe()
    return out


def run(configs: list[str], lengths: list[int], out_dir: str, decode_steps: int = 16, baseline_max: int = 8192,
        seed: int = 0, progress: bool = True) -> dict:
    from tqdm import tqdm
    from kvcache.benchmarks.record import machine_info, write_results
    torch.manual_seed(seed)
    os.makedirs(out_dir, exist_ok=True)
    started = time.perf_counter()
    with tqdm(total=len(configs) * len(lengths), desc="model benchmark", unit="run", disable=not progress) as bar:
        results = {name: bench_config(name, lengths, decode_steps, baseline_max, seed, bar) for name in configs}
    doc = {"benchmark": "model_forward", "time_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
           "elapsed_s": time.perf_counter() - started, "machine": {**machine_info(out_dir),
                                                                    "torch": torch.__version__,
                                                                    "torch_threads": torch.get_num_threads()},
           "config": {"configs": configs, "lengths": lengths, "decode_steps": decode_steps,
                      "baseline_max_tokens": baseline_max, "seed": seed, "dtype": "float32 (CPU)",
                      "baseline": "transformers DeepseekV4ForCausalLM, eager attention, same weights"},
           "results": results, "kv_bytes_per_token": kv_bytes()}
    write_results(doc, out_dir, "model_forward")
    return doc


def format_table(doc: dict) -> str:
    lines = ["prefill tokens/s (ours | transformers | ratio), decode ms/token after the shortest prompt:"]
    for name, r in doc["results"].items():
        for T, row in r["lengths"].items():
            p = row["prefill_tokens_per_s"]
            theirs = f"{p['transformers']:8.0f} | {row['prefill_ratio_ours_vs_transformers']:5.2f}x" \
                if "transformers" in p else "       - |     -"
            dec = row.get("decode_ms_per_token")
            d = (f"   decode {dec['ours']:.1f} vs {dec['transformers']:.1f} ms "
                 f"({row['decode_ratio_ours_vs_transformers']:.2f}x)") if dec else ""
            lines.append(f"  {name:<9} {T:>6}  {p['ours']:8.0f} | {theirs}{d}")
    lines.append("KV history bytes per token (computed vs architecture reference):")
    for name, fmts in doc["kv_bytes_per_token"].items():
        for fmt, v in fmts.items():
            if fmt != "groups":
                lines.append(f"  {name:<10} {fmt:<24} {v['computed']:8.1f} vs {v['reference']:6d}")
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI
def run_args(args: argparse.Namespace) -> int:
    lengths = args.lengths
    doc = run(args.configs, lengths, args.out_dir,
              args.decode_steps, args.baseline_max_tokens, args.seed, progress=not args.no_progress)
    print(format_table(doc))
    print(f"\nwrote {doc['files']['json']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return verbs.main("model", argv)


if __name__ == "__main__":
    sys.exit(main())
