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
    """Weights with enough spread that every path matters (routing, sinks, gates, hc mixes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight",)) :
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("_scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith(("_fn",)):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2 and name.endswith("weight"):
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                n_exp = model.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(n_exp, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]))
    return model
