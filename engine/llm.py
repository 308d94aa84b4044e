"""Offline generation: `LLM(model_dir).generate(prompts, SamplingParams(...))`.

    llm = LLM("/models/v4-small")                        # or LLM(model=..., tokenizer=...)
    for (out,) in llm.generate(["Hello", "Tell me"], SamplingParams(max_tokens=32, temperature=0)):
        print(out.text, out.finish_reason, out.metrics.ttft_s)     # one Completion per sample (n)

`llm.engine.requests` holds the last call's requests (and anything still running). The engine's
settings come as `config=` (an EngineConfig: `EngineConfig.load("engine.toml")` reads them from
TOML, configs/engine.toml documents each).
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass

from kvcache.engine.checkpoint.loader import load_model
from kvcache.engine.config import EngineConfig
from kvcache.engine.llm_engine import LLMEngine
from kvcache.engine.cache.prefix_cache import CacheUsage
from kvcache.engine.request import Metrics, Request
from kvcache.engine.sampling import SamplingParams
from kvcache.engine.tokenizer import load_tokenizer


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None
    metrics: Metrics
    usage: CacheUsage | None = None      # what the prefix cache served it (engines with a cache)


def completion(req: Request) -> Completion:
    return Completion(req.request_id, req.prompt, list(req.output), req.text,
                      req.finish_reason.value if req.finish_reason else None, req.error, req.metrics, req.usage)


def load_checkpoint(model_dir: str, device: str = "cpu", progress: bool = False):
    """(model, tokenizer or None) from a checkpoint directory: the model to shard (parallel.shard)
    before an engine is built on it; no tokenizer.json: token-id prompts only (text is refused)."""
    model, _ = load_model(model_dir, device=device, progress=progress)
    has_tokenizer = os.path.exists(os.path.join(model_dir, "tokenizer.json"))
    return model, load_tokenizer(model_dir) if has_tokenizer else None


class LLM:
    def __init__(self, model_dir: str | None = None, *, model=None, tokenizer=None, device: str = "cpu",
                 config: EngineConfig = EngineConfig(), progress: bool = False, store=None):
        if model is None:
            if model_dir is None:
                raise ValueError("give a checkpoint directory or a model")
            model, found = load_checkpoint(model_dir, device, progress)
            tokenizer = tokenizer if tokenizer is not None else found
        self.engine = LLMEngine(model, tokenizer, config, store=store)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 priorities: list[int] | None = None) -> list[list[Completion]]:
        """One list of `n` completions per prompt, in prompt order. Every prompt is checked before
        any is queued: one bad prompt raises ValueError and nothing runs."""
        prompts = _prompt_list(prompts)
        params = SamplingParams() if params is None else params
        plist = params if isinstance(params, list) else [params] * len(prompts)
        priorities = [0] * len(prompts) if priorities is None else priorities
        if len(plist) != len(prompts) or len(priorities) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params and "
                             f"{len(priorities)} priorities: give one each (or one params for all)")
        ids = [self.engine.validate(p, sp) for p, sp in zip(prompts, plist)]
        for rid in [r for r, req in self.engine.requests.items() if req.finished]:   # an earlier call's
            self.engine.requests.pop(rid, None)
        reqs = [self.engine.add_request(i, sp, pr) for i, sp, pr in zip(ids, plist, priorities)]
        while self.engine.has_work():
            self.engine.step()
        return [[completion(r) for r in self.engine.family(req.request_id)] for req in reqs]


def _prompt_list(prompts) -> list:
    """One prompt (text, or token ids: a list, numpy array or tensor) or many, as a list of
    prompts, each text or a list of ints."""
    if hasattr(prompts, "tolist"):                 # numpy array, tensor: [n] is one prompt, [b, n] many
        prompts = prompts.tolist()
    if isinstance(prompts, (str, bytes)):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], numbers.Integral):
        return [prompts]
    return [p.tolist() if hasattr(p, "tolist") else p for p in prompts]
