"""`KVCacheStorage`: SGLang's HiCache storage backend (its L3) over a kvcache store.

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvcache",
        "module_path": "kvcache.integrations.sglang", "class_name": "KVCacheStorage",
        "store": "http://127.0.0.1:8790", "interface_v1": 1}'

SGLang moves pages between its host pool and the backend from threads of its own, and names
each page by its chained SHA-256 hex key. A page is one block: SGLang's key is placed in this
deployment's namespace (`hashing.engine_key`), one payload per pool under the same key:

    SGLang key k ──engine_key(ns, k, "")─────> the KV pool's page   (v1 calls, v2 pool "kv")
               └─engine_key(ns, k, "swa")──> that pool's page    (v2: DeepSeek-V4's pools, Mamba, SWA)

    namespace  model       sglang:<model name>  (or the `model_id` setting)
               kv_layout   sglang1;<host pool class>;<dtype>;<pool layout>;<page bytes>;tp<r>/<n>|mla;pp;cp
               block_size  the host pool's page size

Every call degrades to a miss: a store that fails or is down (the engine's store seam,
`engine/cache/connector.py`) answers False, None or 0 and never raises into SGLang. `clear()`
deletes nothing (the daemon owns retention) and says so.

Built on SGLang's `HiCacheStorage` when SGLang is importable (its dynamic loader requires the
subclass); without SGLang the same class stands on a local base, so its behaviour is tested
against the documented interface with a fake host pool.
"""

from __future__ import annotations

import logging

import torch

from kvcache.client.open_store import open_store
from kvcache.engine.cache.connector import KVConnector as StoreSeam
from kvcache.engine.config import CacheConfig
from kvcache.integrations.settings import ConnectorSettings
from kvcache.kvstore.hashing import Namespace, engine_key

log = logging.getLogger(__name__)
CLIENT_NAME = "sglang"
KV_POOL = "kv"

try:                    # SGLang's dynamic loader accepts only subclasses of its own base
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
    from sglang.srt.mem_cache.hicache_storage import PoolTransferResult as _Result
except ImportError:     # not installed: the same contract, for the tests and for reading
    _Base = object
    _Result = None


def _result(kv_pages: int, hits: dict, restorable: list[int]):
    if _Result is not None:
        return _Result(kv_pages, hits, restorable)
    from types import SimpleNamespace
    return SimpleNamespace(kv_hit_pages=kv_pages, extra_pool_hit_pages=hits, restorable_prefix_pages=restorable)


def _name(pool) -> str:
    return str(getattr(pool, "value", pool))


def pool_layout(pool, cfg) -> str:
    """What decides a page's bytes besides the tokens: pool kind, dtype, layout, size, ranks."""
    page = pool.get_dummy_flat_data_page()
    nbytes = page.numel() * page.element_size()
    ranks = "mla" if cfg.is_mla_model else f"tp{cfg.tp_rank}/{cfg.tp_size}"
    cp = f";cp{cfg.attn_cp_rank}/{cfg.attn_cp_size}" if getattr(cfg, "attn_cp_size", 1) > 1 else ""
    dcp = f";dcp{cfg.dcp_rank}/{cfg.dcp_size}" if getattr(cfg, "dcp_size", 1) > 1 else ""
    return (f"sglang1;{type(pool).__name__};{str(pool.dtype).removeprefix('torch.')};"
            f"{getattr(pool, 'layout', '')};{nbytes};{ranks};pp{cfg.pp_rank}/{cfg.pp_size}{cp}{dcp}")


class KVCacheStorage(_Base):
    def __init__(self, storage_config, kwargs=None):
        self.config = storage_config
        self.settings = ConnectorSettings.from_extra_config(storage_config.extra_config, known_only=True)
        self.seam: StoreSeam | None = None            # opened once the host pool says what a page is
        self.mem_pool_host = None
        self.registered_pools: dict[str, object] = {}
        self.writer = getattr(storage_config, "is_storage_writer", True)
        self.counters = {"pages_read": 0, "pages_missed": 0, "pages_written": 0, "pages_not_written": 0}

    # ------------------------------------------------------------ pools
    def register_mem_pool_host(self, mem_pool_host) -> None:
        self.mem_pool_host = mem_pool_host
        self.registered_pools.setdefault(KV_POOL, mem_pool_host)
        cfg, s = self.config, self.settings
        ns = Namespace(model_fingerprint=s.model_id or f"sglang:{cfg.model_name or ''}",
                       kv_layout=pool_layout(mem_pool_host, cfg), block_size=mem_pool_host.page_size,
                       tenant_salt=s.tenant_salt, name=s.namespace_name)
        http = "://" in s.store_spec and not s.store_spec.startswith("file://")
        options = {"timeout_s": s.timeout_s, "client_name": CLIENT_NAME} if http else {}
        store = open_store(s.store_spec, token=s.bearer if http else None, **options)
        config = CacheConfig(store=s.store_spec)
        self.seam = StoreSeam(store, ns, (), config, retry_s=s.retry_s, refusal_is_miss=True)
        log.info("kvcache HiCache storage on %s, namespace layout %s", s.store_spec, ns.kv_layout)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        self.registered_pools[_name(host_pool_name)] = host_pool

    def on_host_pools_registered(self) -> None:
        return

    def _keys(self, keys: list[str], pool: str = KV_POOL) -> list[bytes]:
        part = "" if pool == KV_POOL else pool
        ns = self.seam.namespace
        return [engine_key(ns, bytes.fromhex(k) if _is_hex(k) else k.encode(), part) for k in keys]

    # ------------------------------------------------------------ page copies
    def _read_pages(self, pool_name: str, keys: list[str], host_indices) -> list[bool]:
        pool = self.registered_pools.get(pool_name)
        if self.seam is None or pool is None or not keys:
            return [False] * len(keys)
        first = self._page_offsets(pool, keys, host_indices)
        if first is None:
            return [False] * len(keys)
        page = pool.get_dummy_flat_data_page()
        staging = torch.empty((len(keys), page.numel()), dtype=page.dtype)
        rows = staging.view(torch.uint8).numpy()
        got = self.seam.get_now(self._keys(keys, pool_name), [memoryview(r) for r in rows])
        want = rows.shape[1]
        ok = [n == want for n in got]
        for i, good in enumerate(ok):
            if good:
                pool.set_from_flat_data_page(first[i], staging[i].to(page.device))
        self.counters["pages_read"] += sum(ok)
        self.counters["pages_missed"] += len(ok) - sum(ok)
        return ok

    def _write_pages(self, pool_name: str, keys: list[str], host_indices) -> list[bool]:
        pool = self.registered_pools.get(pool_name)
        if self.seam is None or pool is None or not keys:
            return [False] * len(keys)
        if not self.writer:             # MLA: another rank writes the same bytes
            return [True] * len(keys)
        first = self._page_offsets(pool, keys, host_indices)
        if first is None:
            return [False] * len(keys)
        payloads = [pool.get_data_page(i, flat=True).contiguous().cpu().view(torch.uint8).numpy() for i in first]
        done = self.seam.put_now(list(zip(self._keys(keys, pool_name), payloads)))
        self.counters["pages_written" if done else "pages_not_written"] += len(keys)
        return [done] * len(keys)

    @staticmethod
    def _page_offsets(pool, keys, host_indices) -> list[int] | None:
        """The host pool offset of each key's page: its first index (SGLang passes page_size per key)."""
        size = getattr(pool, "page_size", 1) or 1
        if host_indices is None or host_indices.numel() != len(keys) * size:
            log.error("kvcache HiCache storage: %d host indices for %d pages of %d tokens",
                      0 if host_indices is None else host_indices.numel(), len(keys), size)
            return None
        return [int(i) for i in host_indices[::size].tolist()]

    # ------------------------------------------------------------ v1
    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        return self._read_pages(KV_POOL, list(keys), host_indices)

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        return self._write_pages(KV_POOL, list(keys), host_indices)

    def batch_exists(self, keys, extra_info=None) -> int:
        """How many of `keys`, from the first, are stored."""
        if self.seam is None or not keys:
            return 0
        return len(self.seam.lookup(self._keys(list(keys))))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------ v2 (several pools)
    def batch_get_v2(self, transfers, extra_info=None) -> dict[str, list[bool]]:
        return {_name(t.name): self._read_pages(_name(t.name), list(t.keys or []), t.host_indices) for t in transfers}

    def batch_set_v2(self, transfers, extra_info=None) -> dict[str, list[bool]]:
        return {_name(t.name): self._write_pages(_name(t.name), list(t.keys or []), t.host_indices) for t in transfers}

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        """The usable prefix: the KV pages stored from the first, shrunk to where every pool whose
        policy gates it (all_pages, trailing_pages) can restore; block_groups pools report their
        own count and gate nothing (SGLang's PoolHitPolicy)."""
        keys = list(keys)
        kv = self.batch_exists(keys)
        hits: dict[str, int] = {KV_POOL: kv} if kv else {}
        restorable = set(range(1, kv + 1))
        for t in pool_transfers or ():
            name, policy = _name(t.name), _name(t.hit_policy)
            present = self._present(name, keys[:kv])
            if policy == "all_pages":
                boundary = next((i for i, p in enumerate(present) if not p), kv)
                ok = set(range(1, boundary + 1))
            elif policy == "trailing_pages":
                window = max(1, len(t.keys) if t.keys else 1)
                ok = {n for n in range(1, kv + 1) if all(present[max(0, n - window):n])}
                boundary = max(ok, default=0)
            elif policy == "block_groups":
                group = max(1, getattr(t, "group_pages", 0) or 1)
                groups = next((g for g in range(kv // group) if not all(present[g * group:(g + 1) * group])),
                              kv // group)
                if groups:
                    hits[name] = groups * group
                continue
            else:
                raise ValueError(f"unknown pool hit policy {policy!r}")
            if boundary:
                hits[name] = boundary
            restorable &= ok
        final = max(restorable, default=0)
        return _result(final, hits, sorted(restorable))

    def _present(self, pool_name: str, keys: list[str]) -> list[bool]:
        return self.seam.present(self._keys(keys, pool_name)) if keys and self.seam is not None else []

    # ------------------------------------------------------------ single pages, by tensor (the old API)
    def get(self, key, target_location=None, target_sizes=None):
        [got] = self.batch_get([key], [target_location])
        return got

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        if self.seam is None or not keys or target_locations is None:
            return [None] * len(keys)
        outs = [t.view(torch.uint8).numpy() for t in target_locations]
        got = self.seam.get_now(self._keys(list(keys)), [memoryview(o.reshape(-1)) for o in outs])
        return [t if n == o.nbytes else None for t, n, o in zip(target_locations, got, outs)]

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        if self.seam is None or values is None:
            return False
        payloads = [v.contiguous().cpu().view(torch.uint8).numpy().reshape(-1) for v in values]
        return self.seam.put_now(list(zip(self._keys(list(keys)), payloads)))

    def clear(self) -> bool:
        log.warning("kvcache HiCache storage: clear() deletes nothing; the daemon's retention and "
                    "`kvcache delete` own what it keeps")
        return False

    def get_stats(self):
        return None

    def close(self) -> None:
        if self.seam is not None:
            self.seam.close()
            self.seam.store.close()


def _is_hex(k: str) -> bool:
    try:
        bytes.fromhex(k)
    except ValueError:
        return False
    return len(k) % 2 == 0
