"""`kvcache bench serve` / `python -m kvcache.benchmarks.serve`: the model server under a
multi-turn workload over HTTP, with the cache, without it, and transformers serve, on the same
weights in the same run.

    workload      sessions of the Mooncake conversation trace, arrival times and prefix
                  structure kept, token counts scaled (benchmarks/serve_workload.py)
    cache_on      kvcache serve --model CKPT, exact-mode cache (a snapshot every 512 tokens)
    cache_off     the same with [cache] enabled = false
    transformers  transformers serve on a transformers-format copy of CKPT (same weights),
                  --continuous-batching; where it refuses the model (a probe request fails),
                  the reason is recorded and it serves with sequential generate instead
    clients       at most --clients requests in flight, each session's turns in order
                  (benchmarks/serve_client.py), streamed through /v1/completions: ours get the
                  token ids (exact by construction), transformers the text, which its tokenizer
                  is checked to encode to the same ids

    serve_ttft_p50_cache_vs_off       TTFT p50 cache_on / cache_off         target <= 0.3
    serve_throughput_vs_transformers  requests/s cache_on / transformers    target >= 3
    serve_errors                      failed requests of cache_on + off     target 0
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time

from kvcache.benchmarks import verbs
from kvcache.benchmarks import serve_servers as servers
from kvcache.benchmarks.serve_client import Target, replay, request_once
from kvcache.benchmarks.serve_report import format_table, notes, outcome_rows, ratios, summarize
from kvcache.benchmarks.serve_workload import Turn, WorkloadShape, build_workload, prompt_text, read_trace, word_ids



def engine_settings(model_config, shape: WorkloadShape, clients: int) -> dict:
    """[engine] for both kvcache scenarios: blocks of the largest compress ratio, a pool that holds
    every request in flight twice over, the default step budget, as many running as clients."""
    block = max(r for r in model_config.compress_ratios if r > 0)
    per_request = -(-(shape.max_prompt_tokens + shape.max_output_tokens) // block) + 1
    return {"block_size": block, "num_blocks": max(512, 2 * clients * per_request), "max_tokens_per_step": 512,
            "max_running": clients}


def cache_settings(block: int, snapshot_interval: int) -> dict:
    """[cache] of cache_on: exact mode, a snapshot every snapshot_interval tokens (rounded up to
    whole blocks). A hit is only as long as the last snapshot in it, and each snapshot ends a
    prefill chunk: 512, the server's default and its step budget, costs no extra steps; one per
    16-token block (v4-tiny) made a 700-token cold prefill 44 steps, ~20x the time of 2 on two
    loaded cores."""
    return {"enabled": True, "mode": "exact", "snapshot_interval": block * -(-snapshot_interval // block)}


# Random weights put most of the argmax on ids past the demo tokenizer (v4-small: 4,096 logits,
# a few hundred tokens), which decode to no text: a stream would show its first text late or
# never. Both servers add WORD_BIAS to the workload's words (complete text each), so greedy picks
# among them and every token streams as text (TTFT is the first token's); at most OpenAI's 300
WORD_BIAS, MAX_BIASED = 100, 300


def ours_body(words: list[int]):
    bias = {str(w): WORD_BIAS for w in words[:MAX_BIASED]}

    def body(turn: Turn) -> dict:
        return {"model": "bench", "prompt": turn.prompt_ids, "max_tokens": turn.max_tokens, "temperature": 0,
                "ignore_eos": True, "logit_bias": bias, "stream": True, "stream_options": {"include_usage": True}}
    return body


def transformers_body(copy: str, texts: dict, words: list[int]):
    bias = [[[w], float(WORD_BIAS)] for w in words[:MAX_BIASED]]

    def body(turn: Turn) -> dict:
        n = turn.max_tokens        # its own generation config: greedy, exactly n tokens (no EOS stop)
        config = {"do_sample": False, "max_new_tokens": n, "min_new_tokens": n, "sequence_bias": bias}
        return {"model": copy, "prompt": texts[(turn.session, turn.index)], "max_tokens": n, "temperature": 0,
                "stream": True, "generation_config": json.dumps(config)}
    return body


class Run:
    """One benchmark run: the workload, the scenarios' servers one after another, their outcomes."""

    def __init__(self, checkpoint: str, tokenizer, workload, engine: dict, clients: int, deadline_s: float,
                 root: str, bar, env: dict[str, str]):
        self.checkpoint, self.tokenizer, self.workload, self.engine = checkpoint, tokenizer, workload, engine
        self.clients, self.deadline_s, self.root, self.bar, self.env = clients, deadline_s, root, bar, env
        self.words = word_ids(tokenizer)
        self.warm_up = Turn(-1, 0, 0.0, [tokenizer.bos_id] + self.words[:8], 4, 0)

    def measure(self, server: servers.Server, target: Target) -> dict:
        self.bar.set_postfix_str(server.name)
        warm = request_once(target, self.warm_up)       # untimed: first-request costs out of the run
        outcomes, wall = replay(target, self.workload, self.clients, self.deadline_s, lambda o: self.bar.update(1))
        return {"server": {"argv": server.argv, "settings": server.settings}, "warm_up_error": warm.error,
                "summary": summarize(outcomes, wall), "requests": outcome_rows(outcomes)}

    def kvcache(self, name: str, cache: dict) -> dict:
        with contextlib.ExitStack() as cleanup:
            server = servers.start_kvcache(cleanup, self.root, name, self.checkpoint, self.engine, cache, self.env)
            return self.measure(server, Target(name, server.url, ours_body(self.words)))

    def transformers(self, mode: str) -> dict:
        why = servers.serve_available()
        if why is not None:
            return {"skipped": why}
        if self._model_type() != "deepseek_v4":
            return {"skipped": "transformers has no DeepSeek-V4.1 model: (c) needs a V4 config"}
        copy = servers.transformers_copy(self.checkpoint, os.path.join(self.root, "transformers-copy"))
        tok = servers.transformers_tokenizer(copy)
        texts = {(t.session, t.index): prompt_text(t, self.tokenizer, self.tokenizer.decode([self.tokenizer.bos_id]))
                 for t in self.workload.turns + [self.warm_up]}
        alike = sum(tok(texts[(t.session, t.index)])["input_ids"] == t.prompt_ids for t in self.workload.turns)
        body, refused = transformers_body(copy, texts, self.words), None
        for cb in ((True, False) if mode == "auto" else (mode == "cb",)):
            with contextlib.ExitStack() as cleanup:
                server = servers.start_transformers(cleanup, self.root, copy, cb, self.env)
                target = Target(server.name, server.url, body)
                probe = request_once(target, self.warm_up)
                if probe.error is not None and cb and mode == "auto":
                    refused = f"{probe.error}; its log: {servers.last_error(server.log)}"
                    continue
                return {**self.measure(server, target), "continuous_batching": cb,
                        "continuous_batching_refused": refused, "prompts_encoded_alike": alike}
        raise AssertionError("unreachable: the last mode tried is measured")

    def _model_type(self) -> str:
        with open(os.path.join(self.checkpoint, "config.json")) as f:
            return json.load(f)["model_type"]


def run(config: str = "v4-small", shape: WorkloadShape = WorkloadShape(), clients: int = 8,
        deadline_s: float = 600.0, transformers: str = "auto", trace: str = verbs.SERVE_TRACE,
        snapshot_interval: int = 512, server_env: dict[str, str] | None = None, out_dir: str = "benchmarks/results",
        progress: bool = True) -> dict:
    from tqdm import tqdm
    from kvcache.benchmarks.record import load_now, machine_info, write_results
    from kvcache.engine.checkpoint.demo import demo_checkpoint
    from kvcache.engine.model_config import ModelConfig
    from kvcache.engine.tokenizer import load_tokenizer
    os.makedirs(out_dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix=".kvcache-bench-serve-", dir=os.path.abspath(out_dir))
    started, load_at_start = time.perf_counter(), load_now()
    try:
        checkpoint = demo_checkpoint(os.path.join(root, "models"), config)
        tokenizer = load_tokenizer(checkpoint)
        engine = engine_settings(ModelConfig.load(os.path.join(checkpoint, "config.json")), shape, clients)
        cache = cache_settings(engine["block_size"], snapshot_interval)
        workload = build_workload(read_trace(trace), tokenizer, shape, cache["snapshot_interval"])
        steps = len(workload.turns) * (2 + (transformers != "off"))
        with tqdm(total=steps, desc="serve benchmark", unit="req", disable=not progress) as bar:
            r = Run(checkpoint, tokenizer, workload, engine, clients, deadline_s, root, bar, server_env or {})
            scenarios = {"cache_on": r.kvcache("cache_on", cache),
                         "cache_off": r.kvcache("cache_off", {"enabled": False})}
            scenarios["transformers"] = r.transformers(transformers) if transformers != "off" else \
                {"skipped": "--transformers off"}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    doc = _document(config, shape, clients, deadline_s, trace, engine, workload, scenarios, server_env or {})
    doc["elapsed_s"] = time.perf_counter() - started
    doc["machine"] = {**machine_info(out_dir), "load_at_start": load_at_start, **_versions()}
    write_results(doc, out_dir, "serve")
    return doc


def _document(config, shape, clients, deadline_s, trace, engine, workload, scenarios, server_env) -> dict:
    summaries = {k: v["summary"] for k, v in scenarios.items() if "summary" in v}
    found = ratios(summaries)
    doc = {"benchmark": "serve", "time_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
           "config": {"model": config, "weights": "random (demo checkpoint)", "trace": os.path.basename(trace),
                      "workload": dataclasses.asdict(shape), "clients": clients, "deadline_s": deadline_s,
                      "engine": engine, "server_env": server_env, "api": "/v1/completions, streamed"},
           "workload": workload.stats(), "scenarios": scenarios,
           **{k: v for k, v in found.items() if k != "targets"}, "targets": found["targets"]}
    doc["notes"] = notes(doc)
    return doc


def _versions() -> dict:
    import torch
    out = {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    with contextlib.suppress(ImportError):
        import transformers
        out["transformers"] = transformers.__version__
    return out


# ---------------------------------------------------------------- CLI
def run_args(args: argparse.Namespace) -> int:
    shape = WorkloadShape(block_tokens=args.block_tokens, max_requests=args.max_requests, max_turns=args.max_turns,
                          max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens,
                          time_scale=args.time_scale, seed=args.seed)
    doc = run(args.config, shape, args.clients, args.deadline, args.transformers, args.trace,
              args.snapshot_interval, dict(args.server_env), args.out_dir, progress=not args.no_progress)
    print(format_table(doc))
    for k, v in doc["notes"].items():
        print(f"  {k}: {v}")
    print(f"\nwrote {doc['files']['json']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return verbs.main("serve", argv)


if __name__ == "__main__":
    sys.exit(main())
