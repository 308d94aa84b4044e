"""vLLM's KV connector over kvcache: `kv_connector_module_path="kvcache.integrations.vllm"`,
`kv_connector="KVCacheConnector"` (docs/vllm.md). Importing it imports vLLM."""

from kvcache.integrations.vllm.connector import KVCacheConnector

__all__ = ["KVCacheConnector"]
