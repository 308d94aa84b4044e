"""`kvcache serve`: run the cache daemon on a data directory (the daemon: kvcache.server), and with
`--model` the model server beside it (server/model_api)."""

from __future__ import annotations

import argparse
import os

from kvcache.cli.model import add_async_scheduling
from kvcache.server.config import default_data_dir

EPILOG = """examples:
  kvcache serve                                     # the cache daemon alone
  kvcache serve --config configs/store.toml
  KVCACHE_TOKENS=$(openssl rand -hex 24):acme kvcache serve --host 0.0.0.0
  kvcache serve --model demo                        # build (once) and serve the demo V4.1 model
  kvcache serve --model demo:v41-tiny --port 8000
  kvcache serve --model /models/DeepSeek-V4.1-Flash --config configs/engine.toml --device cuda
  kvcache serve --model /models/v41 --cache http://cachehost:8790   # a cache daemon elsewhere

  then, e.g.:
  curl -s localhost:8790/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model": "v41-small", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}'
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="run the cache daemon (HTTP API), and with --model the model server beside it",
        description="Run the kvcache daemon: it owns a data directory (DRAM and NVMe tiers, index, GC)\n"
                    "and serves it over HTTP (docs/api.md). With no arguments it uses an embedded default:\n"
                    f"{default_data_dir()}, 1 GiB of DRAM, 64 GiB of NVMe, 127.0.0.1:8790, no auth.\n"
                    "Binding beyond loopback requires tokens ([server] tokens or KVCACHE_TOKENS).\n"
                    "SIGTERM/SIGINT drain in-flight requests and flush write-back blocks before exit.\n"
                    "Everything it creates is its OS user's alone (umask 077); run it as a user of its\n"
                    "own, with tokens in the config file (docs/security.md: threat model, systemd unit).\n\n"
                    "With --model it also serves the model on the same port: OpenAI-compatible\n"
                    "/v1/chat/completions, /v1/completions, /v1/responses, /v1/models and Anthropic-compatible\n"
                    "/v1/messages, /v1/messages/count_tokens, with /health and /ready. The engine keeps its\n"
                    "prefix KV in this daemon's store (in-process), so usage blocks report cached tokens.\n"
                    "The port opens at once and the model loads behind it: /ready answers 200 once the engine\n"
                    "is warm (the model routes 503 until then); a model that fails to load stops the process.\n"
                    "--model demo builds a demo V4.1 checkpoint (random weights) under DATA_DIR/models once.\n"
                    "With --cache URL the engine uses that cache daemon instead: this process then serves\n"
                    "only the model routes and opens no store of its own. The model routes need a token\n"
                    "wherever the cache API does (Authorization: Bearer, or the anthropic SDK's x-api-key).",
        epilog=EPILOG)
    p.add_argument("--config", metavar="FILE.toml", help="store and [server] settings (see configs/); with --model "
                   "also the engine's [engine] and [cache] (configs/engine.toml)")
    p.add_argument("--data-dir", metavar="DIR", help="overrides store.data_dir")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default 8790)")
    p.add_argument("--unix-socket", metavar="PATH", help="also listen on this unix socket")
    p.add_argument("--gc-interval", type=float, metavar="S", help="seconds between GC steps (default 10)")
    m = p.add_argument_group("model server (with --model)")
    m.add_argument("--model", metavar="DIR|demo[:NAME]", help="serve this checkpoint; demo: the demo V4.1 "
                   "model (NAME from configs/models, default v41-small), built under DATA_DIR/models on first use")
    m.add_argument("--served-model-name", metavar="NAME", help="the model name clients send (default: the "
                   "checkpoint directory's name, e.g. v41-small for the demo); the official name of the "
                   "model's version (DeepSeek-V4.1-Flash or DeepSeek-V4-Pro) is accepted too")
    m.add_argument("--cache", metavar="URL", dest="cache_url", help="the engine's cache daemon "
                   "(http://host:port or unix:///path); this process then serves only the model routes")
    m.add_argument("--cache-mode", choices=("replay", "exact"), help="how a prefix hit resumes (default exact: "
                   "bit-identical; replay: recompute the hit's last blocks)")
    m.add_argument("--speculative", choices=("mtp", "dspark"), help="speculative decoding with the checkpoint's "
                   "own drafter (lossless; [engine] speculative in --config)")
    m.add_argument("--num-draft", type=_positive_int, metavar="K", help="drafts per step (default: 3 for mtp, "
                   "the draft block for dspark)")
    add_async_scheduling(m)
    m.add_argument("--device", default="cpu", help="cpu (default), cuda[:i], npu[:i] or auto")
    m.add_argument("--access-log", metavar="PATH|-", help="a JSON line per model request to PATH (- : stdout)")
    m.add_argument("--max-waiting", type=_positive_int, default=256, metavar="N",
                   help="model requests in flight at most (beyond: 429 with Retry-After; default 256)")
    m.add_argument("--tenant-max-requests", type=_positive_int, metavar="N", help="a tenant's requests in flight")
    m.add_argument("--tenant-max-tokens", type=_positive_int, metavar="N",
                   help="a tenant's tokens in flight (prompt + max_tokens of its requests)")
    m.add_argument("--request-timeout", type=_seconds, default=600.0, metavar="S",
                   help="a model request still running S seconds after it arrived is aborted and its blocks "
                        "freed (the client gets a 504, or mid-stream an error event; default 600; 0: never)")
    p.set_defaults(func=cmd_serve)


def overrides(args):
    """The command line's settings, over the config file's."""
    from kvcache.server.daemon import Overrides      # (aiohttp and the store: only for `serve`)
    if args.cache_url and not args.model:
        raise ValueError("--cache names the engine's cache daemon: it needs --model")
    return Overrides(config_file=args.config, data_dir=args.data_dir, host=args.host, port=args.port,
                     unix_socket=args.unix_socket, gc_interval_s=args.gc_interval, model=args.model,
                     served_model_name=args.served_model_name, cache_url=args.cache_url,
                     cache_mode=args.cache_mode, speculative=args.speculative, num_draft=args.num_draft,
                     async_scheduling=args.async_scheduling,
                     device=args.device, access_log=args.access_log,
                     max_waiting=args.max_waiting, tenant_max_requests=args.tenant_max_requests,
                     tenant_max_tokens=args.tenant_max_tokens, request_timeout_s=args.request_timeout or None)


def cmd_serve(args) -> int:
    if args.model:
        # OpenMP threads that spin while idle steal the cores from the event loop and the grammar
        # and saver threads (decode 5-20x slower under contention on a small host); the setting is
        # read when torch loads its OpenMP runtime, so before the model is imported. An explicit
        # OMP_WAIT_POLICY in the environment wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from kvcache.server import daemon
    daemon.run(overrides(args))
    print("kvcache: stopped cleanly", flush=True)
    return 0


def _seconds(text: str) -> float:
    """Seconds >= 0, finite and bounded (asyncio's timers overflow past a float's range)."""
    from kvcache.server.config import MAX_SECONDS
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 <= v <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds in [0, {MAX_SECONDS:g}]")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return v
