"""Drafters: the checkpoint's own draft layers proposing the next tokens of a request.

The contract (what the engine calls, per request, after each step):

    context(state, taps, positions, tokens)
        the target's streams at newly verified positions ({layer: [1, n, hc, d]} for the layers
        in `collect`), those positions [n] and the tokens at them. The drafter keeps what it
        needs in its own state (state.drafter: one window per stage, of verified context only;
        state.draft_carry), all of it a function of the tokens up to the state's length, so a
        tail snapshot of the state holds it for a later hit.
    propose(state, anchor, start, k, sample) -> Proposal
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


class MTPDrafter:
    """V4's MTP layer, chained k times (later positions degrade: the layer was trained for one)."""

    name = "mtp"

    def __init__(self, model):
        if not model.mtp or not hasattr(model.mtp[0], "e_proj"):
            raise ValueError("MTP speculation needs the checkpoint's MTP layer (mtp.0 with e_proj/h_proj)")
        self.model = model
        self.collect = (len(model.layers) - 1,)
        self.max_draft = 16

    def _layer(self, streams, next_ids, positions, st):
        layer, m = self.model.mtp[0], self.model
        c = m.config
        h = layer.e_proj(layer.enorm(m.embed(next_ids))).unsqueeze(2) + layer.h_proj(layer.hnorm(streams))
        h = layer(h, positions, st, m.rope, next_ids)
        hidden = layer.norm(hc_head(h, layer.hc_head_fn, layer.hc_head_base, layer.hc_head_scale, c.hc_eps,
                                    c.rms_norm_eps))
        return h, m.head(hidden).float()

    def context(self, state, taps: dict, positions: torch.Tensor, tokens: list[int]) -> None:
        """The layer's row at t needs token t+1: rows are written one call late. The streams at
        the last position wait in state.draft_carry (a snapshot keeps them), written with the
        next call's first token; a gap (context that never came, e.g. a hit on an old snapshot)
        drops them."""
        streams = taps[self.collect[0]]
        pending = state.draft_carry
        first = int(positions[0])
        if pending is not None and pending["position"] == first - 1:
            streams = torch.cat([pending["streams"].to(streams), streams], 1)
            positions = torch.cat([positions.new_tensor([first - 1]), positions])
            tokens = [-1, *tokens]                  # (the pending position's own token is not needed)
        ids = torch.tensor([tokens[1:]], device=streams.device)            # the token after each but the last
        if ids.shape[1]:
            self._layer(streams[:, :-1], ids, positions[:-1], state.drafter[0])
        state.draft_carry = {"streams": streams[:, -1:].clone(), "position": int(positions[-1])}

    def propose(self, state, anchor: int, start: int, k: int, sample: Sample, greedy: bool) -> Proposal:
        pending = state.draft_carry
        if pending is None or k <= 0 or pending["position"] != start - 1:
            return Proposal(Draft(()))
        st = state.drafter[0]
        window = None if st.window is None else st.window.clone()
        streams, dev = pending["streams"], pending["streams"].device
        toks, qs, prev = [], [], anchor
        try:                     # the pending row (next token: the anchor), then the chain: all dropped after
            for i in range(k):
                pos = torch.tensor([start - 1 + i], device=dev)
                streams, out = self._layer(streams, torch.tensor([[prev]], device=dev), pos, st)
                tok, q = sample(out[0, -1], start + 1 + i, toks)
                toks.append(tok)
                qs.append(q)
                prev = tok
        finally:
            st.window = window
        return Proposal(Draft(tuple(toks), _stack(qs, greedy)))


class DSparkDrafter:
    """V4.1's (and V4-0731's) DSpark block: dspark_block_size drafts from one block forward."""

    name = "dspark"

    def __init__(self, model):
        x = model.config.extra
        if "dspark_block_size" not in x or not model.mtp:
            raise ValueError("DSpark speculation needs a checkpoint with a DSpark drafter (dspark_block_size, mtp.*)")
        self.model = model
        self.collect = tuple(x["dspark_target_layer_ids"])
        self.max_draft = int(x["dspark_block_size"])

    def context(self, state, taps: dict, positions: torch.Tensor, tokens: list[int]) -> None:
        dspark.write_context(self.model, taps, positions, state.drafter)

    def propose(self, state, anchor: int, start: int, k: int, sample: Sample, greedy: bool) -> Proposal:
        k = min(k, self.max_draft)
        if k <= 0:
            return Proposal(Draft(()))
        m = self.model
        dev = m.embed.weight.device
        hidden = dspark.draft_hidden(m, torch.tensor([anchor], device=dev), start, state.drafter)
        prev, toks, qs, confs = torch.tensor([anchor], device=dev), [], [], []
        for i in range(k):
            logits, conf = dspark.heads(m, hidden[:, i], prev)
            tok, q = sample(logits[0], start + 1 + i, toks)
            toks.append(tok)
            qs.append(q)
            confs.append(float(conf[0]))
            prev = torch.tensor([tok], device=dev)
        return Proposal(Draft(tuple(toks), _stack(qs, greedy)), tuple(confs))


def make_drafter(model, method: str):
    """The drafter for `method` ("mtp" or "dspark") over the model's own draft layers."""
    if method == "mtp":
        return MTPDrafter(model)
    if method == "dspark":
        return DSparkDrafter(model)
    raise ValueError(f"unknown speculative method {method!r}: use 'mtp' or 'dspark'")
