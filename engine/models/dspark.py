"""DSpark drafter (`mtp.0`, `mtp.1`, `mtp.2`) of V4.1 and of V4-Flash-0731: its forward pass;
drafting policy and verification belong to the engine's speculative decoding. V4's stages are V4
layers with their own pre-mixes and a learned hc head on the last stage; V4.1's use the delayed
pre-mix. Both average each target layer's hc streams to form the context features (vLLM does so
for V4.1; for V4 it is our reading, not confirmed by a public implementation).

    context:  target streams of layers dspark_target_layer_ids, averaged over the hc streams,
              concatenated ─ mtp.0.main_proj ─ mtp.0.main_norm ─> main_x [T, d]
              each stage writes kv_norm(wkv(main_x)), RoPE'd at the context positions, into its
              own sliding window (the drafter's only cache)
    draft:    a draft block, [anchor, noise x (dspark_block_size - 1)] at the next positions,
              embedded to hc streams, through the 3 stages (SWA layers, dspark experts); draft
              tokens see the context window causally and each other in both directions; collapse
              with the last FFN pre -> h_i
    heads:    logits_i = head(mtp.2.norm(h_i)) + markov_head.head @ markov_head.embed[prev_i]
              confidence_i = sigmoid(confidence_head.proj([h_i ; markov_head.embed[prev_i]]))
              prev_1 = anchor, prev_i = the token drafted at i - 1
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvcache.engine.model_config import ModelConfig
from kvcache.engine.layers.attention import AttentionState
from kvcache.engine.layers.hyper import collapse, hc_head, hc_head_params
from kvcache.engine.layers.norm import RMSNorm
from kvcache.engine.layers.rope import apply_rope


class MarkovHead(nn.Module):
    """V4.1 names `embed` / `head`; V4-0731 calls the same two tables `markov_w1` / `markov_w2`."""

    def __init__(self, vocab: int, rank: int, v41: bool):
        super().__init__()
        self.names = ("embed", "head") if v41 else ("markov_w1", "markov_w2")
        setattr(self, self.names[0], nn.Embedding(vocab, rank))
        setattr(self, self.names[1], nn.Linear(rank, vocab, bias=False))

    def bias(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the transition logits of `prev` [B, V], its rank-r embedding [B, r])."""
        e = getattr(self, self.names[0])(prev)
        return getattr(self, self.names[1])(e), e


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 1, bias=False)


def make_stages(config: ModelConfig, layer: Callable[..., nn.Module]) -> nn.ModuleList:
    """The drafter's stages under their official names (`mtp.0` .. `mtp.2`), each one the target
    model's own decoder layer (`layer`: V4.1's DecoderLayer41 or V4's DecoderLayer), window only."""
    c, x = config, config.extra
    n = max(c.num_nextn_predict_layers, len(x.get("dspark_target_layer_ids", [])) or 3)
    if c.is_v41:
        stages = nn.ModuleList(layer(c, c.num_hidden_layers + i, ratio=0, n_experts=x.get("dspark_n_routed_experts"),
                                     top_k=x.get("dspark_num_experts_per_tok")) for i in range(n))
    else:
        stages = nn.ModuleList(layer(c, c.num_hidden_layers + i, ratio=0, hashed=False) for i in range(n))
        hc_head_params(stages[-1], c.hc_mult, c.hidden_size)   # V4 keeps a learned hc head on the last stage
    targets = len(x.get("dspark_target_layer_ids", [])) or 3
    stages[0].main_proj = nn.Linear(targets * c.hidden_size, c.hidden_size, bias=False)
    stages[0].main_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
    last = stages[-1]
    last.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
    rank = int(x.get("dspark_markov_rank", 256))
    last.markov_head = MarkovHead(c.vocab_size, rank, c.is_v41)
    last.confidence_head = ConfidenceHead(c.hidden_size + rank)
    return stages


def write_context(model, taps: dict[int, torch.Tensor], positions: torch.Tensor, states: list[AttentionState]) -> None:
    """Feed the target's hidden states at `positions` into every stage's window."""
    stages, c = model.mtp, model.config
    feats = torch.cat([taps[t].float().mean(2) for t in c.extra["dspark_target_layer_ids"]], -1)
    main_x = stages[0].main_norm(stages[0].main_proj(feats.to(stages[0].main_proj.weight.dtype)))
    for stage, st in zip(stages, states):
        attn = stage.attn
        cos, sin = model.rope.cos_sin(positions, attn.table)
        kv = apply_rope(attn.kv_norm(attn.wkv(main_x)).float(), cos, sin)
        rows = kv if st.window is None else torch.cat([st.window, kv], 1)
        st.window = rows[:, -(attn.window - 1):]


def draft_hidden(model, anchor: torch.Tensor, start: int, states: list[AttentionState]) -> torch.Tensor:
    """h_i [B, size, d] for the draft block [anchor, noise...] placed at positions start, start+1, ..."""
    c = model.config
    size, noise = int(c.extra.get("dspark_block_size", 5)), int(c.extra.get("dspark_noise_token_id", 0))
    dev = anchor.device
    ids = torch.cat([anchor[:, None], torch.full((anchor.shape[0], size - 1), noise, dtype=torch.long, device=dev)], 1)
    positions = torch.arange(start, start + size, device=dev)
    h = model.embed(ids).unsqueeze(2).expand(-1, -1, c.hc_mult, -1).contiguous()
    pre = None
    for stage, st in zip(model.mtp, states):
        attend = _draft_attention(stage.attn, model.rope)
        if c.is_v41:
            h, pre = stage(h, pre, positions, st, model.rope, ids, {}, attend=attend)
        else:
            h = stage(h, positions, st, model.rope, ids, attend=attend)
    if c.is_v41:
        return collapse(h, pre)
    last = model.mtp[-1]
    return hc_head(h, last.hc_head_fn, last.hc_head_base, last.hc_head_scale, c.hc_eps, c.rms_norm_eps)


def draft_hidden_many(model, anchors: list[int], starts: list[int], states: list[list[AttentionState]]) -> torch.Tensor:
    """draft_hidden for R requests at their own positions in one pass per stage (a flattened
    batch: each request's block attends its own window): h [R, size, d]."""
    c = model.config
    size, noise = int(c.extra.get("dspark_block_size", 5)), int(c.extra.get("dspark_noise_token_id", 0))
    dev = model.embed.weight.device
    ids = torch.tensor([[t for a in anchors for t in (a, *[noise] * (size - 1))]], device=dev)
    positions = [torch.arange(s, s + size, device=dev) for s in starts]
    h = model.embed(ids).unsqueeze(2).expand(-1, -1, c.hc_mult, -1).contiguous()
    pre = None
    for k, stage in enumerate(model.mtp):
        attend = _draft_attention(stage.attn, model.rope)
        sts = [st[k] for st in states]
        if c.is_v41:
            h, pre = stage(h, pre, positions, sts, model.rope, ids, [{} for _ in sts], attend=attend)
        else:
            h = stage(h, positions, sts, model.rope, ids, attend=attend)
    if c.is_v41:
        out = collapse(h, pre)
    else:
        last = model.mtp[-1]
        out = hc_head(h, last.hc_head_fn, last.hc_head_base, last.hc_head_scale, c.hc_eps, c.rms_norm_eps)
    return out.view(len(anchors), size, -1)


def _draft_attention(attn, rope):
    """Attention of a draft block: the window (causal, within W) plus the whole draft (bidirectional);
    the draft's rows are not kept (the window holds only accepted context)."""
    def run(x, positions, state: AttentionState, _rope, _shared):
        _, q, kv = attn.qkv(x, positions, rope)
        ctx = state.window if state.window is not None else kv.new_zeros((kv.shape[0], 0, kv.shape[-1]))
        first = int(positions[0]) - ctx.shape[1]
        dev = x.device
        delta = positions[:, None] - (torch.arange(ctx.shape[1], device=dev) + first)[None, :]
        outside = (delta <= 0) | (delta >= attn.window)
        ctx_bias = torch.zeros(delta.shape, device=dev).masked_fill(outside, float("-inf"))
        own = torch.zeros(len(positions), len(positions), device=dev)
        bias = torch.cat([ctx_bias, own], 1).expand(x.shape[0], -1, -1)
        out = attn.attend(q, torch.cat([ctx, kv], 1), bias)
        return attn.output(out, positions, rope, x.dtype)
    return run


def heads(model, hidden: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, V], confidence [B]) for one draft position given the previous token [B]."""
    last = model.mtp[-1]
    transition, e = last.markov_head.bias(prev)
    logits = model.head(last.norm(hidden)).float() + transition.float()
    proj = last.confidence_head.proj
    conf = torch.sigmoid(proj(torch.cat([hidden, e], -1).to(proj.weight.dtype)).float())[..., 0]
    return logits, conf


def greedy_draft(model, anchor: torch.Tensor, start: int, states) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens [B, size] and confidences [B, size] of one draft block (the Markov loop)."""
    hidden = draft_hidden(model, anchor, start, states)
    prev, toks, confs = anchor, [], []
    for i in range(hidden.shape[1]):
        logits, conf = heads(model, hidden[:, i], prev)
        prev = logits.argmax(-1)
        toks.append(prev)
        confs.append(conf)
    return torch.stack(toks, 1), torch.stack(confs, 1)
