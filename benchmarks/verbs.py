"""The benchmarks' options, one `add_*_arguments` per benchmark, and the verbs that name them:
`kvcache bench VERB` (cli/bench.py) and `python -m kvcache.benchmarks.MODULE` (`main`) both build
their parser from `VERBS`, then call the module's `run_args`. Nothing here imports torch or a
benchmark module, so building the `kvcache` parser stays cheap.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Callable

from kvcache.benchmarks.args import RESULTS, checked, counts, names
from kvcache.benchmarks.store_verbs import (DAEMON_EPILOG, DEFAULT_OUT, LMCACHE_EPILOG, TIERS_EPILOG, VLLM_EPILOG,
                                            add_daemon_arguments, add_lmcache_arguments, add_tiers_arguments,
                                            add_vllm_arguments)

SERVE_TRACE = "/work/shared/traces/mooncake_conversation_trace.jsonl"   # the shared Mooncake trace
EXPERTS = {"auto": None, "on": True, "off": False}      # --device-experts -> EngineConfig.device_experts

MODEL_EPILOG = """examples:
  kvcache bench model                                   # v4-tiny and v4-small at 512, 2k, 8k tokens
  kvcache bench model --configs v4-tiny --lengths 128,512 --decode-steps 8
  kvcache bench model --baseline-max-tokens 2048        # skip transformers' O(T^2) 8k prefill
Needs the engine extra (torch) and transformers (the test extra).
"""


def add_model_arguments(p: argparse.ArgumentParser, default_out_dir: str = DEFAULT_OUT) -> None:
    p.add_argument("--configs", type=names, default="v4-tiny,v4-small", help="model configs (configs/models/NAME.json)")
    p.add_argument("--lengths", type=counts, default="512,2048,8192", help="prompt lengths in tokens")
    p.add_argument("--decode-steps", type=checked(int), default=16, help="decode steps timed (default 16)")
    p.add_argument("--baseline-max-tokens", type=checked(int), default=8192,
                   help="longest prompt given to transformers (its eager attention is O(T^2) in memory)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--out-dir", default=default_out_dir, metavar="DIR", help="where the JSON report goes")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


ENGINE_EPILOG = """targets (reported): decode_tokens_per_s_vs_hf_b1 >= 3, decode_tokens_per_s_vs_hf_b8 >= 10 (v4-small)
examples:
  kvcache bench engine
  kvcache bench engine --configs v4-tiny --batches 1,8 --prompt-tokens 64 --output-tokens 8 --eager
  kvcache bench engine --device cuda --configs v4-small --batches 1,8      # on a GPU, bf16
"""


def add_engine_arguments(p: argparse.ArgumentParser, default_out_dir: str = DEFAULT_OUT) -> None:
    p.add_argument("--configs", type=names, default="v4-tiny,v4-small",
                   help="model configs (configs/models/NAME.json), random weights (default v4-tiny,v4-small)")
    p.add_argument("--batches", type=counts, default="1,8,32",
                   help="requests generated at once, one run each (default 1,8,32)")
    p.add_argument("--prompt-tokens", type=checked(int), default=128, help="tokens per prompt (default 128)")
    p.add_argument("--output-tokens", type=checked(int), default=32,
                   help="greedy tokens generated per request (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--out-dir", default=default_out_dir, metavar="DIR",
                   help=f"where the JSON report goes (default {default_out_dir})")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--eager", action="store_true", help="skip the compiled engine (it needs g++ on CPU and, with "
                   "a cold inductor cache, ~2 (v4-tiny) to ~5-8 (v4-small) minutes of compiling per config on 2 "
                   "cores); 'ours' is then the eager engine")
    p.add_argument("--device", default="cpu", help="cpu (fp32, default), cuda[:i] or npu[:i] (bf16 weights for "
                   "both engines; results in engine_throughput_<device>-*.json)")
    p.add_argument("--device-experts", choices=tuple(EXPERTS), default="auto",
                   help="routed experts summed on the device (EngineConfig.device_experts; auto: where grouped "
                   "matmuls exist, off on the CPU)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA: the compiled engine replays its decode steps as CUDA graphs (EngineConfig.cuda_graphs; "
                   "needs --device-experts on or auto with grouped matmuls)")


COLD_WARM_EPILOG = """targets (small config, 8k prefix): warm_dram_ttft_vs_cold <= 0.1, warm_nvme_ttft_vs_cold <= 0.15,
  warm_object_ttft_vs_cold <= 0.3, worst_warm_ttft_vs_floor <= 1.5
examples:
  kvcache bench cold-warm                                   # v4-small, 2k, 8k and 32k prefixes
  kvcache bench cold-warm --lengths 2048,8192
  kvcache bench cold-warm --config v4-tiny --lengths 512,1024 --output-tokens 4
"""


def add_cold_warm_arguments(p: argparse.ArgumentParser, default_out_dir: str = DEFAULT_OUT) -> None:
    p.add_argument("--config", default="v4-small", help="model config (configs/models/NAME.json); random weights")
    p.add_argument("--lengths", type=counts, default="2048,8192,32768",
                   help="shared prefix lengths in tokens (default 2048,8192,32768)")
    p.add_argument("--output-tokens", type=checked(int), default=16, help="tokens generated per request (default 16)")
    p.add_argument("--workloads", default="document,chat,shared", help="any of document (always), chat, shared")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--out-dir", default=default_out_dir, metavar="DIR",
                   help=f"where the JSON, markdown and plot go (default {default_out_dir})")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_codec_arguments(p: argparse.ArgumentParser, default_out_dir: str = DEFAULT_OUT) -> None:
    p.add_argument("--configs", type=names, default="v4-small,v41-small",
                   help="model configs (configs/models/NAME.json)")
    p.add_argument("--tokens", type=checked(int), default=2048, help="prompt tokens (default 2048)")
    p.add_argument("--block-tokens", type=checked(int), default=256, help="tokens per stored block (default 256)")
    p.add_argument("--out-dir", default=default_out_dir, metavar="DIR", help="where the JSON report goes")


PROFILE_EPILOG = """A step that is mostly host time (launches, Python, guards) with the device idle is what CUDA
graphs or fewer, larger kernels fix; a busy device is what faster kernels fix. The JSON report goes
to OUT_DIR/decode_profile_<device>-<UTC time>.json and ...-latest.json.
examples:
  kvcache bench decode-profile --device cuda --batch 1                  # compiled engine, v4-small
  kvcache bench decode-profile --device cuda --batch 8 --eager --device-experts off
  kvcache bench decode-profile --device cuda --batch 1 --cuda-graphs    # decode steps as CUDA graphs
  kvcache bench decode-profile --device cpu --batch 1                   # CPU: op calls, not launches
  kvcache bench decode-profile --device cpu --batch 1 --general-decode  # the A/B for planned decode
"""


def add_profile_arguments(p: argparse.ArgumentParser, default_out_dir: str = DEFAULT_OUT) -> None:
    p.add_argument("--config", default="v4-small")
    p.add_argument("--device", default="cpu", help="cpu, cuda[:i] or npu[:i]")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=16, help="decode steps per run (default 16)")
    p.add_argument("--eager", action="store_true", help="the uncompiled engine")
    p.add_argument("--device-experts", choices=tuple(EXPERTS), default="auto")
    p.add_argument("--general-decode", action="store_true",
                   help="decode steps by the general path (EngineConfig(planned_decode=False)), for the A/B")
    p.add_argument("--cuda-graphs", action="store_true", help="decode steps replayed as CUDA graphs")
    p.add_argument("--out-dir", default=default_out_dir, metavar="DIR",
                   help=f"where the JSON report goes (default: {default_out_dir})")


SERVE_EPILOG = """scenarios, one after another on the same weights (a demo checkpoint of --config):
  cache_on       kvcache serve --model CKPT, exact-mode prefix cache (a snapshot every --snapshot-interval)
  cache_off      the same server with [cache] enabled = false
  transformers   transformers serve on a transformers-format copy of CKPT, --continuous-batching;
                 where that refuses the model, sequential generate (the reason is recorded)
workload: sessions of the Mooncake conversation trace (arrival times x --time-scale, prefix
structure kept, --block-tokens per 512-token trace block), each session's turns in order, at most
--clients requests in flight, streamed through /v1/completions.

targets (reported, never enforced): serve_ttft_p50_cache_vs_off <= 0.3,
serve_throughput_vs_transformers >= 3, serve_errors = 0.
The JSON report goes to OUT_DIR/serve-<UTC time>.json and ...-latest.json.
(c) needs transformers' serving extra: pip install 'transformers[serving]'.

examples:
  kvcache bench serve                                    # v4-small, 32 requests, all three scenarios
  kvcache bench serve --config v4-tiny --block-tokens 16 --max-requests 8 --snapshot-interval 64 \\
      --transformers off
"""


def _env_pair(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def add_serve_arguments(p: argparse.ArgumentParser, default_out_dir: str = DEFAULT_OUT) -> None:
    count = checked(int, what="a positive integer")
    p.add_argument("--config", default="v4-small", help="demo model config (configs/models/NAME.json), random "
                   "weights; a V4 one for the transformers scenario (default v4-small)")
    p.add_argument("--trace", default=SERVE_TRACE,
                   help="a Mooncake-format trace (JSONL: timestamp ms, input_length, output_length, hash_ids)")
    p.add_argument("--block-tokens", type=count, default=48, metavar="N",
                   help="tokens per 512-token trace block; output lengths scale alike (default 48)")
    p.add_argument("--max-requests", type=count, default=32, metavar="N", help="requests replayed (default 32)")
    p.add_argument("--max-turns", type=count, default=8, metavar="N", help="turns kept per session (default 8)")
    p.add_argument("--max-prompt-tokens", type=count, default=3072, metavar="N",
                   help="a session ends before its first turn longer than this (default 3072)")
    p.add_argument("--max-output-tokens", type=count, default=32, metavar="N",
                   help="cap on each request's scaled output length (default 32)")
    p.add_argument("--time-scale", type=checked(float, lambda v: v >= 0, "a number >= 0"), default=0.01,
                   metavar="X", help="seconds of replay per second of trace (default 0.01; 0: all at once)")
    p.add_argument("--snapshot-interval", type=count, default=512, metavar="N",
                   help="cache_on: exact mode's snapshot interval in tokens, rounded up to whole engine blocks; a "
                        "hit is whole intervals (default 512, the server's)")
    p.add_argument("--server-env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for every server of the run, alike (repeatable), e.g. "
                        "OMP_WAIT_POLICY=PASSIVE on a CPU that other work shares")
    p.add_argument("--clients", type=count, default=8, metavar="N", help="requests in flight at most (default 8)")
    p.add_argument("--deadline", type=checked(float), default=600.0, metavar="S",
                   help="seconds per scenario; what has not finished by then is an error (default 600)")
    p.add_argument("--transformers", choices=("auto", "cb", "sequential", "off"), default="auto",
                   help="scenario (c): auto tries continuous batching, then sequential generate (default auto)")
    p.add_argument("--seed", type=int, default=0, help="seed of the token ids per hash id")
    p.add_argument("--out-dir", default=default_out_dir, metavar="DIR",
                   help=f"where the JSON report goes (default {default_out_dir})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


STRUCTURED_EPILOG = """what is measured (one engine on a demo checkpoint of --config, random weights):
  decode A/B   per batch size b: --requests JSON-schema requests (seeded, temperature 1), b at a
               time; each batch constrained, then free (same prompts and seeds, max_tokens = each
               one's generated count, ignore_eos: the same decode steps), --repeats times; decode
               tok/s = tokens after each request's first / (last finish - first token); ratio =
               the median pair's constrained / free; also the mask fill's time (BatchMasks.fill_s)
               and how long sampling waited for it
  compile      GrammarCompiler.matcher's first build of each schema (fresh compiler, no cache), p50 / p99
  fill         GrammarCompiler.fill_batch of --fill-rows rows in mid-JSON states, p50 / p99; and
               masks.apply of one row to the logits
  compile and fill run twice: on the checkpoint's tokenizer at the model's width, and on a
  --wide-vocab BPE (trained on a seeded synthetic text) at --wide-width logits (V4's 129280)

targets (reported, never enforced): structured_decode_vs_free_b1 >= 0.9, _b8 >= 0.9.
The JSON report goes to OUT_DIR/structured-<UTC time>.json and ...-latest.json.

examples:
  kvcache bench structured --schemas tests/engine/structured/schemas     # the test corpus
  kvcache bench structured --config v41-tiny --requests 2 --repeats 1 --max-tokens 8 --wide-vocab 1024
"""


def add_structured_arguments(p: argparse.ArgumentParser, default_out_dir: str = DEFAULT_OUT) -> None:
    count = checked(int, what="a positive integer")
    p.add_argument("--config", default="v41-small", help="demo model config (configs/models/NAME.json), random "
                   "weights (default v41-small)")
    p.add_argument("--batches", type=counts, default="1,8", help="requests decoded at once (default 1,8)")
    p.add_argument("--requests", type=count, default=8, metavar="N",
                   help="requests per round, each on its own schema; batch b runs them b at a time (default 8)")
    p.add_argument("--repeats", type=count, default=5, metavar="N",
                   help="times each batch runs constrained then free; the median pair is reported (default 5)")
    p.add_argument("--max-tokens", type=count, default=48, metavar="N",
                   help="cap on a constrained request's output (default 48)")
    p.add_argument("--schemas", default=None, metavar="DIR",
                   help="a directory of *.json JSON schemas (default: the benchmark's built-in few)")
    p.add_argument("--fill-rows", type=counts, default="1,8,32", help="rows per fill_batch timed (default 1,8,32)")
    p.add_argument("--fill-iters", type=count, default=200, metavar="N", help="fills timed per row count (default 200)")
    p.add_argument("--compile-passes", type=count, default=3, metavar="N",
                   help="times each schema's first build is timed, a fresh compiler each pass (default 3)")
    p.add_argument("--wide-vocab", type=checked(int, lambda v: v >= 512, "at least 512"), default=32768, metavar="N",
                   help="tokens of the realistic-size tokenizer (default 32768)")
    p.add_argument("--wide-width", type=count, default=129280, metavar="N",
                   help="logit width its masks are filled at (default 129280, DeepSeek-V4's)")
    p.add_argument("--compile", action="store_true", help="the compiled engine (EngineConfig(compile=True); g++ "
                   "and minutes of compiling on a cold cache); default: eager")
    p.add_argument("--models-dir", default=None, metavar="DIR",
                   help="where the demo checkpoint is built once and kept (default: a scratch directory, removed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling and of the fill benchmark's walks")
    p.add_argument("--out-dir", default=default_out_dir, metavar="DIR",
                   help=f"where the JSON report goes (default {default_out_dir})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


SPEC_EPILOG = """\
per model (v4-small: MTP, v41-small: DSpark), demo checkpoints with distilled drafters:
  distill   `kvcache model distill` for --distill-seconds, once (kept under --models-dir)
  rounds    per batch, --repeats times: the plain engine, the speculative one, then both again
            with async_scheduling on, greedy, on the distillation corpus's greedy prompts; decode
            tok/s, the median round's ratios; the outputs must be the same tokens
  accepted  mean tokens per verify step (the bonus included), acceptance by draft position

targets (reported, never enforced): spec_decode_speedup_b1 >= 2.0, _b8 >= 1.3,
async_sched_speedup >= 1.0 (the worst on / off ratio).
The JSON report goes to OUT_DIR/spec-<UTC time>.json and ...-latest.json.

examples:
  kvcache bench spec --models-dir ~/.cache/kvcache-models           # distils once, reuses after
  kvcache bench spec --models v4-small --batches 1 --repeats 1 --distill-seconds 30
"""


def add_spec_arguments(p: argparse.ArgumentParser, default_out_dir: str = DEFAULT_OUT) -> None:
    count = checked(int, what="a positive integer")
    p.add_argument("--models", type=lambda v: [m for m in v.split(",") if m], default=["v4-small", "v41-small"],
                   help="demo configs, comma-separated: v4-small (MTP), v41-small (DSpark) (default both)")
    p.add_argument("--batches", type=counts, default="1,8", help="requests decoded at once (default 1,8)")
    p.add_argument("--repeats", type=count, default=3, metavar="N", help="rounds per batch (default 3)")
    p.add_argument("--max-tokens", type=count, default=48, metavar="N", help="tokens per request (default 48)")
    p.add_argument("--num-draft", type=checked(int, lambda v: v >= 0, "a count"), default=0, metavar="K",
                   help="drafts per step (default 0: the method's, 3 for mtp, the draft block for dspark)")
    p.add_argument("--distill-seconds", type=checked(float, lambda v: v > 0, "positive"), default=150.0,
                   metavar="S", help="drafter training time per model (default 150)")
    p.add_argument("--models-dir", default=None, metavar="DIR", help="where the demo checkpoints are built and "
                   "distilled once (default OUT_DIR/.models)")
    p.add_argument("--out-dir", default=default_out_dir, metavar="DIR",
                   help=f"where the JSON report goes (default {default_out_dir})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass(frozen=True)
class Verb:
    """One benchmark as a command: the module that runs it (its `run_args(args) -> int`), its help."""
    module: str
    help: str
    description: str
    add_arguments: Callable[..., None]
    epilog: str | None = None

    def configure(self, p: argparse.ArgumentParser, default_out_dir: str = DEFAULT_OUT) -> argparse.ArgumentParser:
        self.add_arguments(p, default_out_dir=default_out_dir)
        p.set_defaults(func=self.run)
        return p

    def run(self, args: argparse.Namespace) -> int:
        # imported only now: most benchmarks import torch
        return importlib.import_module(f"kvcache.benchmarks.{self.module}").run_args(args)


VERBS = {
    "tiers": Verb("tiers", "DRAM/NVMe throughput against memcpy and raw disk",
                  "Throughput of the DRAM and NVMe tiers against memcpy and raw disk I/O, plus block-hash and "
                  "lookup latency; prints a table, writes a JSON report.", add_tiers_arguments, TIERS_EPILOG),
    "daemon": Verb("daemon", "the serve daemon (HTTP, unix socket) against redis-server and memcpy",
                   "Batched put/get throughput of the `kvcache serve` daemon against redis-server and memcpy, plus "
                   "lookup latency; prints a table, writes a JSON report.", add_daemon_arguments, DAEMON_EPILOG),
    "lmcache": Verb("lmcache_side", "side by side with LMCache's multiprocess server (when installed)",
                    "The daemon and LMCache's MP server on the same MLA- and MHA-shaped requests: store, warm "
                    "retrieve, and retrieve after restarting each server; prints a table, writes a JSON report.",
                    add_lmcache_arguments, LMCACHE_EPILOG),
    "vllm": Verb("vllm_bench", "vLLM with the KV connector: TTFT warm from the daemon against cold and "
                 "vLLM's own prefix cache",
                 "TTFT of a repeated long prefix in vLLM with the kvcache connector against vLLM with prefix "
                 "caching off and on, in the same run, and the connector's load throughput against the daemon's "
                 "own gets; prints a table, writes a JSON report.", add_vllm_arguments, VLLM_EPILOG),
    "model": Verb("model", "V4 prefill/decode speed against transformers; KV bytes per token",
                  "Prefill tokens/s and decode ms/token of the engine's DeepSeek-V4 against transformers' "
                  "implementation on the same weights, and KV bytes per token of the real Flash configs; prints a "
                  "table, writes a JSON report.", add_model_arguments, MODEL_EPILOG),
    "codec": Verb("kv_codec", "zstd and zstd-shuffle2 on the KV history the models cache",
                  "Compression ratio and speed of the object tier's codecs on the bf16 history rows (compressed "
                  "entries, index keys) of demo V4 / V4.1 models after a prefill.", add_codec_arguments),
    "engine": Verb("engine", "offline generation throughput and latency against transformers' generate",
                   "Prompt and decode tokens/s, TTFT and TPOT of the engine at several batch sizes, against "
                   "transformers' DeepseekV4ForCausalLM.generate on the same weights.", add_engine_arguments,
                   ENGINE_EPILOG),
    "cold-warm": Verb("cold_warm", "what the cache buys: TTFT cold vs warm from the pool, DRAM, NVMe, "
                      "object storage and after a restart",
                      "The cold-versus-warm benchmark: a shared document (several lengths) plus a question, "
                      "multi-turn chat and many users sharing a system prompt; TTFT, prefill tokens computed, bytes "
                      "loaded, decode speed and footprint per scenario, against each tier's floor measured in the same "
                      "run. JSON + Markdown report with a plot.", add_cold_warm_arguments, COLD_WARM_EPILOG),
    "serve": Verb("serve", "the model server under a multi-turn trace: cache on, off, and transformers serve",
                  "TTFT, TPOT, request throughput, errors and the cached-token fraction of `kvcache serve --model` "
                  "replaying sessions of the Mooncake conversation trace over HTTP, with the prefix cache on and "
                  "off, against transformers serve on the same weights; prints a table, writes a JSON report.",
                  add_serve_arguments, SERVE_EPILOG),
    "structured": Verb("structured", "JSON-schema constrained decode against free decode; grammar compile "
                       "and mask fill times",
                       "Decode tokens/s of the engine with a JSON-schema constraint against the same requests "
                       "without, in the same run (batch 1 and 8), and the grammar's own costs: compile time per "
                       "schema and mask fill time per batch, at the demo and at a real tokenizer's size; prints a "
                       "table, writes a JSON report.", add_structured_arguments, STRUCTURED_EPILOG),
    "spec": Verb("spec", "speculative decoding (MTP, DSpark) against plain decoding, distilled demo drafters",
                 "Decode tokens/s with speculative decoding against without, in the same run, on v4-small (MTP) "
                 "and v41-small (DSpark) with drafters distilled on their targets, batch 1 and 8; mean accepted "
                 "tokens and acceptance by position; prints a table, writes a JSON report.", add_spec_arguments,
                 SPEC_EPILOG),
    "decode-profile": Verb("decode_profile", "where a decode step's time goes (torch.profiler)",
                           "Host time, kernel launches and device syncs per decode step, how long the device is busy, "
                           "and the ops that cost the most host time (torch.profiler).", add_profile_arguments,
                           PROFILE_EPILOG),
}


def main(module: str, argv: list[str] | None = None) -> int:
    """`python -m kvcache.benchmarks.MODULE [options]`: the verb's options, reports beside this package."""
    verb = next(v for v in VERBS.values() if v.module == module)
    fmt = argparse.RawDescriptionHelpFormatter if verb.epilog else argparse.HelpFormatter
    p = argparse.ArgumentParser(prog=f"python -m kvcache.benchmarks.{module}", description=verb.description,
                                formatter_class=fmt, epilog=verb.epilog)
    args = verb.configure(p, default_out_dir=RESULTS).parse_args(argv)
    return verb.run(args)
