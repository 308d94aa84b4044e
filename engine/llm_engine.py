"""The engine loop: admit requests, run a step, sample, repeat.

    add_request ─ validate (ids, length, sampling) ─ Scheduler.add
    step():  Scheduler.schedule ─> chunks of many requests
             model.step(chunks, states) ─> last-token logits per chunk (one flattened batch)
             sample the chunks that end at a request's last token (seeded per position)
             Scheduler.update ─> outputs; n > 1 samples fork from their parent after its prefill

With async_scheduling the next step is planned on a helper thread while this step's forward
runs (engine/overlap.py); the sampling draws are the same, so are the outputs wherever the
model's numerics do not depend on which requests share a step.

A failing step fails alone: every request of the batch is reset and re-run one by one, and only
the one that fails again is finished with an error; the others continue (they recompute).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from kvcache.client.open_store import open_store
from kvcache.engine.block_pool import BlockPool, PoolExhausted, key_blocks
from kvcache.engine.compiled import compile_layers, generate_on, warm_up as compiled_warmup
from kvcache.engine.cache.block_payload import block_layout, layout_id
from kvcache.engine.cache.connector import KVConnector
from kvcache.engine.config import CacheConfig, EngineConfig
from kvcache.engine.decode_graphs import DecodeGraphs
from kvcache.engine.kv_pool import KVPool
from kvcache.engine.layers.moe import device_experts_pay, stack_experts
from kvcache.engine.cache.prefix_cache import PrefixCache, QueueView, snapshot_cut
from kvcache.engine.speculative.decoding import Speculator
from kvcache.engine.cache.namespace import engine_namespace
from kvcache.engine.detokenizer import Detokenizer
from kvcache.engine.fork import Forker
from kvcache.engine.overlap import PlanAhead
from kvcache.engine.request import FinishReason, Request
from kvcache.engine.request_builder import RequestBuilder
from kvcache.engine.sampling import SamplingParams, sample
from kvcache.engine.scheduler import Chunk, Scheduler, SchedulerOutput
from kvcache.engine.cache.weights_id import weights_id
from kvcache.engine.structured.batch_masks import BatchMasks
from kvcache.engine.structured.compiler import engine_compiler
from kvcache.engine.structured.grammar import GrammarError

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    request: Request
    new_tokens: list[int]
    finished: bool


@dataclass
class _Applied:
    """What applying a step left for its outputs."""
    before: dict[str, int]            # request id -> its output length before the step
    finished: set[int]                # id() of the requests the step finished
    forked: list[Request]             # n > 1 samples forked this step
    failed: list[StepOutput]          # requests that failed alone


class LLMEngine:
    def __init__(self, model, tokenizer=None, config: EngineConfig = EngineConfig(), store=None):
        """`store`: an open block store (BlockStore or KVClient) to use instead of opening
        `config.cache.store`; the engine does not close a store it was given."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        mc = model.config
        ratios = [r for r in mc.compress_ratios if r > 0]
        if any(config.block_size % r for r in ratios):
            raise ValueError(f"block_size {config.block_size} must be a multiple of every compress ratio "
                             f"{sorted(set(ratios))}")
        compile_layers(model, config.compile)
        # stack_experts refuses expert parallelism (device_experts=True under --ep) with a ValueError
        stack_experts(model, device_experts_pay(model) if config.device_experts is None else config.device_experts)
        on_cpu = next(iter(model.parameters())).device.type == "cpu"
        planned = config.planned_decode
        if planned is None:             # what compiled steps and CUDA graphs replay; eager CPU: the faster general path
            planned = config.compile or config.cuda_graphs or not on_cpu
        model.planned_decode = planned
        self.decode_graphs = None
        if config.cuda_graphs:
            if not planned:
                raise ValueError("cuda_graphs replays planned decode steps: set planned_decode = true")
            self.decode_graphs = DecodeGraphs(model, config.block_size, config.max_running, config.num_blocks)
        self.pool = BlockPool(config.num_blocks, config.block_size, config.pool_eviction)
        self.kv = KVPool(model, config.num_blocks, config.block_size, slots=2 * config.max_running)
        # exact mode keys its blocks apart: a replay-mode engine's blocks after a bounded replay are
        # approximate, and an exact engine sharing the store would resume from them, not bit for bit
        exact = config.cache is not None and config.cache.mode == "exact"
        self.namespace = engine_namespace(mc, config.block_size, layout_id(self.kv) + ("/exact" if exact else ""),
                                          weights_id(model, config.cache))
        self.spec = (Speculator(model, config.speculative, config.num_draft, config.max_tokens_per_step,
                                mc.eos_token_id) if config.speculative else None)
        self.scheduler = Scheduler(self.pool, config.max_tokens_per_step, config.max_running, eos_id=mc.eos_token_id,
                                   reset_state=self._drop_state, on_finish=self._on_finish,
                                   cut=snapshot_cut(config.cache) if config.cache is not None else None,
                                   drafts=self.spec.drafts if self.spec is not None else None)
        self.detokenizer = Detokenizer(tokenizer, self.scheduler.is_stop_token)
        self.grammars = engine_compiler(tokenizer, mc)     # structured outputs (None: no tokenizer)
        self.masks = BatchMasks(self.grammars, mc.vocab_size) if self.grammars is not None else None
        self.forker = Forker(self.scheduler, self.kv, config.block_size, self._view, self._stops,
                             lambda req: self.requests.__setitem__(req.request_id, req))
        self.builder = RequestBuilder(mc, tokenizer, self.namespace, self.grammars, self.scheduler.check_fits,
                                      config.cache is not None)
        self.requests: dict[str, Request] = {}
        self.logits_hook = None    # (request, position, logits) after each sampling chunk: for numerics checks
        self.cache = self._open_cache(config.cache, store)
        overlap = config.async_scheduling if config.async_scheduling is not None else not on_cpu
        self.ahead = PlanAhead(self.scheduler) if overlap else None
        if config.compile and config.compile_warmup:
            self._warm_up_compiled()

    def _warm_up_compiled(self) -> None:
        """Run compiled_warmup's requests on a scratch engine (same model, no cache, its own small
        pool): the compiled graphs it leaves behind serve this engine's steps."""
        # no CUDA graphs: this engine captures its own, on its own pool
        cfg = dataclasses.replace(self.config, cache=None, compile_warmup=False, num_blocks=16, max_running=4,
                                  cuda_graphs=False, async_scheduling=False)
        t = time.perf_counter()
        scratch = LLMEngine(self.model, None, cfg)
        compiled_warmup(generate_on(scratch), self.config.block_size, self.model.config.vocab_size)
        log.info("compiled layers ready in %.1f s", time.perf_counter() - t)

    def _open_cache(self, cfg: CacheConfig | None, store) -> PrefixCache | None:
        if cfg is None:
            return None
        self._own_store = store is None and bool(cfg.store)
        if self._own_store:
            store = open_store(cfg.store, **({"token": cfg.token} if cfg.token else {}))
        conn = KVConnector(store, self.namespace, block_layout(self.kv), cfg) if store is not None else None
        queues = QueueView(lambda: self.scheduler.waiting, self.scheduler.has_runnable)
        return PrefixCache(self.pool, self.kv, self.model, self.namespace, conn, cfg, queues)

    def reset_prefix_cache(self) -> None:
        """The operator's reset, under vLLM's name: forget the prefixes this engine keeps for reuse
        (idle pool blocks, snapshots in memory; the store keeps its copies), so later requests find
        them only in the store, as after a restart of the engine. Nothing to do without a cache."""
        if self.cache is not None:
            self.cache.reset()

    def close(self) -> None:
        """Wait for the cache's pending saves and close a store the engine opened."""
        if self.ahead is not None:
            self.ahead.close()
        if self.grammars is not None:
            self.masks.close()
            self.grammars.close()
        conn = self.cache.connector if self.cache is not None else None
        if conn is not None:
            conn.close()
            if self._own_store:
                conn.store.close()

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt, params: SamplingParams, priority: int = 0, request_id: str = "",
                    cache_salt: str = "", cache_points=()) -> Request:
        """Validate and queue a prompt (text needs a tokenizer, or token ids); returns the request
        (for n > 1 the parent: its children appear in `self.requests` after its prefill, as
        `<id>/1` ... `<id>/<n-1>`). A params object without a seed gets a fresh one per request.

        `cache_salt` keys the request's blocks apart: requests with different salts never share a
        prefix (a tenant's, or a sharing group's, own); "" is today's keys. `cache_points` are
        prompt positions (0 < p < len(prompt)) where, in exact mode, a prefill chunk ends and a
        snapshot is saved, so a later prompt that continues the first p tokens resumes at p (a
        chat's: just after its last assistant tag, where the next turn's rendering diverges)."""
        return self.add(self.new_request(prompt, params, priority, request_id, cache_salt, cache_points))

    def new_request(self, prompt, params: SamplingParams, priority: int = 0, request_id: str = "",
                    cache_salt: str = "", cache_points=()) -> Request:
        """add_request's request, validated and keyed but not queued (`add` queues it); any
        thread may build one while a step runs (engine/request_builder.py)."""
        return self.builder.build(prompt, params, priority, request_id, cache_salt, cache_points)

    def add(self, req: Request) -> Request:
        """Queue a request from new_request (a ValueError if its id is in use)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        return req

    def validate(self, prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or a ValueError saying what is wrong with the request: nothing
        is queued (LLM.generate checks a whole batch before it queues any of it)."""
        return self.builder.validate(prompt, params)

    def family(self, request_id: str) -> list[Request]:
        """A request and, for n > 1, its forked samples (those that exist yet: forks happen when the
        parent samples its first token)."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        kids = (self.requests.get(f"{request_id}/{i}") for i in range(1, req.params.n))
        return [req] + [k for k in kids if k is not None]

    def forget(self, request_id: str) -> None:
        """Drop a finished request (and its finished samples) from `self.requests`: a long-lived
        engine would otherwise keep every request it ever served."""
        for req in self.family(request_id):
            if req.finished:
                del self.requests[req.request_id]

    def abort(self, request_id: str) -> None:
        """Abort a request and everything it holds; a parent's abort takes its n > 1 samples with
        it (one sample alone: abort `<id>/<i>`). Unknown or finished ids: nothing to do."""
        for req in self.family(request_id):
            if not req.finished:
                self.scheduler.abort(req)
        if self.ahead is not None and not self.scheduler.has_work():
            self.ahead.discard()             # nothing left to run the plan for: its blocks go back

    def fail_all(self, error: str) -> list[StepOutput]:
        """Finish every unfinished request with this error (their blocks freed), one final output
        each: after a step that raised outside any one request."""
        if self.ahead is not None:
            self.ahead.discard()
        live = [r for r in self.requests.values() if not r.finished]
        for r in live:
            self.scheduler.abort(r, FinishReason.ERROR, error=error)
        return [StepOutput(r, [], True) for r in live]

    def has_work(self) -> bool:
        return self.scheduler.has_work() or (self.ahead is not None and self.ahead.pending)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[StepOutput]:
        if self.cache is not None:
            self.cache.poll()          # start lookups and loads; requests whose blocks arrived become runnable
        if self.ahead is None:
            out = self.scheduler.schedule()
        else:                          # the plan made during the last forward, or one now
            plan = self.ahead.take()
            out = self.scheduler.settle(plan) if plan is not None else self.scheduler.schedule()
        if not out.chunks:
            return []
        t0 = time.perf_counter()
        masks = self._prepare(out.chunks)
        try:
            logits = self._run(out.chunks, plan_ahead=self.ahead is not None)
        except Exception as e:      # isolate: re-run each request alone, fail only the culprit
            if self.ahead is not None:
                self.ahead.discard()   # planned for a batch that did not run
            log.warning("a batched step failed (%s); re-running its %d requests one by one", e, len(out.chunks))
            return self._isolate(out)
        if self.ahead is not None:
            self.ahead.finish()        # an error in planning is the engine's, not a request's: it raises
        results = self._emit(out, self._apply(out, logits, masks, t0))
        if self.ahead is not None and not self.scheduler.has_work():
            self.ahead.discard()       # everything finished: the plan's placeholders go
        return results

    def _run(self, chunks: list[Chunk], plan_ahead: bool = False) -> torch.Tensor:
        states = self._states(chunks)
        if plan_ahead:
            self.ahead.start(SchedulerOutput(chunks))      # the next plan, while this forward runs
        try:
            return self._forward(chunks, states)
        finally:
            if plan_ahead:
                self.ahead.wait()

    def _prepare(self, chunks: list[Chunk]):
        """Before a forward: rollback checkpoints for drafts; the grammar masks start filling."""
        if self.spec is not None:
            self.spec.prepare(chunks)
        return self.masks.start(chunks) if self.masks is not None else None   # filled during the forward

    def _states(self, chunks: list[Chunk]) -> list:
        """Each chunk's request state, built on first use (a slot taken, a cache hit resumed)."""
        states = []
        for ch in chunks:
            req = ch.request
            if req.state is None:
                view = self._view(req)
                req.state = self.cache.state_for(req, view) if req.resume is not None else self.model.new_state(view)
            states.append(req.state)
        return states

    def _forward(self, chunks: list[Chunk], states: list) -> torch.Tensor:
        """The model's step over the chunks: logits of each chunk's last token, on the host
        (sampling runs there: one copy a step, the same draws on any device)."""
        tokens = [torch.tensor(ch.tokens, device="cpu") for ch in chunks]
        with torch.no_grad():
            if self.spec is not None:
                return self.spec.forward(chunks, states)
            if self.decode_graphs is not None:
                logits = self.decode_graphs.logits(tokens, states)
                if logits is not None:
                    return logits.cpu()
            return self.model.step(tokens, states).cpu()

    def _view(self, req: Request):
        """The request's pool view, taking it a slot for its windows and carry."""
        if req.slot is None:
            req.slot = self.kv.acquire_slot()
            if req.slot is None:
                raise RuntimeError("no free state slot (more running requests than slots)")
        return self.kv.view(req.block_ids, req.slot)

    def _drop_state(self, req: Request) -> None:
        """The scheduler finished or preempted `req`: its slot goes back to the pool."""
        req.proposal = None
        if req.slot is not None:
            self.kv.release_slot(req.slot)
            req.slot = None
        if self.cache is not None:
            self.cache.forget(req)

    def _on_finish(self, req: Request, reason: FinishReason) -> None:
        """A request is finishing, its blocks and state still held: the cache saves them."""
        if self.cache is not None:
            self.cache.on_finish(req, reason)

    def _apply(self, out: SchedulerOutput, logits: torch.Tensor, masks, started: float) -> _Applied:
        """A step's results: sample (or verify drafts), fork n > 1 samples, key completed blocks,
        advance the scheduler (stops finish requests), let the cache save and the drafter draft."""
        sampled, forked, failed, now = {}, [], [], time.perf_counter()
        for i, ch in enumerate(out.chunks):
            req = ch.request
            if not ch.samples or req.finished:
                continue
            pos = ch.start + len(ch.tokens)
            if self.logits_hook is not None:
                self.logits_hook(req, pos, logits[i])
            try:
                problem = masks.apply(i, logits[i]) if masks is not None else None   # before bias and penalties
                if problem is None and ch.drafts:
                    toks = self.spec.verify(ch)          # accepted drafts + one (its guide advanced by them)
                elif problem is None:
                    toks = [sample(logits[i], req.params, pos, req.stream, req.tokens, req.output)]
            except (FloatingPointError, GrammarError) as e:   # its logits (NaN), its matcher: it fails alone
                problem = f"{type(e).__name__}: {e}"
            if problem is None and req.metrics.first_token is None:
                req.metrics.first_token = now
                if req.params.n > 1 and req.parent is None:
                    forked += self.forker.fork(req, logits[i], pos)        # each sample forks the grammar first
            if problem is None and req.guide is not None and not ch.drafts:    # (verify committed its own)
                problem = req.guide.commit(toks[0])
            if problem is not None:                  # it fails alone
                log.error("request %s failed: %s", req.request_id, problem)
                self.scheduler.abort(req, FinishReason.ERROR, error=problem)
                failed.append(StepOutput(req, [], True))
                continue
            sampled[req.request_id] = toks
        before = {ch.request.request_id: len(ch.request.output) for ch in out.chunks}
        for ch in out.chunks:                        # key the blocks this step completes (before any release)
            key_blocks(self.pool, self.namespace, ch.request, ch.start + len(ch.tokens) + ch.accepted,
                       ch.drafts[: ch.accepted])
        if self.spec is not None:                    # the drafter reads what was kept (then drafts)
            self.spec.context(out.chunks, forked, sampled)
        finished = set(id(r) for r in self.scheduler.update(out, sampled, self._stops))
        if self.spec is not None:
            self.spec.after_step(out.chunks, forked)
        if self.cache is not None:
            self.cache.after_step(out.chunks, time.perf_counter() - started)
        return _Applied(before, finished, forked, failed)

    def _emit(self, out: SchedulerOutput, done: _Applied) -> list[StepOutput]:
        """A step's outputs, their texts decoded."""
        results = []
        for ch in out.chunks:
            req = ch.request
            new = req.output[done.before[req.request_id]:]
            if new or id(req) in done.finished:
                self.detokenizer.update(req)
                results.append(StepOutput(req, new, req.finished))
        for child in done.forked:                    # their first token, sampled at the fork
            self.detokenizer.update(child)
            results.append(StepOutput(child, list(child.output), child.finished))
        return results + done.failed

    def _stops(self, req: Request) -> bool:
        """Besides stop tokens and max_tokens: its grammar complete at this token (nothing but EOS
        could follow, whatever ignore_eos), or a stop string ended its text."""
        g = req.guide
        return (g is not None and g.done and g.seen == len(req.output)) or self.detokenizer.stop_string(req)

    def _isolate(self, out: SchedulerOutput) -> list[StepOutput]:
        results = []
        for ch in out.chunks:
            req = ch.request
            req.state, req.num_computed = None, 0           # the failed batch may have advanced it
            self._drop_state(req)
            if any(self.pool.blocks[b].ref_count > 1 for b in req.block_ids):
                try:                     # shared blocks (a prefix hit, n > 1): never rewrite them
                    own = self.pool.allocate(len(req.block_ids))
                except PoolExhausted:    # no room for its own copy now: it recomputes later
                    self.scheduler.preempt(req)
                    continue
                self.pool.release(req.block_ids)
                req.block_ids, req.block_keys = own, []
            chunk = Chunk(req, 0, req.tokens[: ch.start + len(ch.tokens)], ch.samples)
            try:                         # its forward pass and what follows it, for this request alone
                masks = self.masks.start([chunk]) if self.masks is not None else None
                one = SchedulerOutput([chunk])
                started = time.perf_counter()
                results += self._emit(one, self._apply(one, self._run([chunk]), masks, started))
            except Exception as e:
                log.error("request %s failed: %s", req.request_id, e)
                self.scheduler.abort(req, FinishReason.ERROR, error=f"{type(e).__name__}: {e}")
                results.append(StepOutput(req, [], True))
        return results

    def check_idle(self) -> None:
        """The pool's invariant, and nothing held when nothing runs."""
        self.pool.check()
        if not self.has_work() and self.pool.counts()["used"]:
            raise AssertionError(f"idle engine still holds blocks: {self.pool.counts()}")
        if not self.has_work() and self.kv.free_slots != 2 * self.config.max_running:
            raise AssertionError(f"idle engine still holds state slots ({self.kv.free_slots} free)")

