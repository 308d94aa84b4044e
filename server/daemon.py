"""Running the daemon: its settings (the config file under the command line's overrides), the
process's hardening (not dumpable, umask 077), the store and event log it opens, and the serve
loop until a signal drains it. `kvcache serve` (cli/serve.py) parses arguments and calls run.

With a model (`--model`) the engine joins the daemon: the model routes (server/model_api) beside
the cache API on the same port, the engine using the daemon's BlockStore in-process. With
`--cache URL` as well, the engine uses that cache daemon and this process opens no store: it
serves only the model routes. The model loads after the port opened (/ready says when it is
up; a load that fails stops the process, non-zero). At shutdown the engine closes (its pending
saves done) before the store."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import stat
from dataclasses import dataclass

from kvcache.gc.collector import Collector
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.store import BlockStore
from kvcache.server.app import build_app
from kvcache.server.config import ServerConfig, default_data_dir
from kvcache.server.front import site
from kvcache.server.front.bulk_put import UPLOAD
from kvcache.server.reconfigure import (CONFIG_FILE, ENGINE_SECTIONS, daemon_sections, read_config_file,
                                        reload_on_sighup)
from kvcache.server.request_state import METRICS


@dataclass(frozen=True)
class Overrides:
    """What `kvcache serve`'s command line sets over the config file (None: the file's, or the default)."""
    config_file: str | None = None
    data_dir: str | None = None
    host: str | None = None
    port: int | None = None
    unix_socket: str | None = None
    gc_interval_s: float | None = None
    model: str | None = None             # a checkpoint directory, demo or demo:NAME: the model routes
    served_model_name: str | None = None
    cache_url: str | None = None         # the engine's cache daemon (then no store of our own)
    cache_mode: str | None = None        # replay | exact (the engine's [cache].mode)
    speculative: str | None = None       # mtp | dspark (the engine's [engine].speculative)
    num_draft: int | None = None
    async_scheduling: bool | None = None   # the engine's [engine].async_scheduling
    device: str = "cpu"
    access_log: str | None = None        # a path, or "-" for stdout
    max_waiting: int = 256               # model requests in flight (beyond: 429)
    tenant_max_requests: int | None = None
    tenant_max_tokens: int | None = None
    request_timeout_s: float | None = 600.0   # a model request running longer is aborted (None: never)


def load_configs(over: Overrides) -> tuple[StoreConfig, ServerConfig]:
    """The store's and the [server] settings: the config file (if any) under the command line's.
    The engine's sections ([engine], [cache]) may share the file: they are the engine's to read."""
    raw = daemon_sections(read_config_file(over.config_file)) if over.config_file else {}
    server = ServerConfig.from_dict(raw.get("server", {}), host=over.host, port=over.port,
                                    unix_socket=over.unix_socket)
    data_dir = over.data_dir or raw.get("store", {}).get("data_dir") or default_data_dir()
    store = StoreConfig.from_dict(raw, data_dir=os.path.expanduser(data_dir))
    gc = over.gc_interval_s if over.gc_interval_s is not None else (store.gc_interval_s or 10.0)
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
    ttl_h = store_cfg.retention.default.ttl_s / 3600
    lines.append(f"  write policy    {store_cfg.write_policy}; retention {ttl_h:g} h")
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
    try:
        mode = stat.S_IMODE(os.stat(data_dir).st_mode)
    except OSError:
        return
    if mode & 0o077:
        logging.getLogger("kvcache.serve").warning(
            "data directory %s has mode %o: other users of this host can read every tenant's blocks; "
            "run `chmod -R go= %s` (see docs/security.md)", data_dir, mode, data_dir)


def run(over: Overrides) -> None:
    """Serve the configured data directory until SIGTERM/SIGINT, then drain and close the store.
    The config file is what SIGHUP and an empty POST /v1/admin/reconfigure read again."""
    undumpable()   # first: before tokens and blocks are loaded
    private_files()
    store_cfg, server_cfg = load_configs(over)
    if over.model and over.cache_url:
        return run_model_only(over, store_cfg, server_cfg)
    events = open_event_log(store_cfg)
    try:
        store = BlockStore(store_cfg, events=events, maintenance=Collector)
    except BaseException:
        if events is not None:
            events.close()
        raise
    warn_if_shared(store_cfg.data_dir)
    app = build_app(store, server_cfg)
    app[CONFIG_FILE] = os.path.abspath(over.config_file) if over.config_file else ""
    reload_on_sighup(app)   # the main thread's loop: signal handlers can only be installed there
    try:
        loader, lines = attach_model(app, over, store_cfg.data_dir, store, app[METRICS].registry) if over.model \
            else (None, "")
    except BaseException:
        store.close()
        if events is not None:
            events.close()
        raise

    async def close_store(_app) -> None:  # after in-flight requests drained and the engine closed
        store.close()                     # (its last saves went to the open store): flush and release
        if events is not None:  # after the store, so that its last events are kept too
            events.close()
    app.on_cleanup.append(close_store)
    print(describe(store_cfg, server_cfg) + lines, flush=True)
    site.run(app, server_cfg.host, server_cfg.port, server_cfg.unix_socket, server_cfg.shutdown_timeout_s,
             upload=UPLOAD)
    if loader is not None:
        exit_if_not_loaded(loader)


def attach_model(app, over: Overrides, data_dir: str, store, registry):
    """Add the model routes to `app` (with admission, metrics and the access log) and load the
    model in the background once the app has started (server/model_api/loading.py): the port
    opens at once, /ready and the routes wait for the engine. (loader, lines describing it)."""
    from kvcache.server.model_api import host as model_host
    from kvcache.server.model_api.admission import Admission
    from kvcache.server.model_api.loading import ModelLoader
    from kvcache.server.model_api.metrics import ServingMetrics
    from kvcache.server.model_api.routes import Serving, add_routes
    raw = read_config_file(over.config_file) if over.config_file else {}
    sections = {k: v for k, v in raw.items() if k in ENGINE_SECTIONS}
    config = model_host.engine_config(sections, over.cache_url, over.cache_mode)
    spec = {k: v for k, v in (("speculative", over.speculative), ("num_draft", over.num_draft),
                              ("async_scheduling", over.async_scheduling)) if v is not None}
    config = dataclasses.replace(config, **spec) if spec else config
    name = model_host.check_model_spec(over.model, over.served_model_name)
    serving = Serving(admission=Admission(over.max_waiting, over.tenant_max_requests, over.tenant_max_tokens),
                      access_log=open_access_log(over.access_log), request_timeout_s=over.request_timeout_s)
    serving.metrics = ServingMetrics(registry, serving.running_waiting, name, serving.spec_stats)
    add_routes(app, serving)

    def loaded(host) -> None:
        serving.host = host
        print(f"kvcache: model {name} ready (context {host.context_limit} tokens)", flush=True)
    loader = ModelLoader(lambda: model_host.open_model_host(over.model, data_dir, config, store,
                                                            over.served_model_name, over.device), loaded)
    loader.attach(app)
    return loader, describe_model(name, config)


def exit_if_not_loaded(loader) -> None:
    """After the serve loop: a model that failed to load stopped the server; exit non-zero with why."""
    if loader.error is not None:
        raise SystemExit(f"kvcache serve: the model did not load: {type(loader.error).__name__}: {loader.error}")


def open_access_log(path: str | None):
    """The model routes' JSON access log: a file (appended to), "-" for stdout, None: off."""
    if not path:
        return None
    import sys
    from kvcache.server.model_api.access_log import AccessLog
    return AccessLog(sys.stdout if path == "-" else open(path, "a", buffering=1))


def describe_model(name: str, config) -> str:
    cache = config.cache
    mode = f"cache {cache.mode}" + (f" via {cache.store}" if cache.store else "") if cache else "no cache"
    return (f"\n  model           {name} ({mode}; loading: /ready answers 200 once it is warm)"
            "\n  model routes    /v1/chat/completions /v1/completions /v1/responses /v1/messages /v1/models")


def run_model_only(over: Overrides, store_cfg, server_cfg) -> None:
    """--model with --cache URL: the model routes alone; the engine's store is that cache daemon,
    and no data directory store is opened here (the demo checkpoint is still built under it)."""
    from kvcache.server.model_api.model_app import build_model_app
    app, registry = build_model_app(server_cfg)
    loader, lines = attach_model(app, over, store_cfg.data_dir, None, registry)
    print(f"kvcache serving http://{server_cfg.host}:{server_cfg.port} (model routes only)" + lines, flush=True)
    site.run(app, server_cfg.host, server_cfg.port, server_cfg.unix_socket, server_cfg.shutdown_timeout_s)
    exit_if_not_loaded(loader)


def open_event_log(store_cfg):
    """The event log behind `kvcache report`: on unless [store] event_log = false."""
    if not store_cfg.event_log:
        return None
    from kvcache.kvstore.event_log import ParquetEventLog   # pyarrow: only when the log is on
    return ParquetEventLog(store_cfg.events_dir)
