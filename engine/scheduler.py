"""The scheduler: which tokens of which requests run in the next step, under a token budget.

    schedule():
      1. running requests, best first (priority, then arrival): decodes take 1 token (+ lookahead
         slots), unfinished prefills take a chunk of what the budget has left
         └ no block for it? preempt the worst running request (free its blocks, drop its state,
           back to the waiting queue with its arrival order: it recomputes later, never starves)
      2. waiting requests, best first, while budget, `max_running` and blocks last: admit with
         the first chunk of their prompt (chunked prefill)
    update(output, tokens): append sampled tokens, stop, finish, release blocks

Prefill chunks and decode tokens of many requests share one step. Hooks for the cache,
speculative decoding and overlapped steps, without rewriting this loop: Status.WAITING_FOR_KV
requests are skipped until their prefix has loaded (`num_computed` then starts past the cached
tokens); `lookahead` reserves slots for speculative tokens.

Overlapped steps (asynchronous scheduling, engine/overlap.py): `schedule(ahead=N)` plans step
N+1 on a helper thread while step N's forward runs, as if N had already run; `settle` fixes
the plan once N's results are applied.

    schedule(ahead=N)   a request in N continues after it: past its chunk (a prefill), or, if N
                        samples its next token, with a placeholder decode chunk (skipped if that
                        token is its last by max_tokens). Its new blocks wait in the chunk (the
                        forward reads its block table), with room for all of N's drafts kept.
                        Nothing in N is preempted (the forward uses its blocks and state)
    update(N)           N's tokens appended; stops and errors finish requests
    settle(N+1)         placeholders take N's last token and its position; chunks of requests
                        that finished since (a stop token, an abort, an error) are dropped before
                        they run, their blocks given back: a stop seen one step late costs no
                        compute and emits nothing; running requests the plan could not place
                        (samples forked since) and requests that arrived since get what the
                        budget has left, then drafts (they depend on N's tokens)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvcache.engine.block_pool import BlockPool
from kvcache.engine.request import FinishReason, Request, Status

PLACEHOLDER = -1          # a decode chunk's token before the step in flight has sampled it


@dataclass
class Chunk:
    request: Request
    start: int                # absolute position of the first token
    tokens: list[int]
    samples: bool             # the chunk ends at the request's last known token: sample after it
    drafts: list[int] = field(default_factory=list)   # speculative tokens run after `tokens` (verified)
    accepted: int = 0         # how many of the drafts were kept: their KV stays computed
    placeholder: bool = False  # scheduled ahead: its token and start are set by Scheduler.settle
    blocks: list[int] = field(default_factory=list)   # scheduled ahead: blocks settle adds to the request


@dataclass
class SchedulerOutput:
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)


class Scheduler:
    def __init__(self, pool: BlockPool, max_tokens_per_step: int = 512, max_running: int = 64,
                 lookahead: int = 0, reset_state=None, eos_id: int | None = None, cut=None, on_finish=None,
                 drafts=None):
        """`cut(req, start, n) -> n'` may shorten a prefill chunk (e.g. to end on a snapshot point);
        `on_finish(req, reason)` runs before a finishing request lets go of anything (its blocks
        and state still held: the prefix cache saves them); `reset_state(req)` after a request
        lost its state (finished or preempted); `drafts(chunks, step_tokens, step_budget) -> [[token
        ids]]` the speculative tokens to run after each of those decode chunks (engine/speculative)."""
        if max_tokens_per_step < 1 or max_running < 1:
            raise ValueError("max_tokens_per_step and max_running must be >= 1")
        self.pool, self.budget, self.max_running, self.lookahead = pool, max_tokens_per_step, max_running, lookahead
        self.eos_id = eos_id
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._reset_state = reset_state or (lambda req: None)
        self._cut = cut or (lambda req, start, n: n)
        self.on_finish = on_finish or (lambda req, reason: None)
        self._drafts = drafts

    # ------------------------------------------------------------------ queue
    def check_fits(self, prompt: list[int], params) -> None:
        """A ValueError if a request this long could never run, even alone in the pool."""
        if self.pool.blocks_for(len(prompt) + params.max_tokens + self.lookahead) > self.pool.num_blocks:
            raise ValueError(f"the request needs more KV blocks than the whole pool holds ({len(prompt)} prompt + "
                             f"{params.max_tokens} new tokens); shorten it or grow the pool")

    def add(self, req: Request) -> None:
        self.check_fits(req.prompt, req.params)
        req.status = Status.WAITING
        self.waiting.append(req)

    def abort(self, req: Request, reason: FinishReason = FinishReason.ABORT, error: str | None = None) -> None:
        """Finish a request now and give back everything it holds."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, reason)
        req.error = error

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_runnable(self) -> bool:
        """Whether anything could run besides requests whose prefix is still loading."""
        return bool(self.running) or any(r.status is not Status.WAITING_FOR_KV for r in self.waiting)

    def fork(self, child: Request, parent: Request, slot_free: bool) -> list[int] | None:
        """Queue an n > 1 sample forked from `parent` after its prefill. With room in the batch,
        the pool and a free state slot (`slot_free`) it runs at once: it shares the parent's full
        prompt blocks, and the returned fresh blocks are its own for the partial last block (the
        caller copies the parent's KV into them and clones the state). Else it waits and
        recomputes later (None)."""
        full = len(parent.prompt) // self.pool.block_size
        tail = len(parent.block_ids) - full
        if tail > self.pool.num_free() or not slot_free or len(self.running) >= self.max_running:
            self.waiting.append(child)
            return None
        shared = parent.block_ids[:full]
        self.pool.share(shared)
        own = self.pool.allocate(tail)
        child.block_ids, child.num_computed = shared + own, len(parent.prompt)
        child.status = Status.RUNNING
        self.running.append(child)
        return own

    # ------------------------------------------------------------------ one step
    def schedule(self, ahead: SchedulerOutput | None = None, drafts: bool = True,
                 out: SchedulerOutput | None = None) -> SchedulerOutput:
        """The next step's chunks (into `out`, if given). `ahead`: the step whose forward runs
        now, its results not applied yet (see the module's diagram); `drafts=False` leaves
        drafts to `settle`."""
        out = out if out is not None else SchedulerOutput()
        flying = {id(ch.request): ch for ch in ahead.chunks} if ahead is not None else {}
        budget = self._admit(out, self._place_running(out, self.budget, flying))
        if drafts:
            self._add_drafts(out, budget)
        return out

    def _place_running(self, out: SchedulerOutput, budget: int, flying: dict, placed: set = frozenset()) -> int:
        """Running requests, best first (but those `placed` already), each with its next chunk
        while the budget lasts; the budget left."""
        for req in sorted(self.running, key=Request.sort_key):
            if budget <= 0 or req not in self.running or id(req) in placed:
                continue
            ch = self._running_chunk(req, flying.get(id(req)), budget, out, flying)
            if ch is not None:
                out.chunks.append(ch)
                budget -= len(ch.tokens)
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Waiting requests, best first, while budget, `max_running` and blocks last, each with
        the first chunk of what it has to compute; the budget left."""
        for req in sorted(self.waiting, key=Request.sort_key):
            if budget <= 0 or len(self.running) >= self.max_running:
                break
            if req.status is Status.WAITING_FOR_KV or req in out.preempted:
                continue
            n = self._cut(req, req.num_computed, min(req.num_tokens - req.num_computed, budget))
            if not self._admit_blocks(req, n):
                break                                  # FCFS: nothing behind it jumps the queue
            self.waiting.remove(req)
            self.running.append(req)
            req.status = Status.RUNNING
            out.chunks.append(self._chunk(req, req.num_computed, n))
            budget -= n
        return budget

    def _running_chunk(self, req: Request, flight: Chunk | None, budget: int, out: SchedulerOutput,
                       flying: dict) -> Chunk | None:
        """A running request's chunk (None: no blocks for it). `flight`: its chunk in the step
        running now: it continues after that (a placeholder if that one samples)."""
        if flight is not None and flight.samples:
            if len(req.output) + 1 >= req.params.max_tokens:
                return None                            # the token in flight is its last
            base, n = flight.start + len(flight.tokens) + len(flight.drafts), 1    # all drafts kept, at most
            ch = Chunk(req, base, [PLACEHOLDER], True, placeholder=True)
        else:
            base = req.num_computed if flight is None else flight.start + len(flight.tokens)
            n = 1 if base >= len(req.prompt) else self._cut(req, base, min(len(req.prompt) - base, budget))
            ch = self._chunk(req, base, n)
        blocks = self._reserve(req, n, out, flying, base)
        if blocks is None:
            return None
        if flight is None:
            req.block_ids += blocks
        else:
            ch.blocks = blocks
        return ch

    def settle(self, out: SchedulerOutput) -> SchedulerOutput:
        """A plan made ahead, once the step before it is applied: placeholders take their token;
        chunks whose request finished, was preempted or is not where the plan thought (an
        error's re-run that ended elsewhere) are dropped; running requests the plan could not
        place (n > 1 samples forked since, ones it could not preempt for) and requests that
        arrived since get the budget left; drafts added."""
        kept = []
        for ch in out.chunks:
            req, blocks, ch.blocks = ch.request, ch.blocks, []
            if req.status is Status.RUNNING and (ch.start == req.num_computed if not ch.placeholder
                                                 else req.num_computed + 1 == req.num_tokens):
                req.block_ids += blocks
                if ch.placeholder:
                    ch.start, ch.tokens, ch.placeholder = req.num_computed, [req.tokens[-1]], False
                if self._blocks_missing(req, len(ch.tokens)) == 0:
                    kept.append(ch)
            elif blocks:
                self.pool.release(blocks)
        out.chunks = kept
        budget = self._place_running(out, self.budget - out.num_tokens, {}, {id(ch.request) for ch in kept})
        self._add_drafts(out, self._admit(out, budget))
        return out

    def discard(self, out: SchedulerOutput) -> None:
        """A plan made ahead that will not run: the blocks it set aside go back."""
        for ch in out.chunks:
            if ch.blocks:
                self.pool.release(ch.blocks)
            ch.blocks = []

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Speculative tokens from what the step has left: every request got its own tokens first,
        and a draft never preempts anyone (its blocks come only from free ones). Drafts ride only
        in decode chunks that end at their request's last token."""
        chunks = [ch for ch in out.chunks if not ch.request.is_prefill and ch.samples and len(ch.tokens) == 1]
        if self._drafts is None or not chunks or budget <= 0:
            return
        for ch, drafts in zip(chunks, self._drafts(chunks, out.num_tokens, self.budget)):
            req = ch.request
            drafts = drafts[: max(0, min(budget, req.params.max_tokens - len(req.output) - 1))]  # emitted <= drafts + 1
            while drafts and self._blocks_missing(req, 1 + len(drafts)) > self.pool.num_free():
                drafts.pop()
            req.block_ids += self.pool.allocate(self._blocks_missing(req, 1 + len(drafts)))
            ch.drafts = drafts
            budget -= len(drafts)

    def _admit_blocks(self, req: Request, n: int) -> bool:
        """Blocks for a waiting request's first n tokens. Waiting requests ranked after it that
        hold blocks (a cache hit loaded for them) give theirs back first, worst first: else such
        a holder, itself kept waiting by this one, could block the queue for good (the blocks
        keep their content keys, so its next plan finds them in the pool again)."""
        need = self._blocks_missing(req, n)
        holders = sorted((r for r in self.waiting if r.block_ids and r.status is Status.WAITING   # not mid-load
                          and r.sort_key() > req.sort_key()), key=Request.sort_key)
        while need > self.pool.num_free() and holders:
            self._give_back(holders.pop())
        if need > self.pool.num_free():
            return False
        req.block_ids += self.pool.allocate(need)
        return True

    def _chunk(self, req: Request, start: int, n: int) -> Chunk:
        return Chunk(req, start, req.tokens[start: start + n], start + n == req.num_tokens)

    def _blocks_missing(self, req: Request, n: int, base: int | None = None) -> int:
        base = req.num_computed if base is None else base
        return max(0, self.pool.blocks_for(base + n + self.lookahead) - len(req.block_ids))

    def _reserve(self, req: Request, n: int, out: SchedulerOutput, flying: dict, base: int) -> list[int] | None:
        """Blocks for a running request's tokens base .. base+n-1 (None: none to be had),
        preempting the worst others if needed, never one in `flying` (the running step uses its
        blocks and state)."""
        while True:
            need = self._blocks_missing(req, n, base)
            if need <= self.pool.num_free():
                return self.pool.allocate(need)
            victim = max((r for r in self.running if r not in (c.request for c in out.chunks)
                          and id(r) not in flying), key=Request.sort_key, default=None)
            if victim is None:
                return None
            self._preempt(victim, out)
            if victim is req:
                return None

    def preempt(self, req: Request) -> None:
        """Send a running request back to wait: its blocks are released and it recomputes later."""
        self._preempt(req, SchedulerOutput())

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self._give_back(req)
        req.status = Status.WAITING
        req.metrics.preemptions += 1
        self.waiting.append(req)
        out.preempted.append(req)

    def _give_back(self, req: Request) -> None:
        """Release everything `req` holds (blocks, state, its slot via reset_state): it recomputes
        from the start (a cache re-plan may find its blocks in the pool again)."""
        self.pool.release(req.block_ids)
        req.block_ids, req.block_keys, req.num_computed, req.state = [], [], 0, None
        self._reset_state(req)

    # ------------------------------------------------------------------ results
    def update(self, out: SchedulerOutput, sampled: dict[str, int | list[int]], stop_check=None) -> list[Request]:
        """Advance each scheduled request; `sampled` maps request id -> its new token, or tokens
        (a verified draft: chunk.accepted of the drafts stay computed). `stop_check(req) -> bool`
        tests stop strings. Returns the requests that finished."""
        done = []
        for ch in out.chunks:
            req = ch.request
            if req.finished:
                continue
            req.num_computed += len(ch.tokens) + ch.accepted
            req.metrics.tokens_computed += len(ch.tokens) + len(ch.drafts)
            new = sampled.get(req.request_id)
            for tok in [new] if isinstance(new, int) else new or ():
                req.output.append(tok)
                reason = self.stop_reason(req, tok, stop_check)
                if reason is not None:
                    self.running.remove(req)
                    self._finish(req, reason)
                    done.append(req)
                    break
        return done

    def is_stop_token(self, req: Request, tok: int) -> bool:
        return is_stop_token(req, tok, self.eos_id)

    def stop_reason(self, req: Request, tok: int, stop_check=None) -> FinishReason | None:
        """Why `req` stops after sampling `tok` (a stop token, a stop string, max_tokens), or None."""
        p = req.params
        if self.is_stop_token(req, tok):
            return FinishReason.STOP
        if stop_check is not None and stop_check(req):
            return FinishReason.STOP
        if len(req.output) >= p.max_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.on_finish(req, reason)
        if req.block_ids:
            self.pool.release(req.block_ids)
        req.block_ids, req.state = [], None
        self._reset_state(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        req.metrics.finished = time.perf_counter()


def is_stop_token(req: Request, tok: int, eos_id: int | None) -> bool:
    p = req.params
    return tok in p.stop_token_ids or (not p.ignore_eos and tok == eos_id)
