"""`kvcache serve`: run the cache daemon on a data directory (the daemon: kvcache.server)."""

from __future__ import annotations

import argparse

from kvcache.server.config import default_data_dir


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", formatter_class=argparse.RawDescriptionHelpFormatter, help="run the cache daemon (HTTP API)",
        description="Run the kvcache daemon: it owns a data directory (DRAM and NVMe tiers, index, GC)\n"
                    "and serves it over HTTP (docs/api.md). With no arguments it uses an embedded default:\n"
                    f"{default_data_dir()}, 1 GiB of DRAM, 64 GiB of NVMe, 127.0.0.1:8790, no auth.\n"
                    "Binding beyond loopback requires tokens ([server] tokens or KVCACHE_TOKENS).\n"
                    "SIGTERM/SIGINT drain in-flight requests and flush write-back blocks before exit.\n"
                    "Everything it creates is its OS user's alone (umask 077); run it as a user of its\n"
                    "own, with tokens in the config file (docs/security.md: threat model, systemd unit).",
        epilog="examples:\n  kvcache serve\n  kvcache serve --config configs/store.toml\n"
               "  KVCACHE_TOKENS=$(openssl rand -hex 24):acme kvcache serve --host 0.0.0.0")
    p.add_argument("--config", metavar="FILE.toml", help="store and [server] settings (see configs/)")
    p.add_argument("--data-dir", metavar="DIR", help="overrides store.data_dir")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default 8790)")
    p.add_argument("--unix-socket", metavar="PATH", help="also listen on this unix socket")
    p.add_argument("--gc-interval", type=float, metavar="S", help="seconds between GC steps (default 10)")
    p.set_defaults(func=cmd_serve)


def overrides(args):
    """The command line's settings, over the config file's."""
    from kvcache.server.daemon import Overrides      # (aiohttp and the store: only for `serve`)
    return Overrides(config_file=args.config, data_dir=args.data_dir, host=args.host, port=args.port,
                     unix_socket=args.unix_socket, gc_interval_s=args.gc_interval)


def cmd_serve(args) -> int:
    from kvcache.server import daemon
    daemon.run(overrides(args))
    print("kvcache: stopped cleanly", flush=True)
    return 0
