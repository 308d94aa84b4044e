"""Offline generation: `LLM(model_dir).generate(prompts, SamplingParams(...))`.

    llm = LLM("/models/v4-small")                        # or LLM(model=..., tokenizer=...)
    for out in llm.generate(["Hello", "Tell me"], SamplingParams(max_tokens=32, temperature=0)):
        print(out.text, out.finish_reason, out.metrics.ttft_s)
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.engine.llm_engine import EngineConfig, LLMEngine
from kvcache.engine.request import Metrics, Request
from kvcache.engine.sampling import SamplingParams


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None
    metrics: Metrics


def completion(req: Request) -> Completion:
    return Completion(req.request_id, req.prompt, list(req.output), req.text,
                      req.finish_reason.value if req.finish_reason else None, req.error, req.metrics)


class LLM:
    def __init__(self, model_dir: str | None = None, *, model=None, tokenizer=None, device: str = "cpu",
                 config: EngineConfig = EngineConfig(), progress: bool = False, store=None):
        if model is None:
            from kvcache.engine.checkpoint.loader import load_model
            from kvcache.engine.tokenizer import load_tokenizer
            if model_dir is None:
                raise ValueError("give a checkpoint directory or a model")
            model, _ = load_model(model_dir, device=device, progress=progress)
            tokenizer = tokenizer or load_tokenizer(model_dir)
        self.engine = LLMEngine(model, tokenizer, config, store=store)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] = SamplingParams(),
                 priorities: list[int] | None = None) -> list[list[Completion]]:
        """One list of `n` completions per prompt, in prompt order."""
        if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.engine.add_request(p, sp, (priorities or [0] * len(prompts))[i])
                for i, (p, sp) in enumerate(zip(prompts, plist))]
        while self.engine.has_work():
            self.engine.step()
        out = []
        for req in reqs:
            family = [req] + [self.engine.requests[f"{req.request_id}/{i}"] for i in range(1, req.params.n)
                              if f"{req.request_id}/{i}" in self.engine.requests]
            out.append([completion(r) for r in family])
        return out
