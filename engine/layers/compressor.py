"""V4 compressors: learned, gated pooling of KV rows into one entry per window of `ratio` tokens.

HCA (ratio m, no overlap): entry w pools tokens [m*w, m*w + m) channel by channel:
    entry_w = norm( sum_j softmax_j(wgate x_j + ape[j mod m]) * wkv x_j ),  RoPE at position m*w

CSA (ratio 4, overlapping): wkv/wgate give 2*d channels per token, Ca = [:d], Cb = [d:];
entry w pools 2m slots: Ca of window w-1 (empty for w = 0) and Cb of window w:

    slots:   [ Ca(4w-4) .. Ca(4w-1) | Cb(4w) .. Cb(4w+3) ]     softmax over the 8 slots, per channel

Tokens of an unfinished window wait in the state's buffer (raw projections); CSA also carries
the Ca half of the last closed window. An entry exists once its window is complete, and query t
may read entry w iff w < (t + 1) // m. The lightning indexer (CSA layers) owns a second CSA
compressor at index_head_dim and scores entries per query to keep the top `index_topk`.
"""

from __future__ import annotations

import torch
from torch import nn

from kvcache.engine.layers.history import DenseRows, SlotField, clone_field, record, slot_of
from kvcache.engine.layers.norm import RMSNorm
from kvcache.engine.layers.rope import RotaryTables, apply_rope


class CompressorState:
    """Per-request state of one compressor (the part of the KV a prefix cache must keep): emitted
    entries (pool blocks or a dense tensor) and the carry of the unfinished window (a pool slot or
    tensors)."""
    buf_kv = SlotField()          # [B, p < m, c*d] raw rows of the unfinished window
    buf_gate = SlotField()        # [B, p, c*d] their gate logits (+ ape)
    overlap_kv = SlotField()      # CSA: Ca rows of the last closed window [B, m, d]
    overlap_gate = SlotField()

    def __init__(self, rows=None, buf_kv=None, buf_gate=None, overlap_kv=None, overlap_gate=None, count=0):
        self.rows, self.count = rows, count
        self.floor = 0            # entries below this index are already stored (bounded replay: not rewritten)
        self.journal: list | None = None          # a speculative step's new rows (history.record)
        self.buf_kv, self.buf_gate, self.overlap_kv, self.overlap_gate = buf_kv, buf_gate, overlap_kv, overlap_gate

    @property
    def entries(self) -> torch.Tensor | None:
        return None if self.rows is None else self.rows.view()

    def clone(self, view=None) -> "CompressorState":
        st = CompressorState(None if self.rows is None else self.rows.clone(None if view is None else view.table),
                             count=self.count)
        st.floor = self.floor
        for name in ("buf_kv", "buf_gate", "overlap_kv", "overlap_gate"):
            setattr(st, name, clone_field(self, name, None if view is None else view.slot_for))
        return st


class Compressor(nn.Module):
    def __init__(self, dim: int, head_dim: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        c = 2 if overlap else 1
        self.ratio, self.overlap, self.head_dim = ratio, overlap, head_dim
        self.wkv = nn.Linear(dim, c * head_dim, bias=False)
        self.wgate = nn.Linear(dim, c * head_dim, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, c * head_dim))
        self.norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, state: CompressorState, rope: RotaryTables) -> torch.Tensor:
        """Feed tokens x [B, T, dim]; returns every entry so far [B, N, d] (state updated)."""
        return self.absorb(*self.project(x), state, rope)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The token-wise part (runs once over a whole batch): raw kv rows and gate logits."""
        return self.wkv(x).float(), self.wgate(x).float()

    def absorb(self, kv: torch.Tensor, gate: torch.Tensor, state: CompressorState, rope: RotaryTables) -> torch.Tensor:
        """One request's projected rows [B, T, c*d] into its state; every entry so far [B, N, d]."""
        m, d = self.ratio, self.head_dim
        record(state, kv, gate)
        if state.buf_kv is not None:
            kv, gate = torch.cat([state.buf_kv, kv], 1), torch.cat([state.buf_gate, gate], 1)
        usable = kv.shape[1] // m * m
        state.buf_kv, state.buf_gate = kv[:, usable:], gate[:, usable:]
        B = kv.shape[0]
        if usable:
            n_w = usable // m
            kv = kv[:, :usable].view(B, n_w, m, -1)
            gate = gate[:, :usable].view(B, n_w, m, -1) + self.ape.float()
            if self.overlap:
                kv, gate = self._overlap(kv, gate, state)
            cos, sin = rope.cos_sin(torch.arange(n_w, device=kv.device) * m + state.count * m, "compress")
            new = self._pool(kv, gate, cos, sin)                                 # [B, n_w, d]
            if state.rows is None:
                state.rows = DenseRows(d, device=kv.device)
            skip = min(n_w, max(0, state.floor - state.count))     # loaded from the cache: keep those
            if skip < n_w:
                state.rows.append(new[:, skip:])
            state.count += n_w
        if state.rows is None:
            state.rows = DenseRows(d, device=kv.device)
        return state.rows.view()

    def _pool(self, kv: torch.Tensor, gate: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Windows [.., n_w, slots, d] (gate logits with ape) -> their entries [.., n_w, d], RoPE'd."""
        return apply_rope(self.norm((kv * torch.softmax(gate, dim=2)).sum(2)), cos, sin)

    def absorb_many(self, kv: torch.Tensor, gate: torch.Tensor, states: list[CompressorState],
                    rope: RotaryTables, views: bool = True) -> list[torch.Tensor] | None:
        """absorb() for a decode step: row i of kv, gate [1, B, c*d] is request i's one new token.
        Rows that leave their window open (m - 1 of every m steps) go into the requests' buffer
        slots with one indexed write per lane; rows that close one are pooled together
        (_close_windows); states without slots in the batch's lanes take absorb().
        Same states and entries as B absorb() calls, which cost two slot rewrites each.
        Returns every state's entries so far, or with views=False nothing (the caller reads the
        states' rows itself, e.g. all requests' blocks in one gather)."""
        fast, closing, slow, lanes = [], [], [], None
        for i, st in enumerate(states):
            a, g = slot_of(st, "buf_kv"), slot_of(st, "buf_gate")
            if (a is not None and g is not None and a.n == g.n
                    and (lanes is None or (a.lane is lanes[0] and g.lane is lanes[1]))):
                lanes = (a.lane, g.lane)
                if a.n + 1 < self.ratio and a.n < a.lane.shape[1]:
                    fast.append(i)
                    continue
                if a.n + 1 == self.ratio and self._closes_in_slots(st, states[closing[0]] if closing else None):
                    closing.append(i)
                    continue
            slow.append(i)
        if closing:
            self._close_windows(kv, gate, [states[i] for i in closing], closing, lanes, rope)
        if fast:
            bufs = [(slot_of(states[i], "buf_kv"), slot_of(states[i], "buf_gate")) for i in fast]
            dev = lanes[0].device
            rows, at = torch.tensor(fast, device=kv.device), torch.tensor([a.n for a, _ in bufs], device=dev)
            lanes[0][torch.tensor([a.slot for a, _ in bufs], device=dev), at] = kv[0, rows].to(lanes[0].dtype)
            lanes[1][torch.tensor([g.slot for _, g in bufs], device=dev), at] = gate[0, rows].to(lanes[1].dtype)
            for (a, g), i in zip(bufs, fast):
                a.n += 1
                g.n += 1
                if states[i].rows is None:
                    states[i].rows = DenseRows(self.head_dim, device=kv.device)
        for i in slow:
            self.absorb(kv[:, i:i + 1], gate[:, i:i + 1], states[i], rope)
        return [st.rows.view() for st in states] if views else None

    def _closes_in_slots(self, st: CompressorState, first: CompressorState | None) -> bool:
        """A closing row can join the batched pooling: its overlap carry (CSA) is slot-backed too,
        in the same lanes as the batch's first closing state."""
        if not self.overlap:
            return True
        ok, og = slot_of(st, "overlap_kv"), slot_of(st, "overlap_gate")
        if not (ok is not None and og is not None and ok.n == og.n
                and ok.n in (0, self.ratio) and ok.lane.shape[1] >= self.ratio):
            return False
        return first is None or (ok.lane is slot_of(first, "overlap_kv").lane
                                 and og.lane is slot_of(first, "overlap_gate").lane)

    def _close_windows(self, kv, gate, states: list[CompressorState], rows_at: list[int], lanes, rope) -> None:
        """absorb() for requests whose new row closes their window, pooled together: the same
        slots, softmax, norm and RoPE as one absorb() each, on a [closing, 1, slots, c*d] batch."""
        m, d = self.ratio, self.head_dim
        bufs = [(slot_of(st, "buf_kv"), slot_of(st, "buf_gate")) for st in states]
        dev = lanes[0].device
        idx = torch.tensor(rows_at, device=kv.device)
        slot_kv = torch.tensor([a.slot for a, _ in bufs], device=dev)
        slot_gate = torch.tensor([g.slot for _, g in bufs], device=dev)
        win_kv = torch.cat([lanes[0][slot_kv, : m - 1].to(kv.dtype), kv[0, idx, None]], 1)[:, None]     # [C, 1, m, c*d]
        win_gate = torch.cat([lanes[1][slot_gate, : m - 1].to(gate.dtype), gate[0, idx, None]], 1)[:, None]
        win_gate = win_gate + self.ape.float()
        if self.overlap:
            win_kv, win_gate = self._overlap_slots(win_kv, win_gate, states)
        cos, sin = rope.cos_sin(torch.tensor([st.count * m for st in states], device=kv.device), "compress")
        new = self._pool(win_kv, win_gate, cos[:, None], sin[:, None])              # [C, 1, d]
        for j, (st, (a, g)) in enumerate(zip(states, bufs)):
            if st.rows is None:
                st.rows = DenseRows(d, device=kv.device)
            if st.floor <= st.count:          # below the floor: the entry was loaded from the cache
                st.rows.append(new[j: j + 1])
            st.count += 1
            a.n = g.n = 0

    def _overlap_slots(self, win_kv, win_gate, states: list[CompressorState]):
        """_overlap for one closing window per state, carries read from and written to their slots."""
        m, d = self.ratio, self.head_dim
        slots_kv, slots_gate = self._slot_layout(win_kv, win_gate)
        carry = [(slot_of(st, "overlap_kv"), slot_of(st, "overlap_gate")) for st in states]
        have = [j for j, (ok, _) in enumerate(carry) if ok.n]
        ok_lane, og_lane = carry[0][0].lane, carry[0][1].lane
        dev = ok_lane.device
        if have:
            h = torch.tensor(have, device=slots_kv.device)
            slots_kv[h, 0, :m] = ok_lane[torch.tensor([carry[j][0].slot for j in have], device=dev), :m].to(
                slots_kv.dtype)
            slots_gate[h, 0, :m] = og_lane[torch.tensor([carry[j][1].slot for j in have], device=dev), :m].to(
                slots_gate.dtype)
        ok_lane[torch.tensor([ok.slot for ok, _ in carry], device=dev), :m] = win_kv[:, -1, :, :d].to(ok_lane.dtype)
        og_lane[torch.tensor([og.slot for _, og in carry], device=dev), :m] = win_gate[:, -1, :, :d].to(og_lane.dtype)
        for ok, og in carry:
            ok.n = og.n = m
        return slots_kv, slots_gate

    def _slot_layout(self, kv: torch.Tensor, gate: torch.Tensor):
        """[B, n_w, m, 2d] -> the 2m slots per window, every slot but the first window's Ca filled
        (that one is the carry of the window before: zero rows and -inf gates until one exists)."""
        B, n_w, m, _ = kv.shape
        d = self.head_dim
        slots_kv = kv.new_zeros((B, n_w, 2 * m, d))
        slots_gate = gate.new_full((B, n_w, 2 * m, d), float("-inf"))
        slots_kv[:, :, m:], slots_gate[:, :, m:] = kv[..., d:], gate[..., d:]
        slots_kv[:, 1:, :m], slots_gate[:, 1:, :m] = kv[:, :-1, :, :d], gate[:, :-1, :, :d]
        return slots_kv, slots_gate

    def _overlap(self, kv: torch.Tensor, gate: torch.Tensor, state: CompressorState):
        """[B, n_w, m, 2d] -> the 2m slots per window: previous window's Ca, this window's Cb."""
        m, d = self.ratio, self.head_dim
        slots_kv, slots_gate = self._slot_layout(kv, gate)
        if state.overlap_kv is not None:
            slots_kv[:, 0, :m], slots_gate[:, 0, :m] = state.overlap_kv, state.overlap_gate
        state.overlap_kv, state.overlap_gate = kv[:, -1, :, :d].clone(), gate[:, -1, :, :d].clone()
        return slots_kv, slots_gate


class Indexer(nn.Module):
    """Lightning indexer: I[t, s] = sum_h w[t, h] * relu(q_I[t, h] . K_I[s]); keeps the top-k per query."""

    def __init__(self, dim: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, ratio: int,
                 eps: float):
        super().__init__()
        self.n_heads, self.head_dim, self.topk, self.ratio = n_heads, head_dim, topk, ratio
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(dim, n_heads, bias=False)
        self.compressor = Compressor(dim, head_dim, ratio, overlap=True, eps=eps)

    def keys(self, x: torch.Tensor, state: CompressorState, rope: RotaryTables) -> torch.Tensor:
        return self.compressor(x, state, rope)

    def select(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
               rope: RotaryTables) -> torch.Tensor:
        """x [B, T, dim], qr [B, T, q_lora], positions [T], keys [B, N, dI] -> top-k ids [B, T, k], -1 = none."""
        return self.select_from(*self.query(x, qr, positions, rope), positions, keys)

    def query(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rope: RotaryTables):
        """Token-wise: (index queries [B, T, H, dI] RoPE'd, head weights [B, T, H])."""
        B, T, _ = x.shape
        q = self.wq_b(qr).float().view(B, T, self.n_heads, self.head_dim)
        cos, sin = rope.cos_sin(positions, "compress")
        return apply_rope(q, cos[:, None], sin[:, None]), self.weights_proj(x).float() * self.n_heads ** -0.5

    def select_from(self, q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor,
                    keys: torch.Tensor) -> torch.Tensor:
        B, T = q.shape[:2]
        N = keys.shape[1]
        scores = torch.relu(torch.einsum("bthd,bnd->bthn", q, keys.float())) * self.head_dim ** -0.5
        index = (scores * w[..., None]).sum(2)                                     # [B, T, N]
        visible = (positions + 1) // self.ratio                                   # [T]
        future = torch.arange(N, device=q.device)[None, :] >= visible[:, None]    # [T, N]
        index = index.masked_fill(future, float("-inf"))
        k = min(self.topk, N)
        if k == 0:
            return torch.full((B, T, 0), -1, dtype=torch.long, device=q.device)
        # a stable sort, not topk: relu scores tie (often at exactly 0), and a query must pick the
        # same entries whether its prompt arrives in one piece or in chunks
        top = torch.sort(index, dim=-1, descending=True, stable=True).indices[..., :k]
        return torch.where(top >= visible[None, :, None], torch.full_like(top, -1), top)

    def select_many(self, q: torch.Tensor, w: torch.Tensor, positions: list[torch.Tensor],
                    keys: list[torch.Tensor]) -> list[torch.Tensor]:
        """select_from for a decode step: request r's one query (row r of q [1, B, H, dI] and
        w [1, B, H]) over its own keys [1, N_r, dI], scored in one padded einsum. The same ids as
        select_from per request: padding scores -inf and sorts after every real entry (stable)."""
        B, lens = len(keys), [k.shape[1] for k in keys]
        K = q.new_zeros((B, max(lens), self.head_dim))
        for r, k in enumerate(keys):
            K[r, : lens[r]] = k[0]
        ids = self.select_padded(q[0], w[0], torch.cat(positions), K, lens)
        return [ids[r, : min(self.topk, lens[r])][None, None] for r in range(B)]

    def select_padded(self, q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                      lens: list[int]) -> torch.Tensor:
        """One query per request (q [B, H, dI], w [B, H] at positions [B]) over its keys, padded
        (keys [B, N, dI], request r's first lens[r] real): top-k ids [B, min(topk, N)], -1 = none
        (not visible yet, or past the request's keys)."""
        limit = torch.minimum((positions + 1) // self.ratio, torch.tensor(lens, device=positions.device))
        return self.select_visible(q, w, limit, keys)

    def select_visible(self, q: torch.Tensor, w: torch.Tensor, limit: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """select_padded with each request's visible key count given (limit [B])."""
        N = keys.shape[1]
        scores = torch.relu(torch.einsum("bhd,bnd->bhn", q, keys)) * self.head_dim ** -0.5
        index = (scores * w[..., None]).sum(1)                                       # [B, N]
        index = index.masked_fill(torch.arange(N, device=index.device)[None, :] >= limit[:, None], float("-inf"))
        top = torch.sort(index, dim=-1, descending=True, stable=True).indices[:, : min(self.topk, N)]
        return torch.where(top >= limit[:, None], torch.full_like(top, -1), top)


