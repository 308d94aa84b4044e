"""DeepSeek-V4-Flash (`deepseek_v4`): the readable model file.

    ids ─ embed ─> hc_mult identical streams
        ─ for each layer:  hc_pre(attn) ─ attn_norm ─ Attention ─ hc_post
                           hc_pre(ffn)  ─ ffn_norm  ─ MoE       ─ hc_post
        ─ hc_head (learned collapse) ─ norm ─ head ─> logits

Layer kinds come from `compress_ratios` (0: sliding window only, 4: CSA with the lightning
indexer, other: HCA); the first `num_hash_layers` MoE layers route by token id. The MTP layer
(`mtp.0`, V4 preview) loads and runs: h0 = e_proj(enorm(embed(next token))) on every stream
+ h_proj(hnorm(target streams)), one SWA layer, its own hc head and norm, the shared head.
Parameter names are the official checkpoint's (`layers.3.attn.wq_a.weight`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvcache.engine.compiled import phase
from kvcache.engine.model_config import ModelConfig
from kvcache.engine.decode_plan import DecodePlan, plan_decode
from kvcache.engine.layers.attention import Attended, Attention, AttentionState, core_or_attend
from kvcache.engine.layers.hyper import collapse, expand, hc_head, hc_head_params, hc_mix, hc_params
from kvcache.engine.layers.moe import MoE
from kvcache.engine.layers.norm import RMSNorm
from kvcache.engine.layers.decode_step import DecodeStep, decode_keys
from kvcache.engine.layers.rope import RotaryTables
from kvcache.engine.models.dspark import make_stages


@dataclass
class ModelState:
    """A request's KV state: one AttentionState per layer, and how many tokens it holds."""
    layers: list[AttentionState]
    length: int = 0
    drafter: list[AttentionState] = field(default_factory=list)
    extra: dict = field(default_factory=dict)      # e.g. V4.1 Engram's last token ids
    draft_carry: object = None     # what a drafter keeps between its context and its next draft (MTP: its last output)

    def clone(self, view=None) -> "ModelState":
        """A copy; `view` (a PoolView of another request) rebinds its pool-backed rows and slots."""
        return ModelState([s.clone(None if view is None else view.layer(i)) for i, s in enumerate(self.layers)],
                          self.length, [s.clone() for s in self.drafter],
                          {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.extra.items()},
                          self.draft_carry)


class DecoderLayer(nn.Module):
    """One transformer layer: mHC-mixed attention, then the mHC-mixed MoE (module doc)."""

    def __init__(self, config: ModelConfig, layer: int, ratio: int | None = None, hashed: bool | None = None):
        super().__init__()
        c = config
        self.c = c
        self.attn = Attention(c, layer, ratio)
        self.ffn = MoE(c, hashed=layer < c.num_hash_layers if hashed is None else hashed)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        hc_params(self, "hc_attn", c.hc_mult, c.hidden_size)
        hc_params(self, "hc_ffn", c.hc_mult, c.hidden_size)

    def forward(self, h: torch.Tensor, positions, states, rope: RotaryTables, token_ids: torch.Tensor,
                attend=None) -> torch.Tensor:
        """h [B, T, n, d] streams -> streams. `positions`/`states`: one request's, or lists (a
        flattened batch). `attend` replaces the attention call (DSpark stages). Phases: see
        engine/compiled.py."""
        pos_all = torch.cat(positions if isinstance(positions, list) else [positions])
        x, post, comb, inputs = phase(self, "attn_in", h, pos_all, rope, attend is None)
        q, out = core_or_attend(self.attn, attend, x, inputs, positions, states, rope)
        h, post, comb, flat, weights, ids, shared = phase(self, "ffn_in", out, q, h, post, comb, pos_all, rope,
                                                          token_ids)
        return phase(self, "ffn_out", self.ffn.routed(flat, weights, ids), flat, weights, shared, h, post, comb)

    def decode(self, h, pos, rope, token_ids, step: DecodeStep, lanes: dict) -> torch.Tensor:
        """A pure decode step of requests whose state is all in the pool (engine/decode_plan.py):
        the same layer as forward(), with no per-request Python and no host sync (the routed
        experts' host path is one opaque op): compiled, every layer's decode is part of one
        graph for the whole step (the model's decode_layers)."""
        x, post, comb, (q, kv, pre) = self.attn_in(h, pos, rope, True)
        keys, bias = decode_keys(self.attn, kv, pre, step, lanes, rope)
        h, post, comb, flat, weights, ids, shared = self.ffn_in(Attended(None, keys, bias), q, h, post, comb, pos,
                                                                rope, token_ids)
        out = self.ffn.combine(self.ffn.routed_sum(flat, weights, ids), shared)
        return expand(out.view(h.shape[:-2] + h.shape[-1:]), h, post, comb)

    def attn_in(self, h, pos_all, rope, inputs: bool):
        """(attention input x, post, comb, (q, kv, history inputs) if `inputs`)."""
        c = self.c
        pre, post, comb = hc_mix(h, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, c.hc_sinkhorn_iters,
                                 c.hc_eps, c.rms_norm_eps)
        x = self.attn_norm(collapse(h, pre))
        return x, post, comb, self.attn.inputs(x, pos_all, rope) if inputs else None

    def ffn_in(self, out, q, h, post, comb, pos_all, rope, token_ids):
        """Attention into the streams (`out`: what attn.core returned for queries q, finished and
        projected here; q None: an output already projected), then the MoE's token-wise inputs:
        (streams, post, comb, x [N, d], gate weights, expert ids, shared expert)."""
        c = self.c
        if q is not None:
            out = self.attn.output(self.attn.attended(q, out), pos_all, rope, h.dtype)
        h = expand(out, h, post, comb)
        pre, post, comb = hc_mix(h, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, c.hc_sinkhorn_iters,
                                 c.hc_eps, c.rms_norm_eps)
        flat = self.ffn_norm(collapse(h, pre)).flatten(0, -2)
        weights, ids = self.ffn.gate(flat, token_ids)
        return h, post, comb, flat, weights, ids, self.ffn.shared(flat)

    def ffn_out(self, routed, flat, weights, shared, h, post, comb):
        """The MoE's output (routed experts summed, plus the shared one) into the streams."""
        out = self.ffn.combine(self.ffn.sum_pairs(flat, weights, routed), shared)
        return expand(out.view(h.shape[:-2] + h.shape[-1:]), h, post, comb)


class MTPLayer(DecoderLayer):
    """`mtp.{i}`: a SWA layer (non-hash MoE) that predicts the token after next from the
    target's streams and the next token's embedding; its own hc head and norm."""

    def __init__(self, config: ModelConfig):
        c = config
        super().__init__(c, c.num_hidden_layers, ratio=0, hashed=False)
        d = c.hidden_size
        self.enorm, self.hnorm = RMSNorm(d, c.rms_norm_eps), RMSNorm(d, c.rms_norm_eps)
        self.norm = RMSNorm(d, c.rms_norm_eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        hc_head_params(self, c.hc_mult, c.hidden_size)

    def draft(self, streams: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor,
              state: AttentionState, rope: RotaryTables, next_ids: torch.Tensor) -> torch.Tensor:
        """streams [B, T, n, d] (target, before its hc head), next_embeds [B, T, d] -> hidden [B, T, d]."""
        h = self.e_proj(self.enorm(next_embeds)).unsqueeze(2) + self.h_proj(self.hnorm(streams))
        h = self(h, positions, state, rope, next_ids)
        c = self.c
        return self.norm(hc_head(h, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps, c.rms_norm_eps))


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = self.config = config
        self.rope = RotaryTables(c)
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        hc_head_params(self, c.hc_mult, c.hidden_size)
        if "dspark_block_size" in c.extra:      # V4-Flash-0731 / -DSpark: a 3-stage DSpark drafter
            self.mtp = make_stages(c, DecoderLayer)
        else:                                   # the preview's MTP-1 layer
            self.mtp = nn.ModuleList(MTPLayer(c) for _ in range(c.num_nextn_predict_layers))

    def new_state(self, pool_view=None) -> ModelState:
        """A request's empty state; `pool_view` (engine/kv_pool.py) keeps its history rows in the pool."""
        return ModelState([layer.attn.new_state(None if pool_view is None else pool_view.layer(i))
                           for i, layer in enumerate(self.layers)], 0, [m.attn.new_state() for m in self.mtp])

    def run(self, chunks: list[torch.Tensor], states: list[ModelState], collect: tuple[int, ...] = ()):
        """One step over several requests: chunks[i] [T_i] continue states[i] (advanced). The tokens
        run as one flattened batch [1, sum T_i]; returns (streams [1, N, n, d], positions per request,
        {layer: streams} for the layers in `collect`)."""
        tokens, positions, h = batch_inputs(self.embed, self.config, chunks, states)
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, [st.layers[i] for st in states], self.rope, tokens)
            if i in collect:
                taps[i] = h
        for st, ch in zip(states, chunks):
            st.length += len(ch)
        return h, positions, taps

    def plan_decode(self, chunks: list[torch.Tensor], states: list[ModelState], batch: int = 0,
                    blocks: int = 0) -> DecodePlan | None:
        """A DecodePlan when this step is one token per request with every state in the pool
        and the routed experts stacked (the engine's usual decode step), else None; `batch` /
        `blocks` pad it (engine/decode_graphs.py)."""
        if not getattr(self, "planned_decode", True) or any(len(ch) != 1 for ch in chunks) \
                or self.layers[0].ffn.stacked is None:
            return None
        if any(layer.attn.reduce is not None or layer.ffn.reduce is not None for layer in self.layers):
            return None                                           # tensor / expert parallelism
        return plan_decode([layer.attn for layer in self.layers], states, self.embed.weight.device, batch, blocks)

    def decode(self, chunks: list[torch.Tensor], states: list[ModelState], plan: DecodePlan) -> torch.Tensor:
        """step() for a planned decode step: logits [len(chunks), vocab], states advanced."""
        tokens = checked_tokens(self.config, chunks, states, plan.batch)
        logits = self.decode_step(tokens.to(self.embed.weight.device, non_blocking=True), plan.step, plan.lanes)
        plan.commit()
        return logits[: len(chunks)]

    def decode_step(self, tokens: torch.Tensor, step: DecodeStep, lanes: list[dict]) -> torch.Tensor:
        """The device work of a planned decode step, tensor ops only (what a CUDA graph captures):
        tokens [1, B] -> logits [B, vocab]; the lanes written."""
        h = hc_streams(self.embed, self.config, tokens)
        # the blocks read grow with the history: one dynamic size for compiled layers from the start
        # (1 block is a graph of its own), not a static graph for the first count seen
        torch._dynamo.maybe_mark_dynamic(step.tables, 1)
        # and so does the batch: dynamic from the first compile, not after a static graph for
        # the first size seen (a whole-step compile takes minutes on 2 cores; batch 1 gets its own)
        for t in (h, tokens):
            torch._dynamo.maybe_mark_dynamic(t, 1)
        for t in step.tensors():
            torch._dynamo.maybe_mark_dynamic(t, 0)
        whole = self.__dict__.get("compiled", {}).get("decode_layers")
        return (whole or type(self).decode_layers)(self, h, tokens, step, lanes)

    def decode_layers(self, h: torch.Tensor, tokens: torch.Tensor, step: DecodeStep, lanes: list[dict]) -> torch.Tensor:
        """Every layer's decode and the logits: a compiled decode step as one graph (compiled.py:
        one graph call a step instead of one per layer; a graph call's fixed cost, guards,
        wrappers and sizes passed in, is most of what a batch-1 layer's graph adds to its
        matmuls, and at batch 8 one graph is ~10-20 % faster than eight)."""
        for i, layer in enumerate(self.layers):
            h = layer.decode(h, step.pos, self.rope, tokens, step, lanes[i])
        return self.logits(h)[0]

    def streams_at(self, token_ids: torch.Tensor, state: ModelState, collect: tuple[int, ...]):
        """One request [1, T]: (streams, positions, {layer: streams}) (DSpark context)."""
        h, positions, taps = self.run([token_ids[0]], [state], collect)
        return h, positions[0], taps

    def streams(self, token_ids: torch.Tensor, state: ModelState) -> torch.Tensor:
        """Run the backbone on the next tokens [1, T]; the residual streams [1, T, n, d] (state advanced)."""
        return self.run([token_ids[0]], [state])[0]

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        c = self.config
        y = hc_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps, c.rms_norm_eps)
        return self.head(self.norm(y)).float()

    def forward(self, token_ids: torch.Tensor, state: ModelState | None = None) -> torch.Tensor:
        """Logits [1, T, vocab] (fp32) for tokens [1, T] that continue `state` (a new one if None)."""
        if token_ids.shape[0] != 1:
            raise ValueError("forward() takes one request [1, T]; use run() for a batch of requests")
        return self.logits(self.streams(token_ids, state if state is not None else self.new_state()))

    def step(self, chunks: list[torch.Tensor], states: list[ModelState]) -> torch.Tensor:
        """The engine's call: last-token logits [len(chunks), vocab] of each request's chunk."""
        plan = self.plan_decode(chunks, states)
        if plan is not None:
            return self.decode(chunks, states, plan)
        h, positions, _ = self.run(chunks, states)
        ends = torch.tensor([len(ch) for ch in chunks], device=h.device).cumsum(0) - 1
        return self.logits(h[:, ends])[0]

    def step_rows(self, chunks: list[torch.Tensor], states: list[ModelState], tails: list[int],
                  collect: tuple[int, ...] = ()):
        """A speculative step: (logits of each chunk's last tails[i] tokens [sum tails, vocab], the
        streams after the layers in `collect` at every token {layer: [1, N, n, d]})."""
        h, _, taps = self.run(chunks, states, collect)
        return self.logits(h[:, tail_rows(chunks, tails, h.device)])[0], taps

    def mtp_logits(self, streams: torch.Tensor, next_ids: torch.Tensor, state: ModelState,
                   start: int) -> torch.Tensor:
        """MTP-1 draft logits for the tokens after `next_ids`, given the target's streams."""
        positions = torch.arange(start, start + next_ids.shape[1], device=next_ids.device)
        h = self.mtp[0].draft(streams, self.embed(next_ids), positions, state.drafter[0], self.rope, next_ids)
        return self.head(h).float()


def tail_rows(chunks: list[torch.Tensor], tails: list[int], device) -> torch.Tensor:
    """The flat rows of each chunk's last tails[i] tokens in a flattened batch."""
    ends = torch.tensor([len(ch) for ch in chunks]).cumsum(0).tolist()
    return torch.tensor([r for end, n in zip(ends, tails) for r in range(end - n, end)], device=device)


def batch_inputs(embed: nn.Embedding, config: ModelConfig, chunks: list[torch.Tensor], states: list[ModelState]):
    """(tokens [1, N], positions per request, hc streams [1, N, n, d]) of a flattened batch, checked."""
    device = embed.weight.device
    tokens = checked_tokens(config, chunks, states).to(device, non_blocking=True)
    positions = [torch.arange(st.length, st.length + len(ch), device=device) for st, ch in zip(states, chunks)]
    return tokens, positions, hc_streams(embed, config, tokens)


def hc_streams(embed: nn.Embedding, config: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """The hc_mult identical residual streams [1, N, n, d] of tokens [1, N]."""
    return embed(tokens).unsqueeze(2).expand(-1, -1, config.hc_mult, -1).contiguous()


def checked_tokens(config: ModelConfig, chunks: list[torch.Tensor], states: list[ModelState],
                   pad_to: int = 0) -> torch.Tensor:
    """The step's token ids [1, N] on the host (padded with zeros to `pad_to`), checked there
    before anything reaches the device: no device sync, and a bad id or a position past the
    model's context is rejected before any compute."""
    tokens = torch.cat([ch.cpu() for ch in chunks])[None]
    check_ids(tokens, config.vocab_size)
    for st, ch in zip(states, chunks):
        if len(ch) and st.length + len(ch) - 1 >= config.max_position_embeddings:
            raise ValueError(f"position {st.length + len(ch) - 1} exceeds max_position_embeddings "
                             f"{config.max_position_embeddings}")
    if pad_to > tokens.shape[1]:
        tokens = torch.cat([tokens, tokens.new_zeros((1, pad_to - tokens.shape[1]))], 1)
    return tokens


def check_ids(token_ids: torch.Tensor, vocab_size: int) -> None:
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
        bad = token_ids[(token_ids < 0) | (token_ids >= vocab_size)][0]
        raise ValueError(f"token id {int(bad)} is outside the model's vocabulary (0..{vocab_size - 1})")
