"""Tiny V4 / V4.1 configs that keep every structural feature at small widths, and random weights."""

import torch

from kvcache.engine.config import ModelConfig

V4_TINY = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=384, hidden_size=64,
    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=32, qk_rope_head_dim=8,
    q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
    compress_ratios=[0, 0, 4, 16, 4, 16, 0],          # last entry: the MTP block
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
    num_hash_layers=2, scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5,
    swiglu_limit=10.0, index_n_heads=2, index_head_dim=16, index_topk=4, hc_mult=4, hc_sinkhorn_iters=20,
    hc_eps=1e-6, rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 32, "beta_fast": 32,
                  "beta_slow": 1},
    max_position_embeddings=4096, num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1)


def v4_config(**over) -> ModelConfig:
    return ModelConfig.from_dict({**V4_TINY, **over})


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    from kvcache.engine.checkpoint.init import random_weights
    return random_weights(model, seed)
