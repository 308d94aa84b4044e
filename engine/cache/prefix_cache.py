"""Prefix hits, engine side: the pool's own blocks first (the HBM tier), then the block store
through the connector. A request waits (WAITING_FOR_KV) while its blocks load; others keep running.

    a waiting request, first seen ─ plan():
        keys of its prompt's full blocks, hashed once when it was added (`Request.prompt_keys`;
        at least one prompt token is always left to compute)
        hbm   = the longest run of those keys still held by the BlockPool
        store = tiers of the rest (connector.lookup), cut where loading costs more than recomputing
        exact : end at the longest block boundary with a tail snapshot (engine memory, then store;
                `TailSnapshots`, tail_snapshots.py), or inside a block where an earlier request
                ended or had a cache point
        replay: load the whole hit, then recompute its last `replay_blocks` blocks from an empty
                window and carry, keeping their stored history rows (a write floor): bounded
                replay; only windows and carry are approximate
      ─ share the hbm blocks at once; fetch the rest in the loader thread ─ WAITING_FOR_KV
    each step, before scheduling ─ poll(): decode fetched payloads into fresh pool blocks (a failed
        block ends the hit there and its tokens are recomputed), note how to build the state
        (snapshot or boundary), set num_computed; the scheduler then admits it like any other
    after each step ─ after_step(): new full blocks (encoded now, stored in the background) and,
        in exact mode, a tail snapshot whenever a prefill chunk ended on a snapshot point (every
        `snapshot_interval` tokens, and the request's own cache points: mid-block, the partial
        block's rows with it)
    a request finishing ─ on_finish(): its last full blocks and, in exact mode, an end snapshot
        (mid-block: the partial block's rows with it, those past its end zeroed), where the next
        chat turn resumes

Requests whose prefix another request is loading wait for that load and then hit the pool, so a
prefix shared by concurrent requests is fetched once.

The cache is built from its collaborators (the block pool, the KV tensors, the model, the
namespace, the connector, the config) and a read-only view of the scheduler's queues
(`QueueView`); it never holds the engine. It changes a request's status and blocks, never a
queue: the scheduler admits a request whose load is done like any other.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kvcache.engine.cache import snapshot
from kvcache.engine.cache.block_payload import decode_blocks, encode_block
from kvcache.engine.cache.connector import KVConnector
from kvcache.engine.cache.tail_snapshots import Boundary, TailSnapshots
from kvcache.engine.config import CacheConfig
from kvcache.engine.block_pool import BlockPool
from kvcache.engine.kv_pool import KVPool
from kvcache.engine.request import FinishReason, Request, Status
from kvcache.kvstore.hashing import Namespace
from kvcache.kvstore.types import TierName

log = logging.getLogger(__name__)


@dataclass
class CacheUsage:
    """What the cache did for one request (feeds reports and the API's usage fields)."""
    prompt_tokens: int = 0
    cached_tokens: dict[TierName, int] = field(default_factory=dict)   # prompt tokens whose KV came from a tier
    replayed_tokens: int = 0      # recomputed to rebuild windows and carry (replay mode)
    bytes_loaded: int = 0
    load_s: float = 0.0
    failed_blocks: int = 0        # planned hits that failed to load (recomputed)

    @property
    def total_cached(self) -> int:
        return sum(self.cached_tokens.values())


@dataclass
class Resume:
    """How to build a request's state when it first runs after a hit."""
    length: int                   # where computing resumes
    loaded: int = 0               # replay: history rows present up to here (the write floor)
    snapshot: dict | None = None  # exact mode; None: bounded replay from `length`


@dataclass(frozen=True)
class QueueView:
    """What the prefix cache reads of the scheduler (it never edits the queues)."""
    waiting: Callable[[], Sequence[Request]]     # the waiting queue, in no particular order
    has_runnable: Callable[[], bool]             # anything to run besides requests still loading


@dataclass
class _Hit:
    """What a finished load gives a request: its leading `blocks` keyed blocks and, in exact
    mode after an end snapshot, the pool block holding that snapshot's partial block."""
    blocks: int = 0
    resume: Resume | None = None
    tail: int | None = None


@dataclass
class _Plan:
    req: Request
    keys: list[bytes]             # every block key of the hit (hbm + store)
    tiers: list[TierName]
    hbm: int                      # leading blocks shared from the pool
    hit: int                      # blocks found (hbm + store) before the cost model and the boundary
    use: int                      # blocks the request will hold when loaded
    snap_mem: bytes | None = None
    end: int = 0                  # exact mode, an earlier request's end or cache point inside block `use`
    future: object = None
    started: float = field(default_factory=time.perf_counter)


class PrefixCache:
    def __init__(self, pool: BlockPool, kv: KVPool, model, namespace: Namespace, connector: KVConnector | None,
                 config: CacheConfig, queues: QueueView):
        """`model` builds and restores request states (fresh ones, from snapshots, at a block
        boundary); `connector` is None for an engine whose cache is its own pool only."""
        self.pool, self.kv, self.model, self.namespace = pool, kv, model, namespace
        self.connector, self.config, self.queues = connector, config, queues
        self.bs = pool.block_size
        window = max(1, getattr(model.config, "sliding_window", 0) or 1)
        self.replay_blocks = config.replay_blocks or max(1, -(-4 * window // self.bs))
        if config.mode == "exact" and config.snapshot_interval % self.bs:
            raise ValueError(f"cache.snapshot_interval {config.snapshot_interval} must be a multiple of the "
                             f"block size {self.bs}")
        self.plans: dict[str, _Plan] = {}
        self.inflight: set[bytes] = set()
        self.snapshots = TailSnapshots(namespace, connector, model, self.bs, config.snapshot_memory_bytes)
        self.prefill_s_per_token: float | None = None

    # ------------------------------------------------------------ before scheduling
    def poll(self) -> None:
        for plan in [p for p in self.plans.values() if p.future is None or p.future.done()]:
            self._apply(plan)
        for req in list(self.queues.waiting()):
            if not req.cache_planned and req.num_computed == 0 and not req.block_ids and req.parent is None:
                self._plan(req)
        if self.plans and not self.queues.has_runnable():
            first = next(iter(self.plans.values()))      # nothing else to run: wait for a load
            if first.future is not None:
                first.future.result()
                self._apply(first)

    def _plan(self, req: Request) -> None:
        pool, n_full = self.pool, (len(req.prompt) - 1) // self.bs
        req.usage.prompt_tokens = len(req.prompt)
        req.usage.cached_tokens = {}                     # a re-plan (after a preemption) reports its own hit
        keys = req.prompt_keys[:n_full]
        pool.begin(keys)                                 # an order that learns from requests sees it
        hbm = 0
        while hbm < len(keys) and pool.lookup(keys[hbm]) is not None:
            hbm += 1
        if hbm < len(keys) and keys[hbm] in self.inflight:
            req.status = Status.WAITING_FOR_KV           # another request is loading it: hit the pool after
            return
        req.cache_planned = True
        tiers = [TierName.HBM] * hbm + (self.connector.lookup(keys[hbm:]) if self.connector and hbm < len(keys) else [])
        k = self._worth_loading(tiers)
        use, snap_mem, snap_store, end = self._boundary(req, keys, tiers, k)
        if use <= 0 and not end:
            return
        plan = _Plan(req, keys[:use], tiers[:use], min(hbm, use), len(tiers), use, snap_mem, end)
        shared = [pool.lookup(key) for key in keys[: plan.hbm]]
        pool.share(shared)
        req.block_ids = shared
        fetch = keys[plan.hbm: use]
        if fetch or snap_store:
            plan.future = self.connector.fetch(fetch, tiers[plan.hbm: use], snap_store)
            self.inflight.update(fetch)
        req.status = Status.WAITING_FOR_KV
        self.plans[req.request_id] = plan

    def _worth_loading(self, tiers: list[TierName]) -> int:
        """How many leading hit blocks to use: all, unless loading some costs more than recomputing."""
        spt = self.prefill_s_per_token
        if not self.config.cost_model or spt is None or self.connector is None:
            return len(tiers)
        best, best_gain = 0, 0.0
        for k in range(1, len(tiers) + 1):
            gain = k * self.bs * spt - self.connector.load_seconds(tiers[:k])
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def _boundary(self, req, keys, tiers, k: int) -> Boundary:
        """(blocks to use, snapshot bytes from memory, snapshot key in the store, end) for a hit of
        k blocks; end > 0 when an earlier request ended, or had a cache point, inside block k
        (exact mode resumes there)."""
        if self.config.mode == "replay":
            return self._replay_boundary(k)
        return self.snapshots.boundary(req, keys, k)

    def _replay_boundary(self, k: int) -> tuple[int, None, None, int]:
        """Replay mode loads the whole hit, or nothing when it is no longer than the blocks it
        would recompute anyway (`replay_blocks`). No snapshot: windows and carry are rebuilt."""
        return (k if k > self.replay_blocks else 0), None, None, 0

    def _apply(self, plan: _Plan) -> None:
        """A load finished (or needed none): give the request its blocks and resume point."""
        del self.plans[plan.req.request_id]
        req = plan.req
        fetched, snap, nbytes, dt = plan.future.result() if plan.future is not None else ([], None, 0, 0.0)
        self.inflight.difference_update(plan.keys[plan.hbm:])
        if req.finished:
            return
        loaded = self._decode_fetched(plan, fetched)
        held = plan.hbm + len(loaded)
        u = req.usage
        u.failed_blocks, u.bytes_loaded, u.load_s = len(fetched) - len(loaded), nbytes, dt
        if self.config.mode == "exact":
            hit = self._exact_hit(plan, held, plan.snap_mem or snap)
        else:
            hit = self._replay_hit(held)
        self._hold(plan, req.block_ids + loaded, hit)

    def _decode_fetched(self, plan: _Plan, fetched: list) -> list[int]:
        """Fresh pool blocks holding the fetched payloads, keyed, up to the first that failed (or
        did not fit, or found no free block): the hit ends there."""
        pool = self.pool
        kv_bytes = self.connector.block_bytes if self.connector is not None else 0
        bids = pool.allocate(min(len(fetched), pool.num_free()))
        ok = next((i for i, p in enumerate(fetched[: len(bids)]) if p is None or memoryview(p).nbytes != kv_bytes),
                  len(bids))
        decode_blocks(self.kv, bids[:ok], fetched[:ok])
        pool.release(bids[ok:])
        for key, bid in zip(plan.keys[plan.hbm: plan.hbm + ok], bids[:ok]):
            pool.set_key(bid, key)
        return bids[:ok]

    def _exact_hit(self, plan: _Plan, held: int, snap) -> _Hit:
        """Exact mode: every planned block held and a snapshot that fits this model where the hit
        ends, so the request resumes bit for bit (its output equals a cold run's); anything less
        is no hit at all (recompute from the start), never an approximate resume."""
        if held < plan.use or snap is None:
            return _Hit()
        state = self.snapshots.fitting(snap, plan.end or held * self.bs)
        if state is None:
            return _Hit()                                # not a snapshot of this model here: a miss
        if not plan.end:
            return _Hit(held, Resume(held * self.bs, held * self.bs, state))
        tail = self._partial_block(state)                # a snapshot inside the next block: its rows
        if tail is None:
            return _Hit()
        return _Hit(held, Resume(plan.end, plan.end, state), tail)

    def _replay_hit(self, held: int) -> _Hit:
        """Replay mode: keep every block held and recompute the last `replay_blocks` of them from
        an empty window and carry, writing no history row below the loaded ones (the write
        floor): loaded rows stay exact, windows and carry are approximate, the replay bounded."""
        if held <= self.replay_blocks:
            return _Hit()
        return _Hit(held, Resume((held - self.replay_blocks) * self.bs, held * self.bs))

    def _hold(self, plan: _Plan, bids: list[int], hit: _Hit) -> None:
        """The request keeps the hit's blocks (the rest go back) and becomes schedulable."""
        req, u = plan.req, plan.req.usage
        if hit.tail is not None:
            bids = bids + [hit.tail]
        use = hit.blocks + (hit.tail is not None)
        self.pool.release(bids[use:])
        req.block_ids, req.block_keys = bids[:use], list(plan.keys[:hit.blocks])
        req.saved_blocks = len(req.block_keys)
        req.resume = r = hit.resume
        req.num_computed = r.length if r else 0
        u.replayed_tokens = r.loaded - r.length if r else 0
        for tier in plan.tiers[: len(req.block_keys)]:
            u.cached_tokens[tier] = u.cached_tokens.get(tier, 0) + self.bs
        if hit.tail is not None:                         # the tail came with the snapshot
            tier = TierName.HBM if plan.snap_mem else (plan.tiers[-1] if plan.tiers else TierName.DRAM)
            u.cached_tokens[tier] = u.cached_tokens.get(tier, 0) + plan.end - len(req.block_keys) * self.bs
        req.status = Status.WAITING

    def _partial_block(self, snap: dict) -> int | None:
        """A pool block holding the end snapshot's partial block rows (None: no block free, or
        rows that do not fit this pool's blocks: a store's bytes are input, a miss, never a
        failed step)."""
        pool = self.pool
        partial = snap.get("partial")
        if not isinstance(partial, torch.Tensor) or not pool.num_free():
            return None
        [bid] = pool.allocate(1)
        try:
            decode_blocks(self.kv, [bid], [partial.contiguous().numpy().tobytes()])
        except (ValueError, TypeError, RuntimeError) as e:
            log.warning("end snapshot's partial block does not fit the pool (%s): a miss", e)
            pool.release([bid])
            return None
        return bid

    def state_for(self, req: Request, view):
        """The first state of a request that resumes after a hit."""
        r = req.resume
        if r.snapshot is not None:
            return snapshot.restore(self.model, view, r.snapshot)
        return snapshot.at_boundary(self.model, view, r.length, r.loaded, self.bs, req.prompt)

    # ------------------------------------------------------------ after a step
    def after_step(self, chunks, seconds: float) -> None:
        prefill = sum(len(c.tokens) for c in chunks if len(c.tokens) > 1)
        if prefill:
            spt = seconds / sum(len(c.tokens) for c in chunks)
            p = self.prefill_s_per_token
            self.prefill_s_per_token = spt if p is None else 0.7 * p + 0.3 * spt
        if not self.config.save:
            return
        for ch in chunks:
            req = ch.request
            if req.state is None:
                continue
            self._save_blocks(req)
            end = ch.start + len(ch.tokens)
            if self.config.mode == "exact" and end <= len(req.prompt) and req.state.length == end \
                    and (end % self.config.snapshot_interval == 0 or end in req.cache_points):
                self._save_tail(req)

    def on_finish(self, req: Request, reason) -> None:
        """A request is finishing (its blocks and state still held): save its last full blocks
        and, in exact mode, a snapshot of where it ended, so a follow-up prompt (the next chat
        turn) resumes exactly there."""
        if not self.config.save or req.state is None or reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return
        self._save_blocks(req)
        if self.config.mode == "exact" and req.state.length < len(req.tokens):
            self._save_tail(req)

    def _save_tail(self, req: Request) -> None:
        """A tail snapshot of where `req` is now (exact mode): at a block boundary, keyed by the
        block there; inside a block (a request's end, a cache point), keyed by the blocks and the
        tokens before it, with the rows its tokens wrote in the partial block (the rest zeros:
        the pool block may hold an earlier request's rows there, perhaps another tenant's)."""
        L = req.state.length
        k = L // self.bs
        if len(req.block_keys) < k:
            return
        if L % self.bs == 0:
            if k:
                self.snapshots.save_at_block(req.block_keys[k - 1], req.state)
            return
        snap = snapshot.capture(req.state)
        partial = encode_block(self.kv, req.block_ids[k], L - k * self.bs)    # only the rows its tokens wrote
        snap["partial"] = torch.frombuffer(bytearray(partial), dtype=torch.uint8)
        self.snapshots.remember(self.snapshots.end_key(req, req.block_keys, req.tokens, L), snapshot.encode(snap))

    def _save_blocks(self, req: Request) -> None:
        new = range(req.saved_blocks, len(req.block_keys))
        if self.connector is not None and len(new):
            kv = self.kv
            self.connector.save([(req.block_keys[i], encode_block(kv, req.block_ids[i])) for i in new])
        req.saved_blocks = len(req.block_keys)

    def reset(self) -> None:
        """Forget the prefixes the engine keeps for reuse: idle pool blocks lose their keys (blocks a
        request holds keep theirs) and the snapshots in engine memory go; the store keeps its copies.
        Later requests find their prefixes only in the store, as after a restart of the engine."""
        self.pool.forget_cached()
        self.snapshots.clear()

    def forget(self, req: Request) -> None:
        """The request lost its state (preempted, failed): plan again when it is next admitted."""
        req.cache_planned, req.resume, req.saved_blocks = False, None, 0


def snapshot_cut(config: CacheConfig):
    """The scheduler's `cut` for exact mode with saving: a prefill chunk ends at the next
    snapshot point, a multiple of `snapshot_interval` or one of the request's cache points (then
    it gets a snapshot); None for every other cache (chunks stay whole, cache points ignored:
    replay mode resumes at whole blocks only)."""
    if config.mode != "exact" or not config.save:
        return None
    step = config.snapshot_interval

    def cut(req: Request, start: int, n: int) -> int:
        points = req.cache_points
        i = bisect.bisect_right(points, start)
        ends = [p for p in ((start // step + 1) * step, points[i] if i < len(points) else None)
                if p is not None and start < p < start + n and p < len(req.prompt)]
        return min(ends) - start if ends else n
    return cut

