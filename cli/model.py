"""`kvcache model init | logits | info`: demo checkpoints, logits for checking a checkpoint, and
what a model is (architecture, parameters, KV bytes per token per layer group)."""

from __future__ import annotations

import argparse
import json
import os
import sys

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "models")
EPILOG = """examples:
  kvcache model init --config v4-tiny --out /tmp/v4-tiny --seed 0
  kvcache model info /tmp/v4-tiny
  kvcache model info v4-flash                    # a config name needs no weights
  kvcache model logits --model /tmp/v4-tiny --prompt-ids 0,17,42,99 --out logits.npy
"""


def add_async_scheduling(parser) -> None:
    """--async-scheduling, as `generate` and `serve --model` take it."""
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="plan each step while the one before it runs (the same draws; default: on for "
                             "accelerators, off on the CPU; [engine] async_scheduling in --config)")


def resolve_config(name: str) -> str:
    """A config name under configs/models/, a config.json path, or a checkpoint directory."""
    for cand in (name, os.path.join(CONFIG_DIR, f"{name}.json")):
        if os.path.isfile(cand) or os.path.isfile(os.path.join(cand, "config.json")):
            return cand
    names = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))
    raise FileNotFoundError(f"no model config {name!r}: give a config.json, a checkpoint directory, or one of "
                            f"{', '.join(names)}")


def add_parser(sub) -> None:
    p = sub.add_parser("model", help="demo checkpoints, logits and facts about a DeepSeek-V4 model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    ms = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    i = ms.add_parser("init", help="write a deterministic random checkpoint (official layout, quantised tensors, "
                                   "config.json, tokenizer.json)")
    i.add_argument("--config", required=True, metavar="NAME", help="configs/models/NAME.json or a config.json path")
    i.add_argument("--out", required=True, metavar="DIR", help="output directory (created)")
    i.add_argument("--seed", type=int, default=0, help="weights seed (default 0): same seed, same bytes")
    i.add_argument("--shard-mib", type=_positive, default=1024, help="safetensors shard size (default 1024 MiB)")
    i.set_defaults(func=cmd_init)
    g = ms.add_parser("logits", help="float32 logits for every position of a prompt, as .npy")
    g.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory")
    g.add_argument("--prompt-ids", required=True, metavar="IDS", help="comma-separated token ids, e.g. 0,17,42")
    g.add_argument("--out", required=True, metavar="FILE.npy", help="where the [positions, vocab] array goes")
    g.add_argument("--device", default="cpu", help="cpu (fp32, default), cuda[:i] or npu[:i] (bf16), or auto")
    g.set_defaults(func=cmd_logits)
    f = ms.add_parser("info", help="architecture, parameter counts, KV bytes per token per layer group")
    f.add_argument("model", metavar="DIR|NAME", help="checkpoint directory, config.json, or a config name")
    f.add_argument("--json", action="store_true", help="print JSON")
    f.set_defaults(func=cmd_info)
    d = ms.add_parser("distill", help="train a checkpoint's drafter (V4's MTP layer, V4.1's DSpark stages) on its "
                      "own target's outputs, on the CPU, so that speculative decoding on a demo checkpoint accepts "
                      "drafts as with a trained drafter; the checkpoint is rewritten with distill.json beside it")
    d.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory (rewritten unless --out)")
    d.add_argument("--out", metavar="DIR", help="write the distilled checkpoint here instead")
    d.add_argument("--seconds", type=_positive, default=120.0, help="training time (default 120 s)")
    d.add_argument("--steps", type=int, default=None, help="stop after this many training steps (same steps, "
                   "same weights: the run is deterministic; default: train for --seconds)")
    d.add_argument("--method", choices=("mtp", "dspark"), help="default: dspark when the config has a DSpark "
                   "drafter, else mtp")
    d.add_argument("--sequences", type=int, default=24, help="training sequences: random prompts the target "
                   "continues (default 24; the last 4 are held out)")
    d.set_defaults(func=cmd_distill)


def cmd_init(args) -> int:
    from tqdm import tqdm
    from kvcache.engine.checkpoint.demo import write_demo_checkpoint
    config_file = resolve_config(args.config)
    with tqdm(desc="writing checkpoint", unit="tensor", disable=not sys.stderr.isatty()) as bar:
        demo = write_demo_checkpoint(config_file, args.out, args.seed, int(args.shard_mib * (1 << 20)), progress=bar)
    print(f"wrote {demo.model_type} checkpoint to {args.out}: {demo.shards} shard(s), {demo.tensors} tensors, "
          f"{demo.parameters:,} parameters, tokenizer of {demo.tokenizer_vocab} tokens (logits: {demo.logit_vocab})")
    return 0


def cmd_logits(args) -> int:
    import numpy as np
    import torch
    from kvcache.engine.checkpoint.loader import load_model
    try:
        ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    model, config = load_model(args.model, device=args.device, progress=sys.stderr.isatty())
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device))[0].float().cpu().numpy()
    np.save(args.out, logits.astype(np.float32))
    print(f"wrote {args.out}: float32 {logits.shape[0]} positions x {logits.shape[1]} vocab")
    return 0


def model_facts(config) -> dict:
    """Parameter counts from the config alone (no weights built), and the KV layout."""
    from kvcache.engine.kv_layout import ROW_FORMATS, kv_layout
    from kvcache.engine.models import build_empty
    model = build_empty(config)
    groups: dict[str, int] = {}
    for name, p in model.named_parameters():
        part = ("embed/head" if name.startswith(("embed", "head")) else "drafter (mtp)" if name.startswith("mtp.")
                else "engram tables" if "engram.embed" in name
                else "routed experts" if ".ffn.experts." in name else "attention" if ".attn." in name
                else "other (mHC, norms, gates, shared experts)")
        groups[part] = groups.get(part, 0) + p.numel()
    total = sum(groups.values())
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    inactive = config.num_hidden_layers * (config.n_routed_experts - config.num_experts_per_tok) * per_expert
    layout = kv_layout(config)
    return {"model_type": config.model_type, "layers": config.num_hidden_layers,
            "layer_kinds": [config.layer_kind(i) for i in range(config.num_hidden_layers)],
            "parameters": total, "parameters_by_part": groups,
            # Engram reads (max_ngram - 1) x heads rows per layer and token, not its tables
            "activated_per_token": total - inactive - groups.get("drafter (mtp)", 0) - groups.get("engram tables", 0)
            + len(config.engram_layer_ids) * (config.engram_max_ngram_size - 1) * config.engram_n_heads
            * config.engram_head_dim,
            "kv_groups": layout.describe(),
            "kv_history_bytes_per_token": {f: layout.bytes_per_token(f) for f in ROW_FORMATS},
            "kv_window_bytes_per_request_bf16": layout.window_bytes()}


def cmd_info(args) -> int:
    from kvcache.engine.model_config import ModelConfig
    config = ModelConfig.load(resolve_config(args.model))
    facts = model_facts(config)
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    kinds = facts["layer_kinds"]
    counted = ", ".join(f"{k} x{kinds.count(k)}" for k in sorted(set(kinds)))
    print(f"{config.model_type}: {facts['layers']} layers ({counted}),"
          f" hidden {config.hidden_size}, {config.num_attention_heads} heads x {config.head_dim}, window "
          f"{config.sliding_window}, {config.n_routed_experts} experts top-{config.num_experts_per_tok}")
    print(f"parameters: {facts['parameters']:,} ({facts['activated_per_token']:,} activated per token)")
    for part, n in facts["parameters_by_part"].items():
        print(f"  {part:<42} {n:>16,}")
    print("KV cache, history bytes per token:")
    for g in facts["kv_groups"]:
        print(f"  {g['group']:<11} layers {_ranges(g['layers']):<28} row {g['row_dim']:>4}  "
              f"1 row / {g['tokens_per_row']} tok   bf16 {g['bf16_bytes_per_token']:>9.1f} B/token")
    for fmt, b in facts["kv_history_bytes_per_token"].items():
        print(f"  total in {fmt:<26} {b:>9.1f} B/token")
    window_mib = facts["kv_window_bytes_per_request_bf16"] / 2**20
    print(f"  sliding windows (bounded): {window_mib:.2f} MiB per request (bf16)")
    return 0


def _ranges(ids) -> str:
    ids = list(ids)
    return ",".join(map(str, ids)) if len(ids) <= 6 else f"{ids[0]}..{ids[-1]} ({len(ids)})"


def _positive(text: str) -> float:
    """An argparse type: a number > 0."""
    try:
        v = float(text)
    except ValueError:
        v = 0.0
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return v


def cmd_distill(args) -> int:
    from tqdm import tqdm
    from kvcache.engine.speculative.distill import Corpus, distill_checkpoint
    if args.sequences < 8:
        raise ValueError("--sequences must be at least 8 (4 are held out)")
    if args.steps is not None and args.steps < 1:
        raise ValueError("--steps must be at least 1")
    with tqdm(desc="distilling", unit="step", disable=not sys.stderr.isatty()) as bar:
        def progress(step: int, loss: float) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
        r = distill_checkpoint(args.model, args.seconds, args.method, args.out, Corpus(n=args.sequences), progress,
                               max_steps=args.steps)
    print(f"distilled the {r.method} drafter of {args.out or args.model}: {r.steps} steps in {r.seconds:.0f} s, "
          f"loss {r.first_loss:.3f} -> {r.last_loss:.3f}; first-draft agreement with the target "
          f"{r.agreement:.0%} on its training sequences, {r.held_out_agreement:.0%} on held-out ones (a random-"
          "weight target is a hash of its context: only what it was trained on can be predicted)")
    return 0
