"""The plug-ins' settings: vLLM's `kv_connector_extra_config`, SGLang's storage backend extra config.

    vLLM   --kv-transfer-config '{"kv_connector": "KVCacheConnector",
                                  "kv_connector_module_path": "kvcache.integrations.vllm",
                                  "kv_role": "kv_both",
                                  "kv_connector_extra_config": {"store": "http://127.0.0.1:8790", ...}}'
    SGLang --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
               '{"backend_name": "kvcache", "module_path": "kvcache.integrations.sglang",
                 "class_name": "KVCacheStorage", "store": "http://127.0.0.1:8790", ...}'

For vLLM an unknown key or a value of the wrong type stops it at start with a message naming it
(a typo'd setting that silently did nothing would be found only in the hit rate). SGLang's extra
config also carries SGLang's own keys, so there only the keys below are checked (`known_only`).
Not every setting applies to both: SGLang calls the store synchronously from its own threads, so
`load_timeout_s` and `max_pending_save_bytes` are vLLM's only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

DEFAULT_STORE = "http://127.0.0.1:8790"
_KINDS = {"bool": (bool,), "float": (int, float), "int": (int,), "str": (str,), "str | None": (str, type(None))}


@dataclass(frozen=True)
class ConnectorSettings:
    store: str = ""                 # the daemon: http://host:port or unix:///path.sock (SGLang also takes
                                    #   a data directory, an in-process store for one process);
                                    #   empty: $KVCACHE_STORE, else http://127.0.0.1:8790
    token: str | None = None        # the daemon's bearer token (names the tenant); None: $KVCACHE_TOKEN
    model_id: str = ""              # names the weights in block keys; empty: vllm:<model>@<revision>
    namespace_name: str = ""        # the namespace's label in the daemon (retention rules, reports)
    tenant_salt: str = ""           # a namespace extra: blocks under another salt are never shared
    load: bool = True               # claim and load stored prefixes
    save: bool = True               # save newly computed full blocks
    load_timeout_s: float = 10.0    # a load not done by then is abandoned: its blocks are recomputed
    timeout_s: float = 5.0          # one daemon call's deadline (a lookup runs on vLLM's scheduler path)
    retry_s: float = 10.0           # a store that did not answer is tried again after this long
    max_pending_save_bytes: int = 512 << 20   # saves beyond this wait nowhere: they are dropped (counted)

    @classmethod
    def from_extra_config(cls, extra: dict | None, known_only: bool = False) -> "ConnectorSettings":
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        if known_only:
            extra = {k: v for k, v in extra.items() if k in known}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown setting(s) {unknown}; "
                             f"known: {sorted(known)} (docs/vllm.md)")
        for name, value in extra.items():
            kind = _KINDS[known[name].type]
            if not isinstance(value, kind) or (isinstance(value, bool) and bool not in kind):
                raise ValueError(f"kv_connector_extra_config[{name!r}] must be {known[name].type}, got {value!r}")
        s = cls(**extra)
        if s.load_timeout_s <= 0 or s.timeout_s <= 0 or s.retry_s <= 0:
            raise ValueError("kv_connector_extra_config: load_timeout_s, timeout_s and retry_s "
                             "must be positive seconds")
        if s.max_pending_save_bytes < 0:
            raise ValueError("kv_connector_extra_config: max_pending_save_bytes must be >= 0")
        return s

    @property
    def store_spec(self) -> str:
        return self.store or os.environ.get("KVCACHE_STORE", "") or DEFAULT_STORE

    @property
    def bearer(self) -> str | None:
        return self.token if self.token is not None else os.environ.get("KVCACHE_TOKEN")
