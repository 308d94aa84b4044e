"""n > 1: a request's other samples, forked from it when it samples its first token.

    parent's prefill ─ logits of its last prompt token ─┬─ parent samples token 0 (stream 0)
                                                        └─ sample i samples its own (stream i)
    sample i: the parent's full prompt blocks shared, its own copy of the partial last block,
              the parent's state cloned, the parent's grammar forked; or, without room in the
              batch, the pool or the slots, it waits and recomputes its prompt later

Samples keep the parent's place in the queue (its arrival), ahead of requests that came after.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from kvcache.engine.request import FinishReason, Request
from kvcache.engine.sampling import sample


class Forker:
    def __init__(self, scheduler, kv, block_size: int, view: Callable, stops: Callable, register: Callable):
        """`view(req)`: a request's pool view (taking it a slot); `stops(req)`: the engine's stop
        test beyond stop tokens and max_tokens; `register(req)`: the engine now knows the sample."""
        self.scheduler, self.kv, self.block_size = scheduler, kv, block_size
        self.view, self.stops, self.register = view, stops, register

    def fork(self, parent: Request, logits: torch.Tensor, pos: int) -> list[Request]:
        """The parent's samples 1 .. n-1, each with its first token sampled from `logits`."""
        full = len(parent.prompt) // self.block_size
        children = []
        for i in range(1, parent.params.n):
            child = Request(list(parent.prompt), parent.params, parent.priority, f"{parent.request_id}/{i}",
                            stream=i, parent=parent, arrival_seq=parent.arrival_seq, prompt_keys=parent.prompt_keys,
                            cache_salt=parent.cache_salt, chain_root=parent.chain_root,
                            cache_points=parent.cache_points)
            children.append(child)
            child.output.append(sample(logits, child.params, pos, i, child.tokens, child.output))
            if parent.guide is not None:             # the parent's grammar before its own token
                child.guide = parent.guide.fork()
                problem = child.guide.commit(child.output[-1])
                if problem is not None:
                    self.scheduler.abort(child, FinishReason.ERROR, error=problem)
                    continue
            child.metrics.arrival, child.metrics.first_token = parent.metrics.arrival, parent.metrics.first_token
            if parent.usage is not None:            # its prompt came the parent's way (a hit or not)
                child.usage = dataclasses.replace(parent.usage, cached_tokens=dict(parent.usage.cached_tokens))
            self.register(child)
            own = self.scheduler.fork(child, parent, slot_free=bool(self.kv.free_slots))
            if own is not None:                                         # it runs now (else: recomputes later)
                self.kv.copy_blocks(parent.block_ids[full:], own)      # its own copy of the partial block
                child.state = parent.state.clone(self.view(child))
            reason = self.scheduler.stop_reason(child, child.output[-1], self.stops)
            if reason is not None:                                      # a stop, or max_tokens 1
                self.scheduler.abort(child, reason)
        return children
