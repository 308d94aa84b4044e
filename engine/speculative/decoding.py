"""Speculative decoding in the engine's step: drafts ride in the decode chunks, one target forward
verifies them all, rollback keeps only what was verified, the drafter drafts the next ones.

    step N-1 end   propose: each running request's drafter drafts after its last token (req.proposal)
    schedule       a decode chunk is [last token] + the proposal's drafts, from what the step
                   leaves (budget, free blocks; `drafts`); DSpark: budget.draft_lengths trims
                   each to what pays this step first
    prepare        rollback.begin on every state whose chunk carries drafts
    forward        model.step_rows: logits of every chunk's anchor and draft rows, the drafter's
                   target streams at every token
    verify         verify.verify per drafted chunk -> accepted drafts + one token of the target's,
                   cut at a stop token or max_tokens; rollback.keep(chunk tokens + kept drafts)
                   (or commit when all were kept); chunk.accepted tells the scheduler
    context        the drafter reads the kept rows' streams (before the scheduler's update)
    after_step     every request still running proposes its next drafts

A chunk without drafts samples as without speculation, from the same logits row: a request the
drafter cannot help (its first token) decodes exactly as it would. Under a constraint the drafts
are drawn and verified through the grammar's masks (guided.py). Drafts never
enter the pool's block keys or the store: those cover computed tokens, and a rejected draft is
never computed as far as the state is concerned.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from kvcache.engine.scheduler import is_stop_token
from kvcache.engine.structured.grammar import GrammarError
from kvcache.engine.speculative import guided, rollback
from kvcache.engine.speculative.budget import StepCost, draft_lengths
from kvcache.engine.speculative.drafters import make_drafter
from kvcache.engine.speculative.verify import Draft, draft_token, verify

log = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """Acceptance per draft position (index 0: the first draft), over the engine's life."""
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    steps: int = 0                       # verify rounds (one per drafted chunk)
    emitted: int = 0                     # tokens those rounds produced (accepted + one each)
    draft_seconds: float = 0.0           # in the drafter: reading its context and proposing
    draft_steps: int = 0                 # engine steps whose requests proposed drafts

    def count(self, verified: int, accepted: int) -> None:
        for i in range(verified):
            if i >= len(self.proposed):
                self.proposed.append(0)
                self.accepted.append(0)
            self.proposed[i] += 1
            self.accepted[i] += int(i < accepted)
        self.steps += 1
        self.emitted += accepted + 1

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens per verify round, the bonus included (1.0: nothing accepted)."""
        return self.emitted / self.steps if self.steps else 0.0

    def rates(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]


class Speculator:
    def __init__(self, model, method: str, num_draft: int, max_tokens_per_step: int, eos_id: int | None):
        if getattr(model, "prefill_keep_tokens", None) is not None:
            raise ValueError("speculative decoding needs every token's row: not with prefill truncation "
                             "(prefill_keep_tokens)")
        self.model, self.drafter = model, make_drafter(model, method)
        default = 3 if method == "mtp" else self.drafter.max_draft
        self.k = min(num_draft or default, self.drafter.max_draft)
        self.adaptive = method == "dspark"
        self.budget, self.eos_id = max_tokens_per_step, eos_id
        self.cost = measure_cost(model, min(max_tokens_per_step, 64)) if self.adaptive else None
        self.stats = SpecStats()
        self._rows: dict[int, torch.Tensor] = {}
        self._checkpoints: dict[int, rollback.Checkpoint] = {}
        self._taps: dict = {}

    # ------------------------------------------------------------------ before the forward
    def drafts(self, chunks, step_tokens: int, step_budget: int) -> list[list[int]]:
        """The scheduler's question, once its chunks are chosen: drafts to run after each decode
        chunk's token (the proposals; DSpark's trimmed to what pays against the step's cost)."""
        drafts = [[] if ch.request.proposal is None else list(ch.request.proposal.draft.tokens[: self.k])
                  for ch in chunks]
        if self.adaptive:
            conf = {i: list(ch.request.proposal.confidences[: len(d)]) for i, (ch, d) in enumerate(zip(chunks, drafts))
                    if d}
            lengths = draft_lengths(conf, self.cost, step_tokens - len(conf), step_budget)
            drafts = [d[: lengths.get(i, 0)] for i, d in enumerate(drafts)]
        return drafts

    def prepare(self, chunks) -> None:
        """Checkpoint every state that runs drafts (a step that never reached verification leaves
        its checkpoints behind: their journals are stopped first)."""
        for cp in self._checkpoints.values():
            rollback.commit(cp)
        self._checkpoints = {id(ch): rollback.begin(ch.request.state) for ch in chunks if ch.drafts}

    def forward(self, chunks, states) -> torch.Tensor:
        """The step's forward: logits [len(chunks), V] of the token after each chunk's committed
        tokens (what plain sampling reads); the draft rows and streams kept for verify/after_step."""
        tokens = [torch.tensor(ch.tokens + ch.drafts, device="cpu") for ch in chunks]
        tails = [1 + len(ch.drafts) for ch in chunks]
        logits, taps = self.model.step_rows(tokens, states, tails, self.drafter.collect)
        logits = logits.cpu()
        self._rows, first, row, flat = {}, [], 0, 0
        self._taps = {}
        keep = max(self.model.config.sliding_window, 1)
        for ch, t in zip(chunks, tails):
            first.append(row)
            if ch.drafts:
                self._rows[id(ch)] = logits[row: row + t]
            n = len(ch.tokens) + len(ch.drafts)
            lo = max(0, n - keep - len(ch.drafts))       # the drafter reads no further back (_context)
            self._taps[id(ch)] = ({k: v[:, flat + lo: flat + n] for k, v in taps.items()}, lo)
            row, flat = row + t, flat + n
        return logits[first]

    # ------------------------------------------------------------------ after the forward
    def verify(self, ch) -> list[int]:
        """The tokens a drafted chunk emits; its state rolled back to what they keep and, under a
        constraint, its guide advanced by exactly them (guided.py)."""
        req, guide = ch.request, ch.request.guide
        rows, drafts = self._rows.pop(id(ch)), list(ch.drafts)
        if guide is not None:
            rows, n = guided.row_masks(guide, rows, drafts)
            drafts = drafts[:n]
        draft = Draft(tuple(drafts), _probs(req.proposal, len(drafts)))
        verdict = verify(rows, draft, req.params, ch.start + len(ch.tokens), req.stream, req.tokens, req.output)
        toks = list(verdict.tokens)
        if guide is not None and guide.done and verdict.accepted == len(drafts):
            toks = toks[:-1]                          # the drafts completed the grammar: it ends there
        for i, tok in enumerate(toks):                 # nothing past a stop token or max_tokens
            if is_stop_token(req, tok, self.eos_id):
                toks = toks[: i + 1]
                break
        toks = toks[: max(1, req.params.max_tokens - len(req.output))]
        ch.accepted = min(verdict.accepted, len(toks) - 1)
        self.stats.count(len(drafts), verdict.accepted)
        if guide is not None:
            self._guide_to(guide, len(drafts), min(verdict.accepted, len(toks)), toks)
        cp = self._checkpoints.pop(id(ch))
        if ch.accepted == len(ch.drafts):
            rollback.commit(cp)
        else:
            rollback.keep(self.model, req.state, cp, ch.tokens + ch.drafts[: ch.accepted])
        return toks

    @staticmethod
    def _guide_to(guide, committed: int, keep: int, toks: list[int]) -> None:
        """The guide holds `committed` drafts tentatively: keep the `keep` the output keeps, take
        back the rest, then commit the output's last token when it is the target's own."""
        guide.rollback(committed - keep)
        if len(toks) > keep:
            problem = guide.commit(toks[keep])
            if problem is not None:                   # (a row masked from this same guide allowed it)
                raise GrammarError(problem)

    def context(self, chunks, forked=(), sampled=None) -> None:
        """Before the scheduler appends the step's tokens (a finishing request's end snapshot
        then holds its drafter's context too): the drafter reads the kept rows of every chunk,
        and a sample forked this step reads its parent's (its state is a copy from before).
        `sampled`: each request's new tokens; the last one, the next anchor, lets MTP compute its
        first draft in the same call."""
        for cp in self._checkpoints.values():         # drafted chunks that never verified (an error)
            rollback.commit(cp)
        self._checkpoints = {}
        kids = {}
        for child in forked:
            kids.setdefault(id(child.parent), []).append(child)
        items = []
        for ch in chunks:
            kept = ch.tokens + ch.drafts[: ch.accepted]
            for req in (ch.request, *kids.get(id(ch.request), ())):
                new = (sampled or {}).get(req.request_id) if req.parent is None or req is ch.request \
                    else req.output[-1:]
                if req.state is not None:
                    items.append((*self._context(req, ch.start, self._taps[id(ch)], kept), new[-1] if new else None))
        t = time.perf_counter()
        self._guarded(self.drafter.context_many, items, "read its context", self._reset_drafter)
        self.stats.draft_seconds += time.perf_counter() - t

    def after_step(self, chunks, forked=()) -> None:
        """After the scheduler's update: every request still running drafts its next tokens."""
        self.propose_all([r for r in [ch.request for ch in chunks if ch.samples] + list(forked)
                          if not r.finished and r.state is not None])
        self._taps = {}

    def _context(self, req, start: int, chunk_taps: tuple, kept: list[int]) -> tuple:
        """What the drafter reads of a chunk: the streams at positions start .. start+len(kept)-1,
        only the last window's worth (W: W - 1 rows and MTP's pending one): the drafter keeps no
        more, and a row is its position's alone. `chunk_taps`: (the chunk's streams from row lo
        on, lo)."""
        n = min(len(kept), max(self.model.config.sliding_window, 1))
        streams, lo = chunk_taps
        taps = {k: v[:, len(kept) - n - lo: len(kept) - lo] for k, v in streams.items()}
        first = start + len(kept) - n
        positions = torch.arange(first, first + n, device=next(iter(taps.values())).device)
        return req.state, taps, positions, kept[len(kept) - n:]

    def propose_all(self, reqs) -> None:
        """Each request's next drafts (req.proposal), the drafter's layers run once for all."""
        items, taken = [], {}
        for req in reqs:
            req.proposal = None
            if req.finished or self.k == 0:
                continue
            taken[id(req)] = []
            items.append((req, (req.state, req.tokens[-1], len(req.tokens) - 1, self.k,
                                self._sampler(req, taken[id(req)]), req.params.greedy)))
        def run(batch):
            try:
                return self.drafter.propose_many([it for _, it in batch])
            finally:
                for req, _ in batch:
                    if req.guide is not None:
                        req.guide.rollback(len(taken[id(req)]))
                        taken[id(req)].clear()
        t = time.perf_counter()
        props = self._guarded(run, items, "draft", lambda item: None)
        self.stats.draft_seconds += time.perf_counter() - t
        self.stats.draft_steps += bool(items)
        for (req, _), prop in zip(items, props):
            if prop is None:
                continue
            if req.guide is not None:     # drafts past the grammar's end (or, from a drafter that
                n = guided.valid_prefix(req.guide, list(prop.draft.tokens))   # ignores `sample`, refused ones)
                prop = prop if n == len(prop.draft.tokens) else _cut(prop, n)
            req.proposal = prop

    def _guarded(self, call, items: list, what: str, on_fail) -> list:
        """call(items) for the batch; where it raises, each item alone, and an item that still
        fails gets on_fail(item) (its request decodes without drafts: the drafter is an
        optimisation, never a request's failure)."""
        if not items:
            return []
        try:
            with torch.no_grad():
                out = call(items)
            return out if out is not None else [None] * len(items)
        except Exception as e:                       # noqa: BLE001 (any drafter error: retried alone)
            log.warning("the drafter failed to %s for %d requests (%s); retrying one by one", what, len(items), e)
        results = []
        for item in items:
            try:
                with torch.no_grad():
                    out = call([item])
                results.append(out[0] if out is not None else None)
            except Exception as e:                   # noqa: BLE001
                log.warning("the drafter failed to %s (%s: %s): that request decodes without drafts for now",
                            what, type(e).__name__, e)
                results.append(on_fail(item))
        return results

    @staticmethod
    def _reset_drafter(item) -> None:
        """A state whose drafter could not read its context starts its drafter's context afresh."""
        state = item[0]
        state.draft_carry = None
        for st in state.drafter:
            st.window = None

    @staticmethod
    def _sampler(req, taken: list[int]):
        """Draft positions' logits -> (token, q) with `req`'s parameters on the drafter's stream;
        under a constraint through the grammar's mask, each draft committed to the guide for the
        next position's mask (`taken`: the caller takes them back)."""
        p, tokens, output, guide = req.params, req.tokens, req.output, req.guide

        def sample(logits, pos, drafts):
            if guide is not None:
                logits = guided.masked(guide, logits)
            tok, q = draft_token(logits, p, pos, req.stream, tokens + drafts, output + drafts)
            if guide is not None and not guide.done and guide.accepts(tok):
                guide.commit(tok)
                taken.append(tok)
            return tok, q
        return sample


def _cut(prop, n: int):
    """The first n drafts of a proposal (a stopping rule on the drafted prefix: lossless)."""
    d = prop.draft
    return dataclasses.replace(prop, draft=Draft(d.tokens[:n], None if d.probs is None else d.probs[:n]),
                               confidences=prop.confidences[:n])


def _probs(proposal, n: int):
    probs = proposal.draft.probs
    return None if probs is None else probs[:n]


def measure_cost(model, most: int) -> StepCost:
    """Seconds a step takes at 1 .. `most` tokens of one request (after a short context), the
    fastest of three runs each, made non-decreasing (noise must not make more tokens look free):
    the DSpark budget's cost model, measured once at start."""
    counts = sorted({1, 2, 4, 8, 16, 32, 64} & set(range(1, most + 1)) | {most})
    seconds = []
    with torch.no_grad():
        base = model.new_state()
        model.step([torch.arange(3, 19)], [base])
        for n in counts:
            best = float("inf")
            for _ in range(3):
                st = base.clone()
                t = time.perf_counter()
                model.step_rows([torch.arange(20, 20 + n)], [st], [n])
                best = min(best, time.perf_counter() - t)
            seconds.append(best)
    for i in range(1, len(seconds)):
        seconds[i] = max(seconds[i], seconds[i - 1])
    return StepCost(tuple(counts), tuple(max(s, 1e-6) for s in seconds))
