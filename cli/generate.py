"""`kvcache generate --model DIR --prompt "..."`: stream a completion to the terminal, then timings."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

from kvcache.cli.model import add_async_scheduling

EPILOG = """examples:
  kvcache model init --config v4-tiny --out /tmp/v4-tiny
  kvcache generate --model /tmp/v4-tiny --prompt "A prefix cache" --max-tokens 32
  kvcache generate --model /tmp/v4-tiny --prompt-ids 0,17,42 --temperature 0.8 --top-p 0.9 --seed 1
  kvcache generate --model /tmp/v4-tiny --prompt "..." --cache http://127.0.0.1:8790 --cache-mode exact
  kvcache generate --model /tmp/v4-tiny --prompt "..." --config configs/engine.toml --cache-mode exact
  kvcache generate --model /tmp/v4-tiny --prompt "..." --compile
"""


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate from a checkpoint, streaming tokens to the terminal",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory (kvcache model init writes one)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenised with the checkpoint's tokenizer, BOS added)")
    src.add_argument("--prompt-ids", metavar="IDS", help="comma-separated token ids instead of text")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="seeded sampling: same seed, same tokens")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    p.add_argument("--cache", metavar="STORE", help="reuse and save prefix KV in this block store: a directory, "
                   "a store TOML, http://host:port or unix:///path.sock (kvcache serve)")
    p.add_argument("--cache-mode", choices=("replay", "exact"), help="replay (default): rebuild windows by "
                   "recomputing the hit's last blocks; exact: resume from tail snapshots, bit-identical")
    files = p.add_mutually_exclusive_group()
    files.add_argument("--config", metavar="FILE", help="engine settings from this TOML ([engine] and "
                       "[cache]: configs/engine.toml documents every key); --cache, --cache-mode and --compile "
                       "given here override the file (--cache turns on a [cache] that says enabled = false, "
                       "with its settings)")
    files.add_argument("--cache-config", metavar="FILE", help="the older spelling of --config, for a file whose "
                       "[cache] is on: an error when the run would have no cache")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda[:i], npu[:i] or auto")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel ranks (processes; gloo on CPU, nccl on CUDA)")
    p.add_argument("--ep", action="store_true", help="with --tp > 1: also deal routed experts out across the ranks")
    p.add_argument("--compile", action="store_true", help="torch.compile the layers' token-wise phases: faster "
                   "steps after a one-time compile at start (v4-small on 2 CPU cores: ~5-8 minutes the first "
                   "time, under a minute once inductor's cache holds the graphs; needs g++ on CPU); not with --tp")
    p.add_argument("--speculative", choices=("mtp", "dspark"), help="speculative decoding with the checkpoint's "
                   "own drafter: mtp (V4's MTP layer, --num-draft tokens a step) or dspark (V4.1's DSpark block, "
                   "its confidences choose how many to verify); lossless: greedy output is the same tokens")
    p.add_argument("--num-draft", type=int, metavar="K", help="drafts per step (default: 3 for mtp, the draft "
                   "block for dspark)")
    add_async_scheduling(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from kvcache.engine.sampling import SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos).with_seed()
    if args.tp < 1:
        raise ValueError("--tp must be >= 1")
    config = _config(args)                        # a bad file is one error line, before any rank starts
    if config.compile and args.tp > 1:
        raise ValueError("--compile does not support tensor or expert parallelism yet: drop --compile or --tp")
    if args.tp == 1:
        return _generate(0, 1, args, params, config)
    import logging
    import tempfile
    import torch.multiprocessing as mp
    # mp.spawn logs "Terminating process ... via signal SIGTERM" when one rank's error ends the
    # others: noise next to the one error line a rank's bad input gets
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as d:      # every rank samples with the same seed (drawn above)
        try:
            mp.spawn(_rank, args=(args.tp, args, params, config, d), nprocs=args.tp, join=True)
        except mp.ProcessRaisedException as e:   # a rank's unexpected error: its last line, not a traceback
            print(f"kvcache generate: error: a rank failed: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
            return 1
        except mp.ProcessExitedException as e:
            # a rank's bad input: said here, once every rank is gone. A rank that printed it itself
            # could be SIGTERMed by mp.spawn (another rank exited first) before the line got out.
            said = sorted(pathlib.Path(d).glob("error-*"))
            if said:
                print(f"kvcache generate: error: {said[0].read_text()}", file=sys.stderr)
            return e.exit_code if e.exit_code and e.exit_code > 0 else 1
    return 0


def _rank(rank: int, world: int, args, params, config, workdir: str) -> None:
    """One tensor-parallel rank: joins the group, generates in step with the others, and exits with
    _generate's status (mp.spawn ignores return values; a non-zero exit reaches cmd_generate). Bad
    input is written to workdir/error-<rank> for cmd_generate to print once."""
    import torch.distributed as dist
    backend = "nccl" if args.device.startswith("cuda") else "hccl" if args.device.startswith("npu") else "gloo"
    dist.init_process_group(backend, init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world)
    try:
        status = _generate(rank, world, args, params, config)
        # every rank done before any tears down: a rank that left while its peer still talked
        # over gloo aborted the peer ("terminate called without an active exception", SIGABRT)
        dist.barrier()
    except (ValueError, FileNotFoundError) as e:  # bad input: every rank finds it
        pathlib.Path(workdir, f"error-{rank}").write_text(str(e))
        status = 2
    except BrokenPipeError:                       # `| head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 141
    finally:
        dist.destroy_process_group()
    if status:
        sys.exit(status)


def _generate(rank: int, world: int, args, params, config) -> int:
    from kvcache.cli.fmt import escape_controls
    from kvcache.engine.llm import LLM, load_checkpoint
    t0 = time.perf_counter()
    if config.compile and rank == 0:
        print("[compiling the model's layers before the first step: ~5-8 minutes for v4-small on 2 CPU cores "
              "the first time, under a minute once inductor's cache holds the graphs]", file=sys.stderr)
    model, tokenizer = load_checkpoint(args.model, args.device, progress=rank == 0 and sys.stderr.isatty())
    if world > 1:             # before the engine: it stacks the experts and compiles for the shapes it sees
        from kvcache.engine.parallel import shard
        shard(model, rank, world, tp=True, ep=args.ep)
    llm = LLM(model=model, tokenizer=tokenizer, config=config)
    load_s = time.perf_counter() - t0
    if rank > 0:                                  # the other ranks compute in step, silently
        sys.stdout = open("/dev/null", "w")
        sys.stderr = open("/dev/null", "w")
    prompt = args.prompt if args.prompt is not None else _ids(args.prompt_ids)
    engine = llm.engine
    req = engine.add_request(prompt, params)
    shown = ""
    while engine.has_work():
        for out in engine.step():
            if out.request is req and engine.tokenizer is not None:
                upto = printable(req.text, not req.finished, params.stop)
                if upto > len(shown):
                    sys.stdout.write(escape_controls(req.text[len(shown):upto]))   # demo weights emit control bytes
                    sys.stdout.flush()
                    shown = req.text[:upto]
            elif out.request is req:
                sys.stdout.write("".join(f" {t}" for t in out.new_tokens))
                sys.stdout.flush()
    m = req.metrics
    tpot = m.tpot_s(len(req.output))
    print(f"\n\n[{len(req.prompt)} prompt tokens, {len(req.output)} generated, finish: "
          f"{req.finish_reason.value if req.finish_reason else '?'}; load {load_s:.2f} s, "
          f"time to first token {m.ttft_s * 1e3:.0f} ms"
          + (f", {tpot * 1e3:.1f} ms/token ({1 / tpot:.1f} tokens/s)" if tpot else "") + "]", file=sys.stderr)
    if req.usage is not None:
        print(usage_line(req.usage, llm.engine.config.cache), file=sys.stderr)
    if engine.spec is not None:
        s = engine.spec.stats
        print(f"[speculative {engine.config.speculative}: {s.mean_accepted_tokens:.2f} tokens per verify step; "
              "accepted by draft position: " + " ".join(f"{r:.2f}" for r in s.rates()) + "]", file=sys.stderr)
    llm.close()
    if req.error:
        print(f"kvcache generate: error: {req.error}", file=sys.stderr)
        return 1
    return 0


def usage_line(u, cache) -> str:
    """The cache usage line printed after a request; in exact mode it says when the prompt is too
    short to leave a snapshot (nothing else would tell a user why the same prompt never hits)."""
    tiers = ", ".join(f"{t} {n}" for t, n in u.cached_tokens.items()) or "none"
    line = (f"[cache: {u.total_cached} of {u.prompt_tokens} prompt tokens cached ({tiers}), "
            f"{u.replayed_tokens} replayed, {u.bytes_loaded / 1e6:.1f} MB loaded in {u.load_s * 1e3:.0f} ms")
    if cache is not None and cache.mode == "exact" and u.prompt_tokens <= cache.snapshot_interval:
        line += (f"; exact mode resumes only from snapshots, taken every {cache.snapshot_interval} prompt tokens "
                 f"(cache.snapshot_interval) and where a request ends: a {u.prompt_tokens}-token prompt leaves "
                 "none that the same prompt can reuse, only one that a prompt continuing it resumes from")
    return line + "]"


def printable(text: str, running: bool, stops: tuple[str, ...]) -> int:
    """How much of a request's text can be shown now. While it runs, not a trailing U+FFFD (the
    decoder's stand-in for a character whose bytes are still to come) and not the last
    len(longest stop string) - 1 characters (they may begin a stop string the next token ends)."""
    if not running:
        return len(text)
    n = len(text)
    while n and text[n - 1] == "\ufffd":
        n -= 1
    return max(0, min(n, len(text) - (max(map(len, stops), default=1) - 1)))


def _config(args):
    """The engine config: --config's file (else the defaults), then the flags over it: --cache and
    --cache-mode set the cache's store and mode (a cache then, on the file's [cache] settings even
    where it says enabled = false), --compile compiles. --cache-config FILE asks for a cache: a run
    that would have none is an error, not a silent uncached run."""
    import dataclasses
    from kvcache.engine.config import CacheConfig, EngineConfig
    path = args.config or args.cache_config
    config, in_file = EngineConfig.load_with_cache(path) if path else (EngineConfig(), None)
    flags = {k: v for k, v in (("store", args.cache), ("mode", args.cache_mode)) if v is not None}
    cache = dataclasses.replace(in_file or CacheConfig(), **flags) if flags else config.cache
    if args.cache_config and cache is None:
        raise ValueError(f"--cache-config {path}: the file's cache is off (no [cache] section, or enabled = false): "
                         "pass --cache STORE, or set enabled = true in its [cache]")
    spec = {k: v for k, v in (("speculative", args.speculative), ("num_draft", args.num_draft),
                              ("async_scheduling", args.async_scheduling)) if v is not None}
    return dataclasses.replace(config, cache=cache, compile=config.compile or args.compile, **spec)


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
