"""Reconfiguring a running daemon: `POST /v1/admin/reconfigure` (admin) and SIGHUP.

    new config (the --config file read again: the whole config; or a JSON body shaped like the
      │ TOML: the settings it sends, the rest kept)
      │ parse and validate all of it ── any error: 400, nothing changes
      v
    hot settings ──> swapped in at once: tokens (add, revoke, quotas, flags), request limits,
                     shared-memory lease settings, retention policies
    tokens       ──> a JSON body's server.tokens is the whole new list (KVCACHE_TOKENS ones too:
                     left out, they are revoked); the config file's list keeps the environment's
                     tokens still in force; no tokens left where auth was on: 400
    the rest     ──> unchanged, named in "restart_required" (tiers, capacities, sockets, ports)

A swap is one attribute write (LiveConfig.current, store.config), so a request sees either the
old settings or the new ones, never a mix. Revoking a token takes effect on the next request;
open shared-memory control connections keep the tenant they authenticated with until they close.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import tomllib
from typing import Any, Mapping

from aiohttp import web

from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.errors import BlockFormatError
from kvcache.server.config import ServerConfig, parse_env_tokens
from kvcache.server.request_body import json_body
from kvcache.server.request_state import CONFIG, STORE, require_admin
from kvcache.server.shm_leases import LEASES

log = logging.getLogger(__name__)
HOT_SERVER = ("tokens", "max_block_bytes", "max_batch_blocks", "max_keys", "shm_lease_s", "max_shm_leases",
              "max_namespaces_per_tenant")
FIXED_SERVER = ("host", "port", "unix_socket")     # given on the command line: kept as they are
HOT_STORE = ("retention",)
IGNORED_STORE = ("data_dir", "gc_interval_s")       # the command line decides these


class LiveConfig:
    """The server settings in force; attribute reads go to the current ServerConfig."""

    def __init__(self, config: ServerConfig):
        self.current = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current, name)


CONFIG_FILE = web.AppKey("config_file", str)
ENGINE_SECTIONS = ("engine", "cache")    # `kvcache serve --model`'s engine reads these from the same file


def daemon_sections(raw: Mapping[str, Any]) -> dict:
    """A config file's sections but the engine's: what the store and [server] settings read."""
    return {k: v for k, v in raw.items() if k not in ENGINE_SECTIONS}


def reconfigure(app: web.Application, raw: Mapping[str, Any], partial: bool = False) -> dict:
    """Apply `raw` (a parsed config) to the running daemon; what changed and what needs a restart.
    partial (a JSON body): the [server] settings and the sections `raw` leaves out stay as they
    are; else (the config file) `raw` is the whole config, and what it leaves out is the default."""
    live, store = app[CONFIG], app[STORE]
    old_server, old_store = live.current, store.config
    if not isinstance(raw.get("server", {}), Mapping):
        raise ValueError("[server] must be a table of settings")
    if partial:
        new_server = old_server.updated({k: v for k, v in raw.get("server", {}).items() if k not in FIXED_SERVER})
    else:
        new_server = ServerConfig.from_dict(raw.get("server", {}), env={}, kept_tokens=env_tokens_in_force(old_server),
                                            **{f: getattr(old_server, f) for f in FIXED_SERVER})
    if old_server.auth_required and not new_server.auth_required:
        raise ValueError("these settings leave no tokens, which would turn auth off on a running daemon: "
                         "keep at least one token (restart without tokens to serve without auth)")
    new_store = StoreConfig.from_dict(daemon_sections(raw), data_dir=old_store.data_dir)
    if partial:
        new_store = _keep_unsent(new_store, old_store, raw)
    if old_store.dram is not None and new_store.dram is not None and new_store.dram.shared_memory is None:
        new_store = dataclasses.replace(new_store, dram=dataclasses.replace(
            new_store.dram, shared_memory=old_store.dram.shared_memory))   # serve's default, as at start
    applied, restart = [], []
    for f in dataclasses.fields(ServerConfig):
        if getattr(new_server, f.name) != getattr(old_server, f.name):
            (applied if f.name in HOT_SERVER else restart).append(f"server.{f.name}")
    for f in dataclasses.fields(StoreConfig):
        if f.name not in IGNORED_STORE and getattr(new_store, f.name) != getattr(old_store, f.name):
            (applied if f.name in HOT_STORE else restart).append(f.name)
    hot_server = dataclasses.replace(old_server, **{f: getattr(new_server, f) for f in HOT_SERVER})
    live.current = hot_server
    store.config = dataclasses.replace(old_store, retention=new_store.retention)
    if "retention" in applied and store.dram is not None:
        store.dram.unpublish_all()     # entries were valid until the old retention's deadlines
    if "server.shm_lease_s" in applied or "server.max_shm_leases" in applied:
        app[LEASES].lease_s, app[LEASES].max_leases = hot_server.shm_lease_s, hot_server.max_shm_leases
    log.warning("reconfigured: applied %s; needs a restart to change: %s", applied or "nothing",
                restart or "nothing")
    return {"applied": applied, "restart_required": restart}


def env_tokens_in_force(server: ServerConfig) -> tuple:
    """The tokens from KVCACHE_TOKENS (read at start) that no reconfigure has revoked since:
    a reload of the config file keeps them, and never brings back one that was revoked."""
    from_env = {t.token for t in parse_env_tokens(os.environ.get("KVCACHE_TOKENS", ""))}
    return tuple(t for t in server.tokens if t.token in from_env)


def _keep_unsent(new, old, raw: Mapping[str, Any]):
    """`new` with the store settings `raw` does not send taken from `old`: a section it leaves
    out, or a [store] key it leaves out. A section it sends is that section whole."""
    section = {"dram": "dram", "nvme": "nvme", "object_store": "object", "retention": "retention"}
    keep = {}
    for f in dataclasses.fields(old):
        sent = f.name in raw.get("store", {}) if f.name not in section else section[f.name] in raw
        if not sent:
            keep[f.name] = getattr(old, f.name)
    return dataclasses.replace(new, **keep)


def read_config_file(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None


async def reconfigure_handler(request: web.Request) -> web.Response:
    """Body: a JSON object shaped like the TOML config, or nothing to re-read the --config file."""
    require_admin(request)
    partial = request.can_read_body          # (False once the body has been read)
    if partial:
        raw = await json_body(request)
        if not isinstance(raw, dict):
            raise BlockFormatError("expected a JSON object shaped like the TOML config")
    else:
        path = request.app.get(CONFIG_FILE, "")
        if not path:
            raise BlockFormatError("this daemon was started without --config: send the new settings "
                                   "as a JSON body shaped like the TOML config")
        raw = read_config_file(path)
    return web.json_response(reconfigure(request.app, raw, partial=partial))


def reload_on_sighup(app: web.Application) -> None:
    """SIGHUP re-reads the --config file (a failed reload is logged and changes nothing)."""
    def reload() -> None:
        path = app.get(CONFIG_FILE, "")
        if not path:
            log.warning("SIGHUP ignored: the daemon was started without --config")
            return
        try:
            reconfigure(app, read_config_file(os.path.expanduser(path)))
        except (ValueError, TypeError, KeyError) as e:
            log.error("SIGHUP reload of %s failed, settings unchanged: %s", path, e)

    async def install(app: web.Application) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)
    app.on_startup.append(install)
