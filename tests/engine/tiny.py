"""Tiny V4 / V4.1 configs that keep every structural feature at small widths, and random weights."""

import torch

from kvcache.engine.model_config import ModelConfig

V4_TINY = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=384, hidden_size=64,
    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=32, qk_rope_head_dim=8,
    q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
    compress_ratios=[0, 0, 4, 16, 4, 16, 0],          # last entry: the MTP block
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
    num_hash_layers=2, scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5,
    swiglu_limit=10.0, index_n_heads=8, index_head_dim=16, index_topk=4, hc_mult=4, hc_sinkhorn_iters=20,
    hc_eps=1e-6, rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 32, "beta_fast": 32,
                  "beta_slow": 1},
    max_position_embeddings=4096, num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1)


def v4_config(**over) -> ModelConfig:
    return ModelConfig.from_dict({**V4_TINY, **over})


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    from kvcache.engine.checkpoint.init import random_weights
    return random_weights(model, seed)


def _primes_needed(vocab: int, layers: int, n_max: int, heads: int) -> list[int]:
    from kvcache.engine.layers.engram import _is_prime
    used, sums = set(), []
    for _ in range(layers):
        total = 0
        for _ in range(n_max - 1):
            cur = vocab - 1
            for _ in range(heads):
                cur += 1
                while not _is_prime(cur) or cur in used:
                    cur += 1
                used.add(cur)
                total += cur
        sums.append(total)
    return sums


V41_TINY = dict(
    architectures=["DeepseekV41ForCausalLM"], model_type="deepseek_v41",
    text_config=dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
        compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0], kv_source_layer_ids=[2, 5],
        index_source_layer_ids=[2, 5, 6], candidate_source_layer_id=5, candidate_topk_blocks=2, candidate_block_size=4,
        index_n_heads=2, index_head_dim=16, index_topk=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=32, scoring_func="sqrtsoftplus", norm_topk_prob=True,
        routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        rms_norm_eps=1e-20, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 32, "beta_fast": 32,
                      "beta_slow": 1},
        max_position_embeddings=65536, engram_layer_ids=[1, 4], engram_max_ngram_size=4, engram_vocab_size=97,
        engram_n_heads=2, engram_head_dim=16, engram_pad_token_id=2,
        engram_num_embeddings=_primes_needed(97, 2, 4, 2), engram_compressed_vocab_size=0,
        num_nextn_predict_layers=3, dspark_block_size=5, dspark_noise_token_id=500, dspark_target_layer_ids=[5, 6, 7],
        dspark_markov_rank=16, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2),
    bos_token_id=0, eos_token_id=1, pad_token_id=2, image_token_id=11)


def v41_config(compressed_vocab: int, **over) -> ModelConfig:
    text = {**V41_TINY["text_config"], "engram_compressed_vocab_size": compressed_vocab, **over}
    return ModelConfig.from_dict({**V41_TINY, "text_config": text})
