"""`kvcache bench codec`: how well the object tier's codecs compress KV the models actually cache.

Runs a demo checkpoint (deterministic weights) over a prompt, takes the history rows a prefix
cache stores (V4: compressed entries and index keys of every compressed layer; V4.1: the kv
sources' entries and index keys) in bf16, cuts them into blocks of `block_tokens` tokens, and
measures zstd and zstd over byte-shuffled 16-bit words (the object tier's codecs) per block:
compression ratio, compress and decompress GB/s, against memcpy of the same bytes. Weights are
random (real DeepSeek weights cannot be fetched here), so read the ratios as those of KV with the
real models' structure (RMS-normed latents, RoPE'd tails), not of trained activations.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time

import torch
import zstandard

from kvcache.benchmarks import verbs
from kvcache.engine.checkpoint.init import random_weights
from kvcache.engine.model_config import ModelConfig
from kvcache.engine.models import build_model
from kvcache.engine.tokenizer import build_demo_tokenizer
from kvcache.kvstore.shuffle import shuffle2, unshuffle2_into

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "models")
TEXT = ("A prefix cache keeps the attention state of long prompts so that repeated context is never computed "
        "twice. Documents, code and conversations share long prefixes: system prompts, tool definitions, "
        "retrieved passages. def lookup(keys): return [store.get(k) for k in keys] # 0123456789 ")


@torch.no_grad()
def history_rows(name: str, tokens: int, seed: int) -> list[tuple[torch.Tensor, int]]:
    """(rows [n, dim] bf16, tokens per row) of each history tensor (entries, index keys) after a prefill."""
    config = ModelConfig.load(os.path.join(CONFIG_DIR, f"{name}.json"))
    model = random_weights(build_model(config), seed).eval()
    tok = build_demo_tokenizer(min(config.vocab_size, 32768))
    if config.engram_layer_ids:
        import dataclasses
        from kvcache.engine.layers.engram import compressed_token_map
        tm = compressed_token_map(tok)
        config = dataclasses.replace(config, engram_compressed_vocab_size=int(tm.max()) + 1)
        model = random_weights(build_model(config), seed).eval()
        model.set_token_map(tm)
    ids = tok.encode(TEXT * (tokens // 20 + 1))[:tokens]
    state = model.new_state()
    model(torch.tensor([ids]), state)
    out = []
    for layer, st in enumerate(state.layers):
        comp = st.compressor
        if comp is None or comp.entries is None:
            continue
        ratio = config.compress_ratios[layer]
        out.append((comp.entries[0].to(torch.bfloat16), ratio))
        keys = getattr(comp, "index_keys", None)
        if keys is None and st.index is not None:
            keys = st.index.entries
        if keys is not None:
            out.append((keys[0].to(torch.bfloat16), ratio))
    return out


def blocks_of(rows: list[tuple[torch.Tensor, int]], block_tokens: int) -> list[bytes]:
    """Each history tensor cut into the rows that cover `block_tokens` tokens (what one block stores)."""
    out = []
    for r, ratio in rows:
        per_block = max(1, block_tokens // ratio)
        for i in range(0, r.shape[0], per_block):
            out.append(r[i:i + per_block].contiguous().view(torch.uint8).numpy().tobytes())
    return [b for b in out if b]


def measure(blocks: list[bytes], level: int = 1, repeats: int = 3) -> dict:
    cctx, dctx = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
    total = sum(len(b) for b in blocks)
    res: dict = {"bytes": total, "blocks": len(blocks)}
    copy_t = []
    for _ in range(repeats):
        t = time.perf_counter()
        for b in blocks:
            bytearray(b)
        copy_t.append(time.perf_counter() - t)
    res["memcpy_gb_s"] = total / statistics.median(copy_t) / 1e9
    for codec in ("zstd", "zstd-shuffle2"):
        enc_t, dec_t, stored = [], [], 0
        for _ in range(repeats):
            t = time.perf_counter()
            encoded = [cctx.compress(bytes(shuffle2(b)) if codec == "zstd-shuffle2" else b) for b in blocks]
            enc_t.append(time.perf_counter() - t)
            stored = sum(len(e) for e in encoded)
            t = time.perf_counter()
            for e, b in zip(encoded, blocks):
                raw = dctx.decompress(e, max_output_size=len(b))
                if codec == "zstd-shuffle2":
                    out = bytearray(len(b))
                    unshuffle2_into(raw, memoryview(out))
            dec_t.append(time.perf_counter() - t)
        res[codec] = {"ratio": total / stored, "compress_gb_s": total / statistics.median(enc_t) / 1e9,
                      "decompress_gb_s": total / statistics.median(dec_t) / 1e9}
    return res


def run(configs: list[str], tokens: int, out_dir: str, block_tokens: int = 256, seed: int = 0) -> dict:
    from kvcache.benchmarks.record import machine_info, write_results
    os.makedirs(out_dir, exist_ok=True)
    results = {}
    for name in configs:
        rows = history_rows(name, tokens, seed)
        results[name] = {"prompt_tokens": tokens, "history_rows": sum(r.shape[0] for r, _ in rows),
                         "row_dims": sorted({int(r.shape[1]) for r, _ in rows}),
                         **measure(blocks_of(rows, block_tokens))}
    doc = {"benchmark": "kv_codec", "time_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
           "machine": machine_info(out_dir), "config": {"configs": configs, "prompt_tokens": tokens,
                                                        "block_tokens": block_tokens, "seed": seed,
                                                        "zstd_level": 1, "weights": "random demo weights"},
           "results": results}
    write_results(doc, out_dir, "kv_codec")
    return doc


# ---------------------------------------------------------------- CLI
def run_args(args: argparse.Namespace) -> int:
    doc = run(args.configs, args.tokens, args.out_dir,
              args.block_tokens)
    print("codec on KV history (bf16): ratio, compress / decompress GB/s")
    for name, r in doc["results"].items():
        for codec in ("zstd", "zstd-shuffle2"):
            c = r[codec]
            print(f"  {name:<10} {codec:<14} {c['ratio']:.3f}x  {c['compress_gb_s']:.2f} / {c['decompress_gb_s']:.2f}")
    print(f"wrote {doc['files']['json']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return verbs.main("kv_codec", argv)


if __name__ == "__main__":
    sys.exit(main())
