"""One vLLM process over the tiny checkpoint: what the vLLM tests and `kvcache bench vllm` run.

    python -m kvcache.benchmarks.vllm_runner '{"model": DIR, "store": URL | null, "prompts": [[ids]], ...}'
    python -m kvcache.benchmarks.vllm_runner - < config.json      (long prompts: argv holds 128 KiB)

vLLM keeps process-wide state (its distributed groups, the connector agent), so every engine
the tests and the benchmark need is its own process: this one. It runs the engine in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, ~2 s to start), generates each prompt greedily in turn and
prints one JSON line per prompt (tokens, logprobs, cached tokens, seconds), then one with the
connector's counters. With `"flush": true` it waits after each prompt until the connector's
saves have landed, so that the next prompt (or the next process) finds them; with
`"kill_after": [i, pid]` it kills process `pid` once prompt i is done (a daemon dying mid-run).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import asdict


def _engine(cfg: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig
    kt = None
    if cfg.get("store"):
        extra = {"store": cfg["store"], **cfg.get("extra", {})}
        if cfg.get("token"):
            extra["token"] = cfg["token"]
        kt = KVTransferConfig(kv_connector="KVCacheConnector", kv_connector_module_path="kvcache.integrations.vllm",
                              kv_role="kv_both", kv_connector_extra_config=extra)
    return LLM(model=cfg["model"], dtype="float32", kv_cache_memory_bytes=cfg.get("kv_bytes", 64 << 20),
               max_model_len=cfg.get("max_model_len", 4096), block_size=cfg.get("block_size", 128),
               enable_prefix_caching=cfg.get("prefix_caching", False), max_num_seqs=4, enforce_eager=True,
               kv_transfer_config=kt, max_num_batched_tokens=cfg.get("max_batched_tokens", 8192))


def _connector():
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group
    return get_kv_transfer_group() if has_kv_transfer_group() else None


def main(argv: list[str]) -> int:
    cfg = json.loads(argv[0] if argv and argv[0] != "-" else sys.stdin.read())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    t0 = time.perf_counter()
    llm = _engine(cfg)
    print(json.dumps({"started_s": time.perf_counter() - t0}), flush=True)
    sp = SamplingParams(max_tokens=cfg.get("max_tokens", 8), temperature=0.0, logprobs=1)
    for i, ids in enumerate(cfg["prompts"]):
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        dt = time.perf_counter() - t
        gen = out.outputs[0]
        logprobs = [lp[tok].logprob for lp, tok in zip(gen.logprobs, gen.token_ids)]
        connector = _connector()
        if cfg.get("flush") and connector is not None and connector.worker is not None:
            connector.worker.flush()
        print(json.dumps({"prompt": i, "tokens": list(gen.token_ids), "logprobs": logprobs,
                          "cached": out.num_cached_tokens or 0, "seconds": dt}), flush=True)
        if cfg.get("kill_after") and cfg["kill_after"][0] == i:        # the tests' daemon dying mid-run
            os.kill(cfg["kill_after"][1], signal.SIGKILL)
    connector = _connector()
    if connector is not None and connector.worker is not None:
        w = connector.worker
        print(json.dumps({"worker": asdict(w.counters), "seam": dict(w.seam.stats)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
