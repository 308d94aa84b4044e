"""`kvcache`: operate a kvcache data directory from the shell.

    kvcache serve [--config F]          the cache daemon (HTTP API, metrics)
    kvcache stats DIR [--json]          what the store holds (works while a daemon runs)
    kvcache check DIR [--fix] [--quick] reconcile index and segments, recount
    kvcache gc DIR | --url URL          expire, evict over watermarks, compact segments (--url: in a daemon)
    kvcache report [DIR] [--since 24h]  hit rates per tier, tenant, prompt length [--out report.html]
    kvcache model init|logits|info      demo checkpoints, logits, parameter counts and KV bytes
    kvcache generate --model DIR ...    generate from a checkpoint, streaming to the terminal
    kvcache replay TRACE.jsonl          prefix hit rates of the store on a request trace, vs LRU
    kvcache bench tiers [...]           DRAM/NVMe throughput against memcpy and raw disk
    kvcache bench daemon [...]          the daemon against redis-server and memcpy
    kvcache bench model|engine|codec    the engine against transformers; codecs on model KV
    kvcache bench cold-warm             TTFT cold vs warm from the pool and each tier
    kvcache bench decode-profile        where a decode step's time goes
"""

from __future__ import annotations

import argparse
import json
import os
import logging
import sys

from kvcache import __version__
from kvcache.kvstore.errors import StoreError

EPILOG = """examples:
  kvcache serve
  kvcache stats ~/.local/share/kvcache --json
  kvcache check /data/kvcache --fix
  kvcache gc /data/kvcache --config configs/store.toml
  kvcache gc --url http://127.0.0.1:8790          # a directory a running daemon holds
  kvcache report /data/kvcache --since 24h --out report.html
  kvcache model init --config v4-tiny --out /tmp/v4-tiny
  kvcache bench tiers --sizes 64K,1M,4M
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcache", description="A content-addressed, tiered KV-cache store for LLM inference.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    p.add_argument("--version", action="version", version=f"kvcache {__version__}")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="structured JSON log lines for log shippers (default: text)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from kvcache.cli import bench, generate, model, replay, report, serve, store_commands
    serve.add_parser(sub)
    store_commands.add_parsers(sub)
    report.add_parser(sub)
    bench.add_parser(sub)
    model.add_parser(sub)
    generate.add_parser(sub)
    replay.add_parser(sub)
    return p


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": round(record.created, 3), "level": record.levelname.lower(),
               "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(fmt: str, verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler], force=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_format, args.verbose)
    try:
        return int(args.func(args) or 0)
    except (StoreError, ValueError, FileNotFoundError) as e:
        print(f"kvcache {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:         # `kvcache ... | head`: the reader left; no traceback, and no
        devnull = os.open(os.devnull, os.O_WRONLY)    # second one when Python flushes stdout at exit
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
