"""Plug-ins for other inference engines, one module per engine: `vllm` (a KV connector) and `sglang`
(a HiCache storage backend). Each imports its engine; nothing else in kvcache imports these."""
