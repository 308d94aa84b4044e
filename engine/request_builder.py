"""A new request, from a prompt and its sampling parameters: checked, keyed, its constraint compiled.

    prompt (text or ids) ─ prompt_ids ─ check_request (vocabulary, context, sampling) ─ check_fits
        ─ Request: seed fixed, salted chain root, cache points checked, guide compiled,
          prompt block keys hashed once (the pool's keys and the store lookup both read them)

It reads only configuration (the model's, the tokenizer, the namespace, the grammar compiler),
never the engine's queues or pool, so a thread other than the engine's may build requests while
a step runs (AsyncEngine builds them on the event loop).
"""

from __future__ import annotations

from typing import Callable

from kvcache.engine.cache.prefix_cache import CacheUsage
from kvcache.engine.request import Request, check_request, checked_cache_points, prompt_ids
from kvcache.engine.sampling import SamplingParams
from kvcache.engine.structured.guide import Guide
from kvcache.kvstore.hashing import hash_blocks, salted_root


class RequestBuilder:
    def __init__(self, model_config, tokenizer, namespace, grammars, check_fits: Callable, with_usage: bool):
        """`grammars`: the structured-outputs compiler (None without a tokenizer); `check_fits(ids,
        params)`: the scheduler's test that the request could ever run; `with_usage`: a cache is
        configured (requests report what they reused)."""
        self.model_config, self.tokenizer, self.namespace = model_config, tokenizer, namespace
        self.grammars, self.check_fits, self.with_usage = grammars, check_fits, with_usage

    def validate(self, prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or a ValueError saying what is wrong with the request."""
        ids = prompt_ids(prompt, self.tokenizer)
        check_request(ids, params, self.model_config, self.tokenizer)
        self.check_fits(ids, params)
        return ids

    def build(self, prompt, params: SamplingParams, priority: int = 0, request_id: str = "",
              cache_salt: str = "", cache_points=()) -> Request:
        ids = self.validate(prompt, params)
        if "/" in request_id:
            raise ValueError(f"request id {request_id!r} has a '/': it names an n > 1 request's samples (id/1 ...)")
        if not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        req = Request(ids, params.with_seed(), priority, request_id, cache_salt=cache_salt,
                      chain_root=salted_root(self.namespace, cache_salt),
                      cache_points=checked_cache_points(cache_points, len(ids)), guide=self.guide(params))
        req.prompt_keys = hash_blocks(self.namespace, ids, parent=req.chain_root)
        if self.with_usage:
            req.usage = CacheUsage(prompt_tokens=len(ids))
        return req

    def guide(self, params: SamplingParams) -> Guide | None:
        """A new request's constraint state; a GrammarError (a ValueError) if it does not compile."""
        c = params.constraint
        if c is None:
            return None
        if self.grammars is None:
            raise ValueError("structured outputs need the checkpoint's tokenizer (tokenizer.json)")
        think_end = self.tokenizer.token_id("</think>") if c.after_thinking else None
        if c.after_thinking and think_end is None:
            raise ValueError("an after_thinking constraint needs a tokenizer with a </think> token")
        return Guide.for_request(self.grammars.matcher(c), think_end)
