"""A pure decode step planned on the host, once for all layers (layers/decode_step.py runs it).

A decode step's per-request bookkeeping is the same for every layer of a kind: the state slot,
the block table, how many rows the window holds, and per compress ratio m whether the new
token closes a window (pos % m == m - 1) and where that entry goes. `plan_decode` checks that
every layer's state agrees with the request's position (every state in the pool's lanes, one
slot, one table) and packs those values into a few device tensors (one host-to-device copy);
`DecodePlan.commit` advances the host-side counts afterwards. A request whose state does not fit
(dense rows, a history write floor above its count, a carry missing in one layer only) makes
the plan None and the step takes the general path (Attention.core).

    host ints per request ─ pack ─> one tensor ─> device ─ views ─> DecodeStep
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcache.engine.layers.history import BlockRows, slot_of
from kvcache.engine.layers.decode_step import DecodeStep, RatioStep

RATIO_FIELDS = ("buf_slot", "buf_row", "closes", "carry", "count", "entry_at", "carry_slot", "visible")
# Block tables are at least this wide (short histories padded with the scratch block, masked): a
# one-block table would specialize a compiled graph on the size 1, and every layer variant would
# compile twice more at start (one block, more blocks) for ~nothing saved at run time.
MIN_BLOCKS = 2


@dataclass
class _Compressors:
    """The compressor states of one request in one step, to advance after it."""
    closing: list = field(default_factory=list)      # (state, buffers, carries)
    open: list = field(default_factory=list)         # buffers


@dataclass
class DecodePlan:
    host: torch.Tensor                               # every per-request value, packed (step_views' layout)
    batch: int                                       # rows (requests, then padding)
    blocks: int                                      # block-table columns
    ratios: tuple[int, ...]
    lanes: list[dict[str, torch.Tensor]]             # per layer: its lanes by name ("window", "entries", ...)
    states: list                                     # the requests' ModelStates
    windows: list                                    # every request's window SlotRows, all layers
    comps: list[_Compressors]
    device: torch.device
    scratch: "_Scratch"
    _step: DecodeStep | None = None

    @property
    def step(self) -> DecodeStep:
        """The step's tensors on the device (one host-to-device copy, made on first use)."""
        if self._step is None:
            self._step = step_views(self.host.to(self.device, non_blocking=True), self.batch, self.blocks, self.ratios)
        return self._step

    def null_host(self) -> torch.Tensor:
        """The same shapes with every row padding: a step run on it writes only the scratch slot
        and block (e.g. to warm a CUDA graph up before capturing it, without touching a request)."""
        rows = {"pos": [], "slots": [], "window_rows": []}
        per_ratio = {m: {f: [] for f in RATIO_FIELDS} for m in self.ratios}
        return _packed(rows, per_ratio, [], self.ratios, self.scratch, self.batch, self.blocks)

    def commit(self) -> None:
        """The step ran: advance the host-side counts (lengths, window rows, buffers, entries, carries)."""
        for st in self.states:
            st.length += 1
        for w in self.windows:
            w.n = min(w.n + 1, w.lane.shape[1])
        for c in self.comps:
            for bufs in c.open:
                for b in bufs:
                    b.n += 1
            for st, bufs, carries in c.closing:
                st.rows.grow(1)
                st.count += 1
                for b in bufs:
                    b.n = 0
                for o in carries:
                    o.n = o.lane.shape[1]


def plan_decode(layers: list, states: list, device, batch: int = 0, blocks: int = 0) -> DecodePlan | None:
    """The plan for one token per request (`layers`: the model layers' Attention modules; `states`: the
    requests' ModelStates at their current length), or None where the general path must run.
    `batch` / `blocks` pad the step to that many rows / block-table columns (a CUDA graph's
    bucket; at least MIN_BLOCKS columns either way): padding reads and writes only the scratch
    block and slot."""
    lanes = _lanes(layers, states[0].layers)
    if lanes is None:
        return None
    ratios = tuple(sorted({a.ratio for a in layers if a.compressor is not None}))
    scratch = _Scratch.of(lanes, layers)
    rows: dict[str, list[int]] = {"pos": [], "slots": [], "window_rows": []}
    per_ratio = {m: {f: [] for f in RATIO_FIELDS} for m in ratios}
    tables, windows, comps = [], [], []
    for st in states:
        req = _request(layers, lanes, st, ratios, per_ratio, scratch)
        if req is None:
            return None
        slot, table, w, c = req
        windows += w
        comps.append(c)
        rows["pos"].append(st.length)
        rows["slots"].append(slot)
        rows["window_rows"].append(w[0].n)       # every layer alike: one sliding_window per model
        tables.append(table)
    if len(set(rows["slots"])) < len(states):
        return None                                    # one request twice: its slot would be written twice
    nb = max(-(-(p + 1) // scratch.block_size) for p in rows["pos"]) if scratch.block_size else 0
    if (batch and len(states) > batch) or (blocks and nb > blocks):
        return None                                    # bigger than the bucket asked for
    B, nb = max(batch, len(states)), max(blocks, nb, MIN_BLOCKS) if scratch.block_size else 0
    host = _packed(rows, per_ratio, tables, ratios, scratch, B, nb)
    return DecodePlan(host, B, nb, ratios, lanes, states, windows, comps, torch.device(device), scratch)


def _packed(rows: dict, per_ratio: dict, tables: list, ratios, scratch: "_Scratch", batch: int,
            blocks: int) -> torch.Tensor:
    """The host tensor step_views reads, the rows past the requests' padding: every write of a
    padding row goes to the scratch slot and block, and it reads nothing but those."""
    for _ in range(batch - len(rows["pos"])):
        for k, v in (("pos", 0), ("slots", scratch.slot), ("window_rows", 0)):
            rows[k].append(v)
        for m in ratios:
            for f, v in zip(RATIO_FIELDS, (scratch.slot, 0, 0, 0, 0, scratch.row(m), scratch.slot, 0)):
                per_ratio[m][f].append(v)
        tables.append([])
    flat = [rows["pos"], rows["slots"], rows["window_rows"]]
    for m in ratios:
        flat += [per_ratio[m][f] for f in RATIO_FIELDS]
    table_ids = [t[j] if j < len(t) else scratch.block for t in tables for j in range(blocks)]
    return torch.tensor([v for row in flat for v in row] + table_ids, dtype=torch.long, device="cpu")


def step_views(packed: torch.Tensor, batch: int, blocks: int, ratios: tuple[int, ...]) -> DecodeStep:
    """A DecodeStep made of views into `packed` (a plan's values on the device): [3 + 8 per ratio,
    batch] per-request rows, then the block tables [batch, blocks] row-major (a transposed
    view would change its strides with batch and blocks, and compiled graphs guard on strides)."""
    n = 3 + len(RATIO_FIELDS) * len(ratios)
    values = packed[: n * batch].view(n, batch)
    steps = {}
    for i, m in enumerate(ratios):
        v = dict(zip(RATIO_FIELDS, values[3 + i * len(RATIO_FIELDS): 3 + (i + 1) * len(RATIO_FIELDS)]))
        v["closes"], v["carry"] = v["closes"] != 0, v["carry"] != 0
        steps[m] = RatioStep(**v)
    table = packed[n * batch: n * batch + batch * blocks].view(batch, blocks)
    return DecodeStep(values[0], values[1], values[2], table, steps)


@dataclass(frozen=True)
class _Scratch:
    """KVPool's scratch slot and block (the last of every lane) and the pool's block geometry."""
    slot: int
    block: int
    block_size: int                 # tokens per block (0: no block lanes)
    per_block: dict[int, int]       # rows per block in a ratio's lanes

    @staticmethod
    def of(lanes, layers) -> "_Scratch":
        pooled = [(a.ratio, ln["entries"]) for a, ln in zip(layers, lanes) if "entries" in ln]
        per_block = {m: lane.shape[1] for m, lane in pooled}
        return _Scratch(lanes[0]["window"].shape[0] - 1, pooled[0][1].shape[0] - 1 if pooled else 0,
                        pooled[0][0] * pooled[0][1].shape[1] if pooled else 0, per_block)

    def row(self, m: int) -> int:
        return self.block * self.per_block[m]


def _lanes(layers, first) -> list[dict] | None:
    """Each layer's lanes, read from the first request's state (the others must use the same)."""
    out = []
    for a, s in zip(layers, first):
        w = slot_of(s, "window")
        if w is None or a.window <= 1:
            return None
        lanes = {"window": w.lane}
        for cs, prefix, kind in ((s.compressor, "", "entries"), (s.index, "i_", "index")):
            if cs is None:
                continue
            if not isinstance(cs.rows, BlockRows):
                return None
            lanes[kind] = cs.rows.lane
            for name in ("buf_kv", "buf_gate", "overlap_kv", "overlap_gate"):
                r = slot_of(cs, name)
                if r is not None:
                    lanes[prefix + name] = r.lane
        out.append(lanes)
    return out


def _request(layers, lanes, st, ratios, per_ratio, scratch: "_Scratch"):
    """(slot, table, window SlotRows, _Compressors) of one request after checking every layer's
    state against its position; appends its per-ratio values; None if anything disagrees."""
    p = st.length
    first = slot_of(st.layers[0], "window")
    if first is None:
        return None
    slot = first.slot
    table, windows, comps, carry = None, [], _Compressors(), {}
    for a, s, ln in zip(layers, st.layers, lanes):
        w = slot_of(s, "window")
        if w is None or w.lane is not ln["window"] or w.slot != slot or w.n != min(p, a.window - 1):
            return None
        windows.append(w)
        for cs, comp, prefix, kind in ((s.compressor, a.compressor, "", "entries"),
                                       (s.index, getattr(a.indexer, "compressor", None), "i_", "index")):
            if cs is None:
                continue
            m = comp.ratio
            rows = cs.rows
            if not isinstance(rows, BlockRows) or rows.lane is not ln.get(kind) or (table is not None
                                                                                   and rows.table is not table):
                return None
            table = rows.table
            bufs = [slot_of(cs, "buf_kv"), slot_of(cs, "buf_gate")]
            carries = [slot_of(cs, "overlap_kv"), slot_of(cs, "overlap_gate")] if comp.overlap else []
            if any(b is None or b.lane is not ln.get(prefix + n) or b.slot != slot
                   for b, n in zip(bufs + carries, ("buf_kv", "buf_gate", "overlap_kv", "overlap_gate"))):
                return None
            if bufs[0].n != p % m or bufs[1].n != p % m or cs.count != p // m or rows.count != cs.count \
                    or cs.floor > cs.count:
                return None
            if carries:
                has = carries[0].n == m
                if carries[0].n != carries[1].n or carries[0].n not in (0, m) or carry.setdefault(m, has) != has:
                    return None
            if p % m == m - 1:
                if (p // m) // rows.per_block >= len(rows.table):
                    return None                     # no block reserved for the entry: the general path says so
                comps.closing.append((cs, bufs, carries))
            else:
                comps.open.append(bufs)
    for m in ratios:
        _ratio_values(per_ratio[m], m, p, slot, table, carry.get(m, False), scratch)
    return slot, table if table is not None else [], windows, comps


def _ratio_values(out: dict, m: int, p: int, slot: int, table: list[int], carry: bool, scratch: _Scratch) -> None:
    per_block = scratch.per_block[m]
    closes = p % m == m - 1
    count = p // m
    out["buf_slot"].append(scratch.slot if closes else slot)
    out["buf_row"].append(0 if closes else p % m)
    out["closes"].append(int(closes))
    out["carry"].append(int(carry))
    out["count"].append(count)
    out["entry_at"].append(table[count // per_block] * per_block + count % per_block if closes else scratch.row(m))
    out["carry_slot"].append(slot if closes else scratch.slot)
    out["visible"].append((p + 1) // m)
