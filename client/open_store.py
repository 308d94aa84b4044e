"""open_store(spec): one configuration string picks an in-process store or the daemon.

    /data/kvcache, file:///data/kvcache     -> BlockStore on that data directory
    configs/store.toml, file:///x/store.toml -> BlockStore from a TOML config (StoreConfig.load)
    http://127.0.0.1:8790                    -> KVClient (bearer token: `token=` or $KVCACHE_TOKEN)
    unix:///run/kvcache.sock                 -> KVClient over a Unix socket

Both results have the BlockStore interface (lookup, get/get_into/get_many(_into), put/put_many,
pin/unpin, delete, stats, close, context manager). The client module (and aiohttp) is imported
only for the http/unix forms, so the in-process path never loads aiohttp.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit


def open_store(spec: str, *, token: str | None = None, data_dir: str | None = None, **options):
    """Open the store `spec` names. `options` go to KVClient (timeout_s, retries, max_batch_blocks,
    ...) for the daemon forms, or to StoreConfig (dram=, nvme=, write_policy=, ...) for a bare
    data directory; `data_dir` overrides store.data_dir of a TOML config."""
    scheme = urlsplit(spec).scheme.lower() if "://" in spec else ""
    if scheme in ("http", "https"):
        from kvcache.client.sync_client import KVClient
        return KVClient(spec, token, **options)
    if scheme == "unix":
        from kvcache.client.sync_client import KVClient
        path = unquote(spec[len("unix://"):])
        return KVClient("http://localhost", token, unix_socket=path, **options)
    if scheme not in ("", "file"):
        raise ValueError(f"store spec {spec!r}: use a path, file://, http://host:port or unix:///path.sock")
    if token is not None:
        raise ValueError("a bearer token applies only to http:// or unix:// stores")
    path = os.path.expanduser(unquote(spec[len("file://"):]) if scheme == "file" else spec)
    return _open_local(path, data_dir, options)


def _open_local(path: str, data_dir: str | None, options: dict):
    from kvcache.gc.collector import Collector     # the store is handed its collector, as the daemon's is
    from kvcache.kvstore.config import StoreConfig
    from kvcache.kvstore.store import BlockStore
    if path.endswith(".toml") or os.path.isfile(path):
        if options:
            raise ValueError(f"settings {sorted(options)} belong in the TOML config {path}")
        return BlockStore(StoreConfig.load(path, data_dir), maintenance=Collector)
    if data_dir is not None:
        raise ValueError("data_dir applies to a TOML config; the spec already names the data directory")
    return BlockStore(StoreConfig(data_dir=path, **options), maintenance=Collector)
