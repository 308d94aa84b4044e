"""The connector in vLLM's scheduler: which blocks a request claims from the store, and which it saves.

Per request (`Tracked`), block counts from the start of the prompt:

    blocks  0 ....... local ....... stored ........ saved ......... full
            │ vLLM's own    │ loaded from  │ already sent   │ computed, │
            │ prefix cache  │ the store    │ to be saved    │ to save   │

    get_num_new_matched_tokens   look up the prompt's full blocks (rank 0's keys; at least one prompt
                                 token is left to compute, for the logits); claim stored - local
                                 blocks, loaded asynchronously
    update_state_after_alloc     the claimed blocks' ids: a load for the next metadata
    build_connector_meta         this step's loads, and saves of every full block whose tokens are
                                 all computed once this step's forward ran (drafts excluded)
    request_finished             its remaining full blocks are saved too; True (hold the blocks)
                                 when saves were sent, until the workers report them copied out

A store that fails or is down is a miss (the seam, `engine/cache/connector.py`, counts and warns);
nothing here raises into vLLM's scheduler. Requests with multimodal inputs are neither looked up
nor saved: their placeholder tokens do not name their content.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvcache.integrations.vllm.metadata import KVCacheMetadata, Transfer
from kvcache.integrations.vllm.naming import BlockNaming, KeyChain, request_salt

log = logging.getLogger(__name__)


@dataclass
class Tracked:
    request: object                 # vLLM's Request (read only)
    chain: KeyChain
    local: int = 0                  # blocks vLLM's own prefix cache had
    stored: int = 0                 # blocks the store holds from the start (looked up)
    saved: int = 0                  # blocks sent to be saved (or known stored)
    load: Transfer | None = None    # claimed, waiting for the next metadata
    loading: bool = False           # a load is in flight: its blocks are not the request's yet
    loaded_ids: list[int] = field(default_factory=list)   # the last load's block ids (from block `local`)
    saves_sent: bool = False
    tiers: list[str] = field(default_factory=list)     # the tier of each stored block, from the start
    answer: tuple | None = None     # (num_computed_tokens asked with, the answer): vLLM asks again each
                                    #   step while the request waits for room; the store is asked once


@dataclass
class SchedulerCounters:
    lookups: int = 0
    hit_tokens: int = 0
    claimed_tokens: int = 0
    saved_blocks: int = 0
    skipped_multimodal: int = 0
    by_tier: dict = field(default_factory=dict)     # claimed blocks per tier label


class SchedulerSide:
    def __init__(self, seam, naming: BlockNaming, *, load: bool, save: bool, block_ids_of):
        """`seam` is the store seam over rank 0's namespace; `block_ids_of(req_id)` gives a
        request's block ids (vLLM's KV cache manager, group 0)."""
        self.seam, self.naming, self.load, self.save = seam, naming, load, save
        self._block_ids_of = block_ids_of
        self._namespaces = naming.namespaces()
        self.bs = naming.block_size
        self.tracked: dict[str, Tracked] = {}
        self._final: list[Transfer] = []            # saves of finished requests, for the next metadata
        self._holds: list[str] = []                 # finished requests vLLM holds blocks of, ditto
        self.counters = SchedulerCounters()

    # ------------------------------------------------------------ lookups
    def _track(self, request) -> Tracked | None:
        if getattr(request, "mm_features", None) or request.prompt_token_ids is None:
            self.counters.skipped_multimodal += 1
            return None
        tr = self.tracked.get(request.request_id)
        if tr is None:
            lora = getattr(getattr(request, "lora_request", None), "lora_name", None)
            chain = KeyChain(self._namespaces, request_salt(getattr(request, "cache_salt", None), lora))
            tr = self.tracked[request.request_id] = Tracked(request, chain)
        return tr

    def matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        tr = self._track(request)
        if tr is None:
            return 0, False
        if tr.answer is not None and tr.answer[0] == num_computed_tokens:
            return tr.answer[1]
        answer = self._match(tr, request, num_computed_tokens)
        tr.answer = (num_computed_tokens, answer)
        return answer

    def _match(self, tr: Tracked, request, num_computed_tokens: int) -> tuple[int, bool]:
        tr.local = num_computed_tokens // self.bs
        if not self.load:
            tr.stored = tr.saved = tr.local
            return 0, False
        n = (request.num_prompt_tokens - 1) // self.bs       # one prompt token stays to compute
        if n <= tr.local:
            tr.stored = tr.saved = max(tr.saved, tr.local)
            return 0, False
        tr.chain.extend(request.prompt_token_ids, n)
        self.counters.lookups += 1
        tiers = self.seam.lookup(tr.chain.keys[0][:n])        # [] when the store fails or is down
        tr.stored, tr.tiers = len(tiers), [str(t) for t in tiers]
        tr.saved = max(tr.saved, tr.stored, tr.local)
        self.counters.hit_tokens += tr.stored * self.bs
        if tr.stored <= tr.local:
            return 0, False
        for t in tiers[tr.local:]:
            self.counters.by_tier[str(t)] = self.counters.by_tier.get(str(t), 0) + 1
        return tr.stored * self.bs - num_computed_tokens, True

    def after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        tr = self.tracked.get(request.request_id)
        if tr is None or num_external_tokens <= 0:
            return
        first = tr.local
        count = num_external_tokens // self.bs
        tr.loading, tr.loaded_ids = True, block_ids[first:first + count]
        tr.load = Transfer(request.request_id, block_ids[first:first + count], tr.chain.slice(first, first + count))
        self.counters.claimed_tokens += count * self.bs

    # ------------------------------------------------------------ each step
    def build(self, out) -> KVCacheMetadata:
        """The metadata of the step `out` (vLLM's SchedulerOutput) describes."""
        # a preempted request's blocks go back to vLLM's pool this step: the workers finish
        # copying out what they are saving before the forward overwrites them
        meta = KVCacheMetadata(preempted=bool(getattr(out, "preempted_req_ids", None)),
                               idle=not getattr(out, "total_num_scheduled_tokens", 1))
        for tr in self.tracked.values():
            if tr.load is not None:
                meta.loads.append(tr.load)
                tr.load = None
        spec = getattr(out, "scheduled_spec_decode_tokens", {}) or {}
        for req_id, n_sched in out.num_scheduled_tokens.items():
            tr = self.tracked.get(req_id)
            if tr is None:
                continue
            tr.answer = None                    # scheduled: after a preemption the store is asked afresh
            if self.save:
                done = tr.request.num_computed_tokens + n_sched - len(spec.get(req_id, ()))
                self._save_upto(tr, done, self._block_ids_of(req_id), meta)
        meta.saves.extend(self._final)
        meta.holds, self._final, self._holds = self._holds, [], []
        return meta

    def _save_upto(self, tr: Tracked, computed: int, block_ids: list[int], meta: KVCacheMetadata) -> None:
        full = min(computed, len(tr.request.all_token_ids)) // self.bs
        full = min(full, len(block_ids))
        if full <= tr.saved:
            return
        tr.chain.extend(tr.request.all_token_ids, full)
        meta.saves.append(Transfer(tr.request.request_id, block_ids[tr.saved:full], tr.chain.slice(tr.saved, full)))
        self.counters.saved_blocks += full - tr.saved
        tr.saved, tr.saves_sent = full, True

    def finished(self, request, block_ids: list[int]) -> bool:
        """Whether vLLM must hold the request's blocks until the workers report them copied out:
        True exactly when the next metadata names the request in `holds` (the workers report
        those, and only those, in finished_sending). Not while a load is in flight: vLLM holds
        those blocks itself until the load is reported, and a preemption before the reload
        already waited for the request's copy-outs."""
        tr = self.tracked.pop(request.request_id, None)
        if tr is None or tr.loading:
            return False
        if self.save:
            meta = KVCacheMetadata()
            self._save_upto(tr, request.num_computed_tokens, block_ids, meta)
            self._final.extend(meta.saves)
        if tr.saves_sent:
            self._holds.append(request.request_id)
        return tr.saves_sent

    def claimed_tiers(self, req_id: str, num_tokens: int) -> dict[str, int]:
        """The claimed tokens of a request by the tier their blocks come from."""
        tr = self.tracked.get(req_id)
        if tr is None:
            return {}
        out: dict[str, int] = {}
        for t in tr.tiers[tr.local: tr.local + num_tokens // self.bs]:
            out[t] = out.get(t, 0) + self.bs
        return out

    def loaded(self, req_ids, invalid_block_ids=()) -> None:
        """The workers finished these requests' loads (vLLM's finished_recving); blocks that
        failed to load are recomputed by vLLM, and saved again from the first of them (the store
        no longer serves them: missing, or quarantined)."""
        for req_id in req_ids or ():
            tr = self.tracked.get(req_id)
            if tr is not None:
                tr.loading = False
        bad = set(invalid_block_ids or ())
        for tr in self.tracked.values() if bad else ():
            failed = [i for i, b in enumerate(tr.loaded_ids) if b in bad]
            if failed:
                tr.saved = tr.stored = min(tr.saved, tr.local + failed[0])
