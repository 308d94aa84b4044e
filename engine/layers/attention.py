"""V4 attention: one shared K = V latent row per token (MQA), a sliding window, compressed history.

    x ─ wq_a ─ q_norm ─> qr ─ wq_b ─> q [H, D] ─ (V4: per-head RMS) ─ RoPE(t)
    x ─ wkv ─ kv_norm ─> kv [D] ─ RoPE(t)                         (the row the window caches)
    keys for query t:  window rows t-W+1 .. t   +   compressed entries (HCA: all visible,
                       CSA: the indexer's top-k), one softmax with a per-head sink in the
                       denominator only:  p_i = exp(s_i) / (sum_j exp(s_j) + exp(sink_h))
    o = sum_i p_i kv_i ─ RoPE(-t) on the rope dims ─ grouped wo_a (o_groups) ─ wo_b

Long prompts are processed in query tiles of QUERY_TILE tokens, each against the window rows
it can see, so memory stays O(tile x (window + tile + entries)), never O(T^2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvcache.engine.model_config import ModelConfig
from kvcache.engine.layers.compressor import Compressor, CompressorState, Indexer
from kvcache.engine.layers.history import BlockRows, SlotField, clone_field, make_rows, padded_rows, record, slot_of
from kvcache.engine.layers.norm import RMSNorm, rms
from kvcache.engine.layers.decode_step import masked_bias
from kvcache.engine.layers.rope import RotaryTables, apply_rope

QUERY_TILE = 256


@dataclass
class Attended:
    """What Attention.core returns: the attention output [1, N, H, D], or (a decode step) the
    keys [B, S, D] and bias [B, S] its single queries attend over."""
    out: torch.Tensor | None
    keys: torch.Tensor | None
    bias: torch.Tensor | None


class AttentionState:
    """Per-request state of one attention layer: its window rows (in a pool slot when the engine
    runs it), and its compressors' states."""
    window = SlotField()                         # [B, <= W-1, D] the last rows (RoPE'd), fp32

    def __init__(self, window=None, compressor=None, index=None):
        self.window, self.compressor, self.index = window, compressor, index
        self.journal: list | None = None         # a speculative step's new rows (history.record)

    def clone(self, view=None) -> "AttentionState":
        """A copy; `view` (engine/kv_pool.PoolView) rebinds pool-backed rows and slots to another
        request (a fork); without it the copy is dense."""
        st = AttentionState(None, None if self.compressor is None else self.compressor.clone(view),
                            None if self.index is None else self.index.clone(view))
        st.window = clone_field(self, "window", None if view is None else view.slot_for)
        return st


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, ratio: int | None = None):
        """`ratio` overrides the config's compress ratio (drafter stages sit past the backbone)."""
        super().__init__()
        c = config
        self.n_heads, self.head_dim, self.window = c.num_attention_heads, c.head_dim, c.sliding_window
        self.o_groups, self.eps = c.o_groups, c.rms_norm_eps
        ratio = c.compress_ratios[layer] if ratio is None else ratio
        self.kind = "swa" if ratio == 0 else c.layer_kind(layer)
        self.q_head_norm = not c.is_v41
        self.table = "main" if self.kind == "swa" else "compress"
        self.wq_a = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = nn.Linear(c.q_lora_rank, c.num_attention_heads * c.head_dim, bias=False)
        self.wkv = nn.Linear(c.hidden_size, c.head_dim, bias=False)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.wo_a = nn.Linear(c.num_attention_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank,
                              bias=False)
        self.wo_b = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(c.num_attention_heads))
        self.reduce = None                       # tensor parallelism: sums the ranks' partial outputs
        self.compressor = (Compressor(c.hidden_size, c.head_dim, ratio, overlap=self.kind == "csa",
                                      eps=c.rms_norm_eps) if self.kind in ("csa", "hca") else None)
        self.indexer = (Indexer(c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim, c.index_topk,
                                ratio, c.rms_norm_eps) if self.kind == "csa" else None)
        self.ratio = ratio

    def new_state(self, view=None) -> AttentionState:
        """`view` (engine/kv_pool.PoolView, for this layer) puts history rows in the pool's blocks and
        the window and compressor carry in the request's pool slot; None: dense tensors."""
        lanes, dev = None if view is None else view.rows, self.attn_sink.device
        st = AttentionState(
            compressor=(CompressorState(rows=make_rows(self.head_dim, lanes, "entries", dev))
                        if self.compressor else None),
            index=CompressorState(rows=make_rows(self.indexer.head_dim, lanes, "index", dev)) if self.indexer else None)
        if view is not None:
            view.attach(st, "window")
            if st.compressor is not None:
                view.attach_carry(st.compressor, "")
            if st.index is not None:
                view.attach_carry(st.index, "i_")
        return st

    def forward(self, x: torch.Tensor, positions: torch.Tensor, state: AttentionState,
                rope: RotaryTables, shared: dict | None = None) -> torch.Tensor:
        """x [1, T, dim] at absolute positions [T] (contiguous after what `state` holds).
        `shared` carries what V4.1 layers read from their source layers (unused by V4)."""
        return self.forward_batch(x, [positions], [state], rope, [shared])

    def forward_batch(self, x: torch.Tensor, positions: list[torch.Tensor], states: list[AttentionState],
                      rope: RotaryTables, shared: list) -> torch.Tensor:
        """Several requests' tokens, contiguous in x [1, N, dim]: every projection runs once over
        all N tokens; only the state-dependent work (windows, compressor pooling, index scoring,
        the softmax over keys) runs per request."""
        pos_all = torch.cat(positions)
        q, kv, pre = self.inputs(x, pos_all, rope)
        out = self.attended(q, self.core(q, kv, positions, states, rope, shared, pre))
        return self.output(out, pos_all, rope, x.dtype)

    def inputs(self, x: torch.Tensor, pos_all: torch.Tensor, rope: RotaryTables):
        """The token-wise half (no state; what a compiled layer fuses): (q [1, N, H, D], the K = V
        rows kv [1, N, D], this layer's history inputs `pre`)."""
        qr, q, kv = self.qkv(x, pos_all, rope)
        return q, kv, self.project_history(x, qr, pos_all, rope)

    def core(self, q, kv, positions: list[torch.Tensor], states: list[AttentionState], rope: RotaryTables,
             shared: list, pre: dict) -> Attended:
        """The state-dependent half: each request's new rows into its state, then the softmax over
        the keys its queries see, or (a pure decode step) just those keys: `attended` runs that
        softmax, pure, so that a compiled layer fuses it."""
        if len(q[0]) == len(positions):                                  # a pure decode step
            keys, bias = self._decode_keys(q, kv, positions, states, rope, shared, pre)
            # the key count grows as history does: compiled layers take it as a dynamic size at
            # once rather than compiling for two sizes first
            torch._dynamo.maybe_mark_dynamic(keys, 1)
            torch._dynamo.maybe_mark_dynamic(bias, 1)
            return Attended(None, keys, bias)
        starts = [0]
        for pos in positions:
            starts.append(starts[-1] + len(pos))
        single = [i for i, pos in enumerate(positions) if len(pos) == 1]
        single = single if len(single) > 1 else []
        out = q.new_empty(q.shape)
        if single:                     # a mixed step: its decoding requests still share one softmax
            tok = torch.tensor([starts[i] for i in single], device=q.device)
            out[:, tok] = self._decode_batch(q[:, tok], kv[:, tok], [positions[i] for i in single],
                                             [states[i] for i in single], rope, [shared[i] for i in single],
                                             {k: v[:, tok] for k, v in pre.items()})
        for i, pos in enumerate(positions):
            if single and len(pos) == 1:
                continue
            sl = slice(starts[i], starts[i + 1])
            part = {k: v[:, sl] for k, v in pre.items()}
            out[:, sl] = self._attend_request(q[:, sl], kv[:, sl], pos, states[i], rope, shared[i], part)
        return Attended(out, None, None)

    def attended(self, q: torch.Tensor, core: Attended) -> torch.Tensor:
        """The attention output [1, N, H, D] (before the output projection) of what `core` returned."""
        if core.out is not None:
            return core.out
        return self.attend(q[0][:, None], core.keys, core.bias[:, None, :])[:, 0][None]

    def _decode_batch(self, q, kv, positions, states, rope, shared, pre) -> torch.Tensor:
        """A decode step's attention output [1, B, H, D] (core + attended in one)."""
        return self.attended(q, Attended(None, *self._decode_keys(q, kv, positions, states, rope, shared, pre)))

    def _decode_keys(self, q, kv, positions, states, rope, shared, pre) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token per request: histories (decode_histories) and full windows
        (_slide_full_windows) update for the whole batch, the rest per request; then one padded
        softmax for the whole batch over (keys [B, S = window + chosen entries, D], bias [B, S])."""
        seen = self._slide_full_windows(kv, states)
        if all(s is not None for s in seen) and self._pooled_histories(states):
            return self._decode_keys_pooled(torch.cat(seen), pre, positions, states, rope)
        B, rows, biases = len(positions), [], []
        histories = self.decode_histories(pre, positions, states, rope, shared)
        for i, (pos, st) in enumerate(zip(positions, states)):
            mine = seen[i]
            if mine is None:
                prev = st.window if st.window is not None else kv.new_zeros((1, 0, self.head_dim))
                mine = torch.cat([prev, kv[:, i:i + 1]], 1)[:, -self.window:]    # the rows this token sees
                st.window = mine[:, -(self.window - 1):] if self.window > 1 else mine[:, :0]
            entries, chosen = histories[i]
            keys, bias = mine[0], mine.new_zeros(mine.shape[1])
            if entries is not None and entries.shape[1]:
                c = chosen(0, 1)[0, 0]
                if c.is_floating_point():                                          # a bias over all entries
                    keys, bias = torch.cat([keys, entries[0]]), torch.cat([bias, c])
                else:                                                              # selected ids, -1 = none
                    keys = torch.cat([keys, entries[0][c.clamp(min=0)]])
                    bias = torch.cat([bias, torch.where(c >= 0, 0.0, float("-inf"))])
            rows.append(keys)
            biases.append(bias)
        S = max(r.shape[0] for r in rows)
        if all(r.shape[0] == S for r in rows):                                     # no padding needed
            K, M = torch.stack(rows), torch.stack(biases)
        else:
            K = rows[0].new_zeros((B, S, self.head_dim))
            M = biases[0].new_full((B, S), float("-inf"))
            for i, (r, b) in enumerate(zip(rows, biases)):
                K[i, : r.shape[0]], M[i, : r.shape[0]] = r, b
        return K, M

    def _pooled_histories(self, states) -> bool:
        """Whether every request's history is pool blocks of the same lanes (the engine's case),
        so that _decode_keys_pooled can read them all with one gather per lane."""
        if type(self).decode_histories is not Attention.decode_histories:      # V4.1: shared history
            return False
        comps = [] if self.compressor is None else [[st.compressor for st in states]]
        if self.indexer is not None:
            comps.append([st.index for st in states])
        return all(isinstance(c.rows, BlockRows) and c.rows.lane is cs[0].rows.lane for cs in comps for c in cs)

    def _decode_keys_pooled(self, window: torch.Tensor, pre, positions, states, rope):
        """_decode_keys with no per-request work once the windows have slid (window [B, W, D]):
        the compressors absorb every row, each lane's blocks are read padded in one gather, HCA
        masks what each query may not see yet, CSA's indexer picks top-k for all at once. The
        same keys and masks as the per-request path, with -inf padding where a request has fewer."""
        zeros = window.new_zeros(window.shape[:2])
        if self.compressor is None:
            return window, zeros
        self.compressor.absorb_many(pre["kv"], pre["gate"], [st.compressor for st in states], rope, views=False)
        entries, lens = padded_rows([st.compressor.rows for st in states])
        pos, n = torch.cat(positions), entries.shape[1]
        if self.indexer is None:                                               # HCA: every closed window
            limit = torch.minimum((pos + 1) // self.ratio, torch.tensor(lens, device=pos.device))
            hidden = torch.arange(n, device=pos.device)[None, :] >= limit[:, None]
            bias = masked_bias(hidden)
            return torch.cat([window, entries], 1), torch.cat([zeros, bias], 1)
        self.indexer.compressor.absorb_many(pre["ikv"], pre["igate"], [st.index for st in states], rope, views=False)
        keys, key_lens = padded_rows([st.index.rows for st in states])
        ids = self.indexer.select_padded(pre["iq"][0], pre["iw"][0], pos, keys, key_lens)        # [B, k], -1 none
        picked = entries.gather(1, ids.clamp(min=0)[..., None].expand(-1, -1, entries.shape[-1]))
        bias = masked_bias(ids < 0)
        return torch.cat([window, picked], 1), torch.cat([zeros, bias], 1)

    def _attend_request(self, q, kv, positions, state: AttentionState, rope, shared, pre) -> torch.Tensor:
        B, T = q.shape[:2]
        record(state, kv)
        prev = state.window if state.window is not None else kv.new_zeros((B, 0, self.head_dim))
        rows = torch.cat([prev, kv], 1)                                      # positions start-len(prev) ..
        first_row = int(positions[0]) - prev.shape[1]
        entries, entry_bias = self.history(pre, positions, state, rope, shared)
        out = torch.cat([self._tile(q[:, i:i + QUERY_TILE], positions[i:i + QUERY_TILE], rows, first_row,
                                     entries, None if entries is None else entry_bias(i, i + QUERY_TILE))
                         for i in range(0, T, QUERY_TILE)], 1)              # [B, T, H, D]
        state.window = rows[:, -(self.window - 1):] if self.window > 1 else rows[:, :0]
        return out

    def project_history(self, x, qr, positions, rope: RotaryTables) -> dict:
        """The token-wise inputs of this layer's history (compressor rows, index queries)."""
        pre = {}
        if self.compressor is not None:
            pre["kv"], pre["gate"] = self.compressor.project(x)
        if self.indexer is not None:
            pre["ikv"], pre["igate"] = self.indexer.compressor.project(x)
            pre["iq"], pre["iw"] = self.indexer.query(x, qr, positions, rope)
        return pre

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryTables):
        """(qr [B, T, q_lora], q [B, T, H, D], kv [B, T, D]): q and the K = V row, RoPE'd at `positions`."""
        B, T, _ = x.shape
        cos, sin = rope.cos_sin(positions, self.table)                       # [T, r/2]
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(B, T, self.n_heads, self.head_dim).float()
        if self.q_head_norm:
            q = rms(q, self.eps)
        q = apply_rope(q, cos[:, None], sin[:, None])
        return qr, q, apply_rope(self.kv_norm(self.wkv(x)).float(), cos, sin)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """softmax with the sink in the denominator: q [B, Tq, H, D], keys [B, S, D], bias [B, Tq, S]."""
        keys = keys[:, None]                                                           # [B, 1, S, D]
        scores = torch.matmul(q.transpose(1, 2), keys.transpose(-1, -2)) * self.head_dim ** -0.5 + bias[:, None]
        sink = self.attn_sink.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), dim=-1)[..., :-1]
        return torch.matmul(probs, keys).transpose(1, 2)                               # [B, Tq, H, D]

    def output(self, out: torch.Tensor, positions: torch.Tensor, rope: RotaryTables, dtype) -> torch.Tensor:
        """Inverse RoPE on the rope dims, then the grouped output projection."""
        cos, sin = rope.cos_sin(positions, self.table)
        return self._project(apply_rope(out, cos[:, None], sin[:, None], inverse=True).to(dtype))

    def history(self, pre: dict, positions, state: AttentionState, rope: RotaryTables, shared):
        """(compressed entries [B, N, D] or None, chosen(i, j) for query rows i..j: a bias over
        every entry [B, j-i, N], or the selected entry ids [B, j-i, k])."""
        if self.compressor is None:
            return None, None
        entries = self.compressor.absorb(pre["kv"], pre["gate"], state.compressor, rope)
        N = entries.shape[1]
        if self.indexer is None:       # HCA: every closed window is visible
            return entries, lambda i, j: visible_bias(positions[i:j], N, self.ratio, entries.shape[0])
        keys = self.indexer.compressor.absorb(pre["ikv"], pre["igate"], state.index, rope)
        return entries, lambda i, j: self.indexer.select_from(pre["iq"][:, i:j], pre["iw"][:, i:j], positions[i:j],
                                                              keys)

    def _slide_full_windows(self, kv: torch.Tensor, states) -> list:
        """For requests whose window is full and in a slot of one lane: the rows their new token
        sees ([1, W, D]: the window, then the token), all gathered and slid in one indexed read
        and write; None for the others (the per-request path in _decode_batch)."""
        W, full, lane = self.window, [], None
        for i, st in enumerate(states):
            w = slot_of(st, "window")
            if W > 1 and w is not None and w.n == W - 1 and (lane is None or w.lane is lane):
                lane = w.lane
                full.append(i)
        seen: list = [None] * len(states)
        if full:
            slots = torch.tensor([slot_of(states[i], "window").slot for i in full], device=lane.device)
            mine = torch.tensor(full, device=kv.device)
            rows = torch.cat([lane[slots, : W - 1].to(kv.dtype), kv[0, mine, None]], 1)   # [F, W, D]
            lane[slots, : W - 1] = rows[:, 1:].to(lane.dtype)
            for j, i in enumerate(full):
                seen[i] = rows[j: j + 1]
        return seen

    def decode_histories(self, pre: dict, positions, states, rope: RotaryTables, shared) -> list:
        """history() of every request in a decode step (one token each, row i of `pre` is
        request i's): the compressors take all rows in one absorb_many; scoring stays per request."""
        if self.compressor is None:
            return [(None, None)] * len(states)
        ents = self.compressor.absorb_many(pre["kv"], pre["gate"], [st.compressor for st in states], rope)
        if self.indexer is None:
            return [(e, lambda i, j, e=e, pos=pos: visible_bias(pos[i:j], e.shape[1], self.ratio, e.shape[0]))
                    for e, pos in zip(ents, positions)]
        keys = self.indexer.compressor.absorb_many(pre["ikv"], pre["igate"], [st.index for st in states], rope)
        ids = self.indexer.select_many(pre["iq"], pre["iw"], positions, keys)
        return [(e, lambda i, j, c=c: c[:, i:j]) for e, c in zip(ents, ids)]

    def _tile(self, q, pos, rows, first_row, entries, chosen) -> torch.Tensor:
        """Attention of one query tile [B, Tq, H, D] over its window rows and compressed entries.
        `chosen` is a bias over all entries [B, Tq, N] (HCA: few entries), or the ids each query
        selected [B, Tq, k] (-1: none), gathered so that the cost is k per query, not N."""
        lo = max(int(pos[0]) - self.window + 1 - first_row, 0)
        hi = int(pos[-1]) + 1 - first_row
        keys = rows[:, lo:hi]                                                  # [B, S, D]
        kpos = torch.arange(lo, hi, device=q.device) + first_row
        delta = pos[:, None] - kpos[None, :]
        bias = masked_bias((delta < 0) | (delta >= self.window))
        bias = bias.expand(q.shape[0], -1, -1)                                # [B, Tq, S]
        if entries is None or not entries.shape[1]:
            return self.attend(q, keys, bias)
        if chosen.is_floating_point():                                          # dense bias over every entry
            return self.attend(q, torch.cat([keys, entries], 1), torch.cat([bias, chosen], -1))
        return self.attend_sparse(q, keys, bias, entries, chosen)

    def attend_sparse(self, q, keys, bias, entries, ids) -> torch.Tensor:
        """One softmax over the window rows and, per query, its selected entries ids [B, Tq, k]."""
        B, Tq, k = ids.shape
        picked = torch.gather(entries, 1, ids.clamp(min=0).reshape(B, -1, 1).expand(-1, -1, entries.shape[-1]))
        picked = picked.view(B, Tq, k, -1)                                     # [B, Tq, k, D]
        scale = self.head_dim ** -0.5
        s_win = torch.einsum("bthd,bsd->bhts", q, keys) * scale + bias[:, None]
        s_sel = torch.einsum("bthd,btkd->bhtk", q, picked) * scale
        s_sel = s_sel.masked_fill((ids < 0)[:, None], float("-inf"))
        sink = self.attn_sink.float().view(1, -1, 1, 1).expand(B, -1, Tq, 1)
        probs = torch.softmax(torch.cat([s_win, s_sel, sink], -1), dim=-1)
        S = keys.shape[1]
        return (torch.einsum("bhts,bsd->bthd", probs[..., :S], keys)
                + torch.einsum("bhtk,btkd->bthd", probs[..., S:S + k], picked))

    def _project(self, o: torch.Tensor) -> torch.Tensor:
        """Grouped output projection: [B, T, H, D] -> o_groups groups -> wo_a per group -> wo_b.
        Under tensor parallelism this rank holds some heads' groups: its wo_b output is a partial
        sum that `reduce` (engine/parallel.py) adds up across ranks."""
        B, T = o.shape[:2]
        g = o.reshape(B, T, self.o_groups, -1)
        w = self.wo_a.weight.view(self.o_groups, -1, g.shape[-1])             # [G, o_lora, H*D/G]
        z = torch.einsum("btgi,goi->btgo", g, w).reshape(B, T, -1)
        out = self.wo_b(z)
        return out if self.reduce is None else self.reduce(out)




def visible_bias(pos: torch.Tensor, n_entries: int, ratio: int, batch: int) -> torch.Tensor:
    """0 where query at `pos` may read entry n (n < (pos + 1) // ratio), -inf elsewhere: [B, Tq, N]."""
    hidden = torch.arange(n_entries, device=pos.device)[None, :] >= ((pos + 1) // ratio)[:, None]
    return masked_bias(hidden).expand(batch, -1, -1)


def core_or_attend(attn: Attention, attend, x: torch.Tensor, inputs, positions, states, rope: RotaryTables,
                   shared=None):
    """The stateful middle of a phased layer (engine/compiled.py) over a flattened batch
    (`positions`/`states`/`shared`: lists, one entry per request, whose tokens sit contiguously in
    x [1, N, d]) or one request's values: (q, attn.core's Attended) for the `inputs` attn_in made,
    or with `attend` (a DSpark stage's own attention over its draft, called per request) (None,
    its projected output)."""
    if not isinstance(positions, list):
        positions, states, shared = [positions], [states], [shared]
    shared = shared if shared is not None else [None] * len(positions)
    if attend is None:
        q, kv, pre = inputs
        return q, attn.core(q, kv, positions, states, rope, shared, pre)
    outs, a = [], 0
    for i, pos in enumerate(positions):
        b = a + len(pos)
        outs.append(attend(x[:, a:b], pos, states[i], rope, shared[i]))
        a = b
    return None, torch.cat(outs, 1)
