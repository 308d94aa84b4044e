"""DeepSeek-V4.1-Flash (`deepseek_v41`): the readable model file.

    ids ─ embed ─> hc_mult streams
        ─ for each block L:  [Engram on layers 1, 14: n-gram memory into every stream]
              mix_attn = hc(streams)       pre_a, post_a, comb_a     (from the streams now)
              x = collapse(streams, pre of the previous site)        "delayed pre"; layer 0: stream 0
              streams = post_a * Attention(attn_norm(x)) + comb_a^T streams
              mix_ffn = hc(streams)        pre_f, post_f, comb_f
              x = collapse(streams, pre_a)
              streams = post_f * MoE(ffn_norm(x)) + comb_f^T streams
        ─ norm(collapse(streams, pre_f of the last layer)) ─ head ─> logits     (no learned hc head)

Attention layers share history (layers/attention41.py): kv sources 2, 8, 14 (ratio 2) and 20
(ratio 1) own compressors and index keys; index sources pick top-k; the rest reuse both.
Causal encoder / decoder: layers after the last kv source only hold sliding windows, so with
`prefill_keep_tokens` set (DeepInfer's compact prefill truncation), a forward call runs those
layers on its last `prefill_keep_tokens` tokens only and returns logits for those tokens only:
an approximation by design (the decoder layers' windows see only the kept tail).
The DSpark drafter (`mtp.0..2`) lives in models/dspark.py.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kvcache.engine.config import ModelConfig
from kvcache.engine.layers.attention import AttentionState
from kvcache.engine.layers.attention41 import SharedAttention
from kvcache.engine.layers.engram import DEAD, Engram, hash_geometry
from kvcache.engine.layers.hyper import collapse, expand, hc_mix, hc_params
from kvcache.engine.layers.moe import MoE
from kvcache.engine.layers.norm import RMSNorm
from kvcache.engine.layers.rope import RotaryTables
from kvcache.engine.models.deepseek_v4 import ModelState, check_ids


class Block41(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, ratio: int | None = None, n_experts: int | None = None,
                 top_k: int | None = None):
        super().__init__()
        c = self.c = config
        self.attn = SharedAttention(c, layer, ratio)
        self.ffn = MoE(c, hashed=False, n_experts=n_experts, top_k=top_k)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        hc_params(self, "hc_attn", c.hc_mult, c.hidden_size)
        hc_params(self, "hc_ffn", c.hc_mult, c.hidden_size)
        if layer in c.engram_layer_ids:
            self.engram = Engram(c, list(c.engram_layer_ids).index(layer))

    def mix(self, h: torch.Tensor, site: str):
        c = self.c
        return hc_mix(h, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                      getattr(self, f"hc_{site}_scale"), c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)

    def forward(self, h, pre_in, positions, state: AttentionState, rope, token_ids, shared, attend=None):
        """streams [B, T, n, d], the previous site's pre (None: take stream 0) -> (streams, this FFN site's pre)."""
        pre_a, post_a, comb_a = self.mix(h, "attn")
        x = h[..., 0, :] if pre_in is None else collapse(h, pre_in)
        out = (attend or self.attn)(self.attn_norm(x), positions, state, rope, shared)
        h = expand(out, h, post_a, comb_a)
        pre_f, post_f, comb_f = self.mix(h, "ffn")
        h = expand(self.ffn(self.ffn_norm(collapse(h, pre_a)), token_ids), h, post_f, comb_f)
        return h, pre_f


class DeepseekV41ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, prefill_keep_tokens: int | None = None):
        super().__init__()
        c = self.config = config
        self.rope = RotaryTables(c)
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block41(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.decoder_start = max(c.kv_source_layer_ids) + 1
        self.prefill_keep_tokens = prefill_keep_tokens
        if prefill_keep_tokens is not None and prefill_keep_tokens < c.sliding_window:
            raise ValueError(f"prefill_keep_tokens ({prefill_keep_tokens}) must cover the sliding window "
                             f"({c.sliding_window})")
        if c.num_nextn_predict_layers:
            from kvcache.engine.models.dspark import make_stages
            self.mtp = make_stages(c)
        if c.engram_layer_ids:
            mults, primes, offsets = hash_geometry(c)
            self._engram_geometry = tuple(torch.from_numpy(a) for a in (mults, primes, offsets))
            # token id -> compressed id; the checkpoint's tokenizer sets the real map (set_token_map)
            self.token_map = np.arange(c.vocab_size, dtype=np.int64) % max(c.engram_compressed_vocab_size, 1)

    def set_token_map(self, token_map: np.ndarray) -> None:
        if int(token_map.max()) + 1 != self.config.engram_compressed_vocab_size:
            raise ValueError(f"the tokenizer maps to {int(token_map.max()) + 1} compressed ids but the config says "
                             f"engram_compressed_vocab_size = {self.config.engram_compressed_vocab_size}")
        full = np.zeros(self.config.vocab_size, dtype=np.int64)
        full[: len(token_map)] = token_map
        self.token_map = full

    def new_state(self) -> ModelState:
        return ModelState([blk.attn.new_state() for blk in self.layers], 0,
                          [stage.attn.new_state() for stage in getattr(self, "mtp", [])])

    # ------------------------------------------------------------------ Engram inputs
    def _engram_inputs(self, token_ids: torch.Tensor, state: ModelState):
        """(values [B, T, n_max] per engram layer slot, alive [B, T]); uses the ids held in `state`."""
        c = self.config
        history = state.extra.get("engram_ids")
        full = token_ids if history is None else torch.cat([history, token_ids], 1)
        state.extra["engram_ids"] = full[:, -(c.engram_max_ngram_size - 1):] if c.engram_max_ngram_size > 1 \
            else full[:, :0]
        T, back = token_ids.shape[1], full.shape[1] - token_ids.shape[1]
        comp = torch.from_numpy(self.token_map)[full]
        if c.image_token_id is not None:
            comp = torch.where(full == c.image_token_id, torch.full_like(comp, DEAD), comp)
        pad = int(self.token_map[c.engram_pad_token_id])
        values, blocked = [], torch.zeros(full.shape[0], T, dtype=torch.bool)
        for s in range(c.engram_max_ngram_size):
            idx = torch.arange(T) + back - s
            v = comp[:, idx.clamp(min=0)]
            blocked = blocked | (idx < 0)[None, :] | (v == DEAD)
            values.append(torch.where(blocked, torch.full_like(v, pad), v))
        alive = comp[:, back:] != DEAD
        return torch.stack(values, -1), alive

    # ------------------------------------------------------------------ forward
    def streams(self, token_ids: torch.Tensor, state: ModelState, collect: tuple[int, ...] = ()):
        """Run the backbone; (final collapsed hidden [B, T', d], kept positions, {layer: streams}).
        T' < T only in prefill truncation mode."""
        c = self.config
        B, T = token_ids.shape
        positions = torch.arange(state.length, state.length + T)
        if int(positions[-1]) >= c.max_position_embeddings:
            raise ValueError(f"position {int(positions[-1])} exceeds max_position_embeddings {c.max_position_embeddings}")
        h = self.embed(token_ids).unsqueeze(2).expand(-1, -1, c.hc_mult, -1).contiguous()
        values, alive = self._engram_inputs(token_ids, state) if c.engram_layer_ids else (None, None)
        pre, shared, taps = None, {}, {}
        for i, (blk, st) in enumerate(zip(self.layers, state.layers)):
            keep = self.prefill_keep_tokens
            if i == self.decoder_start and keep is not None and h.shape[1] > keep:
                h, pre, positions, token_ids = h[:, -keep:], pre[:, -keep:], positions[-keep:], token_ids[:, -keep:]
                for key in ("topk", "candidates"):
                    if key in shared:
                        shared[key] = shared[key][:, -keep:]
                alive = None if alive is None else alive[:, -keep:]
                values = None if values is None else values[:, -keep:]
            if hasattr(blk, "engram"):
                g = self._engram_geometry
                rows = blk.engram.rows(values, g[0][blk.engram.slot], g[1][blk.engram.slot], g[2][blk.engram.slot])
                h = blk.engram(h, rows, alive)
            h, pre = blk(h, pre, positions, st, self.rope, token_ids, shared)
            if i in collect:
                taps[i] = h
        state.length += T
        return self.norm(collapse(h, pre)), positions, taps

    def forward(self, token_ids: torch.Tensor, state: ModelState | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] (fp32), or for the last `prefill_keep_tokens` tokens in truncation mode."""
        if state is None:
            state = self.new_state()
        check_ids(token_ids, self.config.vocab_size)
        hidden, _, _ = self.streams(token_ids, state)
        return self.head(hidden).float()
