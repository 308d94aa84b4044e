"""Drafters: the checkpoint's own draft layers proposing the next tokens of a request.

The contract (what the engine calls after each step, for all its requests at once: the batch
forms take lists of what the single forms take, and a drafter runs each of its layers once per
call over all of them, as the target does):

    context(state, taps, positions, tokens)            context_many([(state, taps, positions, tokens)])
        the target's streams at newly verified positions ({layer: [1, n, hc, d]} for the layers
        in `collect`), those positions [n] and the tokens at them. The drafter keeps what it
        needs in its own state (state.drafter: one window per stage, of verified context only;
        state.draft_carry), all of it a function of the tokens up to the state's length, so a
        tail snapshot of the state holds it for a later hit.
    propose(state, anchor, start, k, sample, greedy)   propose_many([...]) -> [Proposal]
        up to k draft tokens for positions start+1 .. (start: the anchor's position); `sample`
        turns a draft position's logits into (token, q) with the request's sampling parameters
        (verify.draft_token). Proposing leaves the drafter's state as context() left it.

    MTP (V4's mtp.0)   context: the MTP layer over (streams at t, embedding of token t+1), its
                       rows kept, one call late (token t+1 must be verified: the last position's
                       streams wait in draft_carry). Propose runs that pending row with the
                       anchor (draft 1), then chains the layer on its own output streams for
                       drafts 2..k; those rows are dropped after.
    DSpark (V4.1,      context: the target layers' streams, averaged over hc streams, projected
    V4-0731)           into every stage's window (models/dspark.write_context). One draft block
                       [anchor, noise ..] gives dspark_block_size logits; the Markov head adds
                       each position's bias from the token drafted before it, and the confidence
                       head an estimate that the position survives (budget.py schedules on it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcache.engine.layers.hyper import hc_head
from kvcache.engine.models import dspark
from kvcache.engine.speculative.verify import Draft

Sample = Callable[[torch.Tensor, int, list[int]], tuple[int, torch.Tensor]]   # (logits [V], position, drafts so far)


@dataclass(frozen=True)
class Proposal:
    draft: Draft
    confidences: tuple[float, ...] = ()        # DSpark: per draft position


def _stack(qs: list[torch.Tensor], greedy: bool) -> torch.Tensor | None:
    return None if greedy or not qs else torch.stack(qs)


class Drafter:
    """The batch forms, one request at a time: a drafter overrides them to batch its layers."""
    collect: tuple[int, ...] = ()
    max_draft: int = 0

    def context_many(self, items: list) -> None:
        for item in items:
            self.context(*item)

    def propose_many(self, items: list) -> list[Proposal]:
        return [self.propose(*item) for item in items]


class MTPDrafter(Drafter):
    """V4's MTP layer, chained k times (later positions degrade: the layer was trained for one)."""

    name = "mtp"

    def __init__(self, model):
        if not model.mtp or not hasattr(model.mtp[0], "e_proj"):
            raise ValueError("MTP speculation needs the checkpoint's MTP layer (mtp.0 with e_proj/h_proj)")
        self.model = model
        self.collect = (len(model.layers) - 1,)
        self.max_draft = 16

    def _layer(self, streams, ids, positions: list, states: list, logits: bool | list[int] = True):
        """The MTP layer over a flattened batch: streams [1, N, hc, d], ids [1, N] (the token after
        each row's position), positions / states per request -> (output streams, logits [N, V],
        or of the rows listed in `logits`)."""
        layer, m = self.model.mtp[0], self.model
        c = m.config
        h = layer.e_proj(layer.enorm(m.embed(ids))).unsqueeze(2) + layer.h_proj(layer.hnorm(streams))
        h = layer(h, positions, states, m.rope, ids)
        if logits is False or logits == []:
            return h, None
        picked = h if logits is True else h[:, logits]
        hidden = layer.norm(hc_head(picked, layer.hc_head_fn, layer.hc_head_base, layer.hc_head_scale, c.hc_eps,
                                    c.rms_norm_eps))
        return h, m.head(hidden).float()[0]

    def context(self, state, taps: dict, positions: torch.Tensor, tokens: list[int], anchor: int | None = None) -> None:
        self.context_many([(state, taps, positions, tokens, anchor)])

    def context_many(self, items: list) -> None:
        """The layer's row at t needs token t+1: rows are written one call late. The streams at
        each request's last position wait in state.draft_carry (a snapshot keeps them), written
        with the next call's first token; a gap (context that never came, e.g. a hit on an old
        snapshot) drops them. With the anchor (the token after the last position) known, that
        pending row runs in the same call, unkept: its output is the first draft's, kept in the
        carry for propose."""
        rows = []
        for state, taps, positions, tokens, *rest in items:
            anchor = rest[0] if rest else None
            streams = taps[self.collect[0]]
            pending, first = state.draft_carry, int(positions[0])
            if pending is not None and pending["position"] == first - 1:
                streams = torch.cat([pending["streams"].to(streams), streams], 1)
                positions = torch.cat([positions.new_tensor([first - 1]), positions])
                tokens = [-1, *tokens]                  # (the pending position's own token is not needed)
            state.draft_carry = {"streams": streams[:, -1:].clone(), "position": int(positions[-1])}
            if anchor is not None and len(tokens) > 1:  # every row, the pending one last (not kept)
                rows.append((state, streams, [*tokens[1:], anchor], positions, anchor))
            elif len(tokens) > 1:
                rows.append((state, streams[:, :-1], tokens[1:], positions[:-1], None))
        if not rows:
            return
        sts = [r[0].drafter[0] for r in rows]
        before = [None if st.window is None else st.window.clone() for st in sts]
        for st in sts:
            st.journal = []
        ends = torch.tensor([len(r[2]) for r in rows]).cumsum(0).tolist()
        firsts = [e - 1 for e, r in zip(ends, rows) if r[4] is not None]
        try:
            h, logits = self._layer(torch.cat([r[1] for r in rows], 1), torch.tensor([[t for r in rows for t in r[2]]]),
                                    [r[3] for r in rows], sts, logits=firsts)
        finally:
            kvs = [st.journal for st in sts]
            for st in sts:
                st.journal = None
        at = 0
        for (state, _, ids, _, anchor), st, w, kv, end in zip(rows, sts, before, kvs, ends):
            if anchor is None:
                continue
            if len(kv) != 1:
                raise RuntimeError("the MTP layer's window rows were not journaled")
            (rows_kv,) = kv[0]                          # drop the pending row from the window
            kept = rows_kv[:, :-1] if w is None else torch.cat([w.to(rows_kv), rows_kv[:, :-1]], 1)
            st.window = kept[:, -(self.model.config.sliding_window - 1):]
            state.draft_carry["first"] = (h[:, end - 1: end].clone(), logits[at].clone(), anchor,
                                          rows_kv[:, -1:].clone())      # the pending row's own kv
            at += 1

    def propose(self, state, anchor: int, start: int, k: int, sample: Sample, greedy: bool) -> Proposal:
        return self.propose_many([(state, anchor, start, k, sample, greedy)])[0]

    def propose_many(self, items: list) -> list[Proposal]:
        """The pending row with each anchor (draft 1), then the chain, every request's row in one
        layer call per draft position; the windows as they were after."""
        live = [it for it in items if it[3] > 0 and it[0].draft_carry is not None
                and it[0].draft_carry["position"] == it[2] - 1]
        out = {id(it): Proposal(Draft(())) for it in items}
        if not live:
            return [out[id(it)] for it in items]
        sts = [it[0].drafter[0] for it in live]
        windows = [None if st.window is None else st.window.clone() for st in sts]
        dev = live[0][0].draft_carry["streams"].device
        streams = torch.cat([it[0].draft_carry["streams"] for it in live], 1)
        prev = [it[1] for it in live]
        toks, qs = [[] for _ in live], [[] for _ in live]
        ready = all(it[0].draft_carry.get("first", (None,) * 4)[2] == it[1] for it in live)
        try:
            for i in range(max(it[3] for it in live)):
                pos = [torch.tensor([it[2] - 1 + i], device=dev) for it in live]
                if i == 0 and ready:                      # context() ran the pending row already:
                    streams = torch.cat([it[0].draft_carry["first"][0] for it in live], 1)
                    logits = torch.stack([it[0].draft_carry["first"][1] for it in live])
                    for it, st in zip(live, sts):         # the chain sees its row, as it would here
                        row = it[0].draft_carry["first"][3]
                        rows = row if st.window is None else torch.cat([st.window, row.to(st.window)], 1)
                        st.window = rows[:, -(self.model.config.sliding_window - 1):]
                else:
                    streams, logits = self._layer(streams, torch.tensor([prev], device=dev), pos, sts)
                for j, it in enumerate(live):
                    if i < it[3]:
                        tok, q = it[4](logits[j], it[2] + 1 + i, toks[j])
                        toks[j].append(tok)
                        qs[j].append(q)
                        prev[j] = tok
        finally:
            for st, w in zip(sts, windows):
                st.window = w
        for j, it in enumerate(live):
            out[id(it)] = Proposal(Draft(tuple(toks[j]), _stack(qs[j], it[5])))
        return [out[id(it)] for it in items]


class DSparkDrafter(Drafter):
    """V4.1's (and V4-0731's) DSpark block: dspark_block_size drafts from one block forward."""

    name = "dspark"

    def __init__(self, model):
        x = model.config.extra
        if "dspark_block_size" not in x or not model.mtp:
            raise ValueError("DSpark speculation needs a checkpoint with a DSpark drafter (dspark_block_size, mtp.*)")
        self.model = model
        self.collect = tuple(x["dspark_target_layer_ids"])
        self.max_draft = int(x["dspark_block_size"])

    def context(self, state, taps: dict, positions: torch.Tensor, tokens: list[int], anchor: int | None = None) -> None:
        dspark.write_context(self.model, taps, positions, state.drafter)

    def propose(self, state, anchor: int, start: int, k: int, sample: Sample, greedy: bool) -> Proposal:
        return self.propose_many([(state, anchor, start, k, sample, greedy)])[0]

    def propose_many(self, items: list) -> list[Proposal]:
        """Every request's draft block in one pass per stage, then the Markov heads position by
        position over all of them."""
        live = [it for it in items if min(it[3], self.max_draft) > 0]
        out = {id(it): Proposal(Draft(())) for it in items}
        if not live:
            return [out[id(it)] for it in items]
        m = self.model
        dev = m.embed.weight.device
        hidden = dspark.draft_hidden_many(m, [it[1] for it in live], [it[2] for it in live],
                                          [it[0].drafter for it in live])
        prev = torch.tensor([it[1] for it in live], device=dev)
        ks = [min(it[3], self.max_draft) for it in live]
        toks, qs, confs = [[] for _ in live], [[] for _ in live], [[] for _ in live]
        for i in range(max(ks)):
            logits, conf = dspark.heads(m, hidden[:, i], prev)
            nxt = prev.clone()
            for j, it in enumerate(live):
                if i < ks[j]:
                    tok, q = it[4](logits[j], it[2] + 1 + i, toks[j])
                    toks[j].append(tok)
                    qs[j].append(q)
                    confs[j].append(float(conf[j]))
                    nxt[j] = tok
            prev = nxt
        for j, it in enumerate(live):
            out[id(it)] = Proposal(Draft(tuple(toks[j]), _stack(qs[j], it[5])), tuple(confs[j]))
        return [out[id(it)] for it in items]


def make_drafter(model, method: str):
    """The drafter for `method` ("mtp" or "dspark") over the model's own draft layers."""
    if method == "mtp":
        return MTPDrafter(model)
    if method == "dspark":
        return DSparkDrafter(model)
    raise ValueError(f"unknown speculative method {method!r}: use 'mtp' or 'dspark'")
