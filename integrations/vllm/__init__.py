"""vLLM's KV connector over kvcache: `kv_connector_module_path="kvcache.integrations.vllm"`,
`kv_connector="KVCacheConnector"` (docs/vllm.md).

Only the connector itself imports vLLM, when vLLM asks this package for it: settings, naming and
the block copies are importable (and tested) without vLLM.
"""

__all__ = ["KVCacheConnector"]


def __getattr__(name: str):
    if name == "KVCacheConnector":
        from kvcache.integrations.vllm.connector import KVCacheConnector
        return KVCacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
