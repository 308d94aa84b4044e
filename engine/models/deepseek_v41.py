"""DeepSeek-V4.1-Flash (`deepseek_v41`): the readable model file.

    ids ─ embed ─> hc_mult streams
        ─ for each layer L:  [Engram on layers 1, 14: n-gram memory into every stream]
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

from kvcache.engine.compiled import phase
from kvcache.engine.model_config import ModelConfig
from kvcache.engine.layers.attention import core_or_attend
from kvcache.engine.layers.attention41 import SharedAttention
from kvcache.engine.layers.engram import DEAD, Engram, hash_geometry
from kvcache.engine.layers.hyper import collapse, expand, hc_mix, hc_params
from kvcache.engine.layers.moe import MoE
from kvcache.engine.layers.norm import RMSNorm
from kvcache.engine.layers.rope import RotaryTables
from kvcache.engine.models.deepseek_v4 import ModelState, batch_inputs, tail_rows
from kvcache.engine.models.dspark import make_stages


class DecoderLayer41(nn.Module):
    """One V4.1 transformer layer: Engram (some layers), shared-KV attention, MoE, delayed pre-mixes."""

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

    def forward(self, h, pre_in, positions, states, rope, token_ids, shared, attend=None):
        """streams [B, T, n, d], the previous site's pre (None: take stream 0) -> (streams, this FFN
        site's pre). Phases: see engine/compiled.py."""
        pos_all = torch.cat(positions if isinstance(positions, list) else [positions])
        x, pre_a, post, comb, inputs = phase(self, "attn_in", h, pre_in, pos_all, rope, attend is None)
        q, out = core_or_attend(self.attn, attend, x, inputs, positions, states, rope, shared)
        h, pre_f, post, comb, flat, weights, ids, sh = phase(self, "ffn_in", out, q, h, pre_a, post, comb, pos_all,
                                                             rope, token_ids)
        return phase(self, "ffn_out", self.ffn.routed(flat, weights, ids), flat, weights, sh, h, post, comb), pre_f

    def attn_in(self, h, pre_in, pos_all, rope, inputs: bool):
        """(attention input x, this attention site's pre, post, comb, (q, kv, history inputs) if `inputs`)."""
        pre_a, post_a, comb_a = self.mix(h, "attn")
        x = self.attn_norm(h[..., 0, :] if pre_in is None else collapse(h, pre_in))
        return x, pre_a, post_a, comb_a, self.attn.inputs(x, pos_all, rope) if inputs else None

    def ffn_in(self, out, q, h, pre_a, post_a, comb_a, pos_all, rope, token_ids):
        """Attention into the streams (`out`: what attn.core returned for queries q, finished and
        projected here; q None: an output already projected), then the MoE's token-wise inputs:
        (streams, the FFN site's pre, post, comb, x [N, d], gate weights, expert ids, shared expert)."""
        if q is not None:
            out = self.attn.output(self.attn.attended(q, out), pos_all, rope, h.dtype)
        h = expand(out, h, post_a, comb_a)
        pre_f, post_f, comb_f = self.mix(h, "ffn")
        flat = self.ffn_norm(collapse(h, pre_a)).flatten(0, -2)
        weights, ids = self.ffn.gate(flat, token_ids)
        return h, pre_f, post_f, comb_f, flat, weights, ids, self.ffn.shared(flat)

    def ffn_out(self, routed, flat, weights, shared, h, post, comb):
        """The MoE's output (routed experts summed, plus the shared one) into the streams."""
        out = self.ffn.combine(self.ffn.sum_pairs(flat, weights, routed), shared)
        return expand(out.view(h.shape[:-2] + h.shape[-1:]), h, post, comb)


class DeepseekV41ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, prefill_keep_tokens: int | None = None):
        super().__init__()
        c = self.config = config
        self.rope = RotaryTables(c)
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer41(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.decoder_start = max(c.kv_source_layer_ids) + 1
        self.prefill_keep_tokens = prefill_keep_tokens
        if prefill_keep_tokens is not None and prefill_keep_tokens < c.sliding_window:
            raise ValueError(f"prefill_keep_tokens ({prefill_keep_tokens}) must cover the sliding window "
                             f"({c.sliding_window})")
        if c.num_nextn_predict_layers:
            self.mtp = make_stages(c, DecoderLayer41)
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

    def new_state(self, pool_view=None) -> ModelState:
        """A request's empty state; `pool_view` (engine/kv_pool.py) keeps its history rows in the pool."""
        return ModelState([layer.attn.new_state(None if pool_view is None else pool_view.layer(i))
                           for i, layer in enumerate(self.layers)], 0,
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
        comp = torch.from_numpy(self.token_map)[full]         # all on the host: one copy to the device later
        if c.image_token_id is not None:
            comp = torch.where(full == c.image_token_id, torch.full_like(comp, DEAD), comp)
        pad = int(self.token_map[c.engram_pad_token_id])
        values, blocked = [], torch.zeros(full.shape[0], T, dtype=torch.bool, device="cpu")
        for s in range(c.engram_max_ngram_size):
            idx = torch.arange(T, device="cpu") + back - s
            v = comp[:, idx.clamp(min=0)]
            blocked = blocked | (idx < 0)[None, :] | (v == DEAD)
            values.append(torch.where(blocked, torch.full_like(v, pad), v))
        alive = comp[:, back:] != DEAD
        return torch.stack(values, -1), alive

    # ------------------------------------------------------------------ forward
    def run(self, chunks: list[torch.Tensor], states: list[ModelState], collect: tuple[int, ...] = ()):
        """One step over several requests (chunks[i] [T_i] continues states[i]) as one flattened batch;
        returns (final hidden [1, N', d], positions per request, {layer: streams}). N' < N only in
        prefill truncation mode: decoder layers see each request's last `prefill_keep_tokens` tokens."""
        c = self.config
        tokens, positions, h = batch_inputs(self.embed, c, chunks, states)
        values = alive = None
        if c.engram_layer_ids:
            parts = [self._engram_inputs(ch.cpu()[None], st) for ch, st in zip(chunks, states)]
            # engram rows are hashed on the host (values stay there); each layer's rows go over once
            values = torch.cat([v for v, _ in parts], 1)
            alive = torch.cat([a for _, a in parts], 1).to(h.device, non_blocking=True)
        pre, shared, taps = None, [{} for _ in chunks], {}
        for i, layer in enumerate(self.layers):
            if i == self.decoder_start and self.prefill_keep_tokens is not None:
                keep = self._kept_rows(positions, shared)
                h, pre, tokens = h[:, keep], pre[:, keep], tokens[:, keep]
                values = None if values is None else values[:, keep.cpu()]
                alive = None if alive is None else alive[:, keep]
            if hasattr(layer, "engram"):
                g = self._engram_geometry
                slot = layer.engram.slot
                rows = layer.engram.rows(values, g[0][slot], g[1][slot], g[2][slot])
                h = layer.engram(h, rows.to(h.device, non_blocking=True), alive)
            h, pre = layer(h, pre, positions, [st.layers[i] for st in states], self.rope, tokens, shared)
            if i in collect:
                taps[i] = h
        for st, ch in zip(states, chunks):
            st.length += len(ch)
        return self.norm(collapse(h, pre)), positions, taps

    def _kept_rows(self, positions: list[torch.Tensor], shared: list[dict]) -> torch.Tensor:
        """Truncate each request to its last `prefill_keep_tokens` rows (in place for positions and
        shared); the flat row indices kept."""
        keep, idx, start = self.prefill_keep_tokens, [], 0
        for k, pos in enumerate(positions):
            n = min(len(pos), keep)
            idx.append(torch.arange(start + len(pos) - n, start + len(pos), device=pos.device))
            start += len(pos)
            positions[k] = pos[-n:]
            for key in ("topk", "candidates"):
                if key in shared[k]:
                    shared[k][key] = shared[k][key][:, -n:]
        return torch.cat(idx)

    def streams(self, token_ids: torch.Tensor, state: ModelState, collect: tuple[int, ...] = ()):
        """One request [1, T]: (final hidden [1, T', d], positions, {layer: streams})."""
        hidden, positions, taps = self.run([token_ids[0]], [state], collect)
        return hidden, positions[0], taps

    def forward(self, token_ids: torch.Tensor, state: ModelState | None = None) -> torch.Tensor:
        """Logits [1, T, vocab] (fp32), or for the last `prefill_keep_tokens` tokens in truncation mode."""
        if token_ids.shape[0] != 1:
            raise ValueError("forward() takes one request [1, T]; use run() for a batch of requests")
        hidden, _, _ = self.streams(token_ids, state if state is not None else self.new_state())
        return self.head(hidden).float()

    def step_rows(self, chunks: list[torch.Tensor], states: list[ModelState], tails: list[int],
                  collect: tuple[int, ...] = ()):
        """A speculative step: (logits of each chunk's last tails[i] tokens [sum tails, vocab], the
        streams after the layers in `collect` at every token)."""
        if self.prefill_keep_tokens is not None:
            raise ValueError("speculative steps need every token's row: not in prefill truncation mode")
        hidden, _, taps = self.run(chunks, states, collect)
        return self.head(hidden[0, tail_rows(chunks, tails, hidden.device)]).float(), taps

    def step(self, chunks: list[torch.Tensor], states: list[ModelState]) -> torch.Tensor:
        """The engine's call: last-token logits [len(chunks), vocab] of each request's chunk."""
        hidden, positions, _ = self.run(chunks, states)
        ends = torch.tensor([len(p) for p in positions], device=hidden.device).cumsum(0) - 1
        return self.head(hidden[0, ends]).float()
