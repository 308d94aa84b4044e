"""`kvcache serve`: run the cache daemon on a data directory."""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib


def default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "kvcache")


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


def load_configs(args):
    from kvcache.server.config import ServerConfig
    from kvcache.kvstore.config import StoreConfig
    raw = {}
    if args.config:
        try:
            with open(args.config, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise ValueError(f"config file {args.config} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {args.config} is not valid TOML: {e}") from None
    server = ServerConfig.from_dict(raw.get("server", {}), host=args.host, port=args.port,
                                    unix_socket=args.unix_socket)
    data_dir = args.data_dir or raw.get("store", {}).get("data_dir") or default_data_dir()
    store = StoreConfig.from_dict(raw, data_dir=os.path.expanduser(data_dir))
    gc = args.gc_interval if args.gc_interval is not None else (store.gc_interval_s or 10.0)
    store = dataclasses.replace(store, gc_interval_s=gc)
    if store.dram is not None and store.dram.shared_memory is None:  # local clients read the arena directly
        store = dataclasses.replace(store, dram=dataclasses.replace(store.dram, shared_memory=True))
    return store, server


def describe(store_cfg, server_cfg) -> str:
    def gib(n: int) -> str:
        return f"{n / (1 << 30):.1f} GiB"
    lines = [f"kvcache serving http://{server_cfg.host}:{server_cfg.port}"
             + (f" and unix://{server_cfg.unix_socket}" if server_cfg.unix_socket else ""),
             f"  data directory  {store_cfg.data_dir}"]
    if store_cfg.dram:
        shm = ("; shared memory for local clients" + (" (with a read directory)" if store_cfg.dram.read_directory
                                                       else "")) if store_cfg.dram.shared_memory else ""
        lines.append(f"  dram tier       {gib(store_cfg.dram.capacity_bytes)}{shm}")
    if store_cfg.nvme:
        lines.append(f"  nvme tier       {gib(store_cfg.nvme.capacity_bytes)} (fsync {store_cfg.nvme.fsync})")
    if store_cfg.object_store:
        lines.append(f"  object tier     {store_cfg.object_store.url} (codec {store_cfg.object_store.codec})")
    lines.append(f"  write policy    {store_cfg.write_policy}; retention {store_cfg.retention.default.ttl_s / 3600:g} h")
    lines.append(f"  event log       {store_cfg.events_dir}" if store_cfg.event_log else "  event log       off")
    lines.append(f"  auth            {len(server_cfg.tokens)} token(s)" if server_cfg.tokens else
                 "  auth            none (loopback only)")
    return "\n".join(lines)


def undumpable() -> bool:
    """prctl(PR_SET_DUMPABLE, 0): processes of the daemon's own user can no longer open
    /proc/<pid>/fd/* or /proc/<pid>/mem, nor ptrace it, and a crash leaves no core with tokens and
    blocks in it. Local clients get the arena over the control socket instead (server/shm_control.py).
    Root (CAP_SYS_PTRACE) still can; /proc/<pid>/environ stays readable to the same user on the
    kernels we run, so KVCACHE_TOKENS is no secret from it. False where there is no prctl."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(4, 0, 0, 0, 0) == 0     # PR_SET_DUMPABLE
    except (OSError, AttributeError):
        return False


def private_files() -> None:
    """Everything the daemon creates (segments, index, event logs, sockets) is its user's alone:
    the data directory holds every tenant's blocks, and a file mode is the only boundary between
    them and the host's other users. umask 077 makes files 0600 and directories 0700."""
    os.umask(0o077)


def warn_if_shared(data_dir: str) -> None:
    """A data directory made before (or by another tool) may still be open to other users."""
    import logging
    import stat
    try:
        mode = stat.S_IMODE(os.stat(data_dir).st_mode)
    except OSError:
        return
    if mode & 0o077:
        logging.getLogger("kvcache.serve").warning(
            "data directory %s has mode %o: other users of this host can read every tenant's blocks; "
            "run `chmod -R go= %s` (see docs/security.md)", data_dir, mode, data_dir)


def cmd_serve(args) -> int:
    undumpable()   # first: before tokens and blocks are loaded
    private_files()
    from kvcache.server.app import build_app
    from kvcache.kvstore.store import BlockStore
    store_cfg, server_cfg = load_configs(args)
    events = open_event_log(store_cfg)
    try:
        store = BlockStore(store_cfg, events=events)
    except BaseException:
        if events is not None:
            events.close()
        raise
    warn_if_shared(store_cfg.data_dir)
    app = build_app(store, server_cfg)
    from kvcache.server.reconfigure import CONFIG_FILE, reload_on_sighup
    app[CONFIG_FILE] = os.path.abspath(args.config) if args.config else ""
    reload_on_sighup(app)   # the main thread's loop: signal handlers can only be installed there

    async def close_store(_app) -> None:  # after in-flight requests drained: flush and release
        store.close()
        if events is not None:  # after the store, so that its last events are kept too
            events.close()
    app.on_cleanup.append(close_store)
    print(describe(store_cfg, server_cfg), flush=True)
    from kvcache.server.front.site import run
    run(app, server_cfg.host, server_cfg.port, server_cfg.unix_socket, server_cfg.shutdown_timeout_s)
    print("kvcache: stopped cleanly", flush=True)
    return 0


def open_event_log(store_cfg):
    """The event log behind `kvcache report`: on unless [store] event_log = false."""
    if not store_cfg.event_log:
        return None
    from kvcache.kvstore.event_log import ParquetEventLog
    return ParquetEventLog(store_cfg.events_dir)
