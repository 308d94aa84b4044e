"""The inference engine (DeepSeek-V4 family): model config and checkpoints, layers and models,
the serving loop (requests, scheduler, KV pool, LLMEngine, LLM) and, in cache/, the engine's side
of the KV cache. ARCHITECTURE.md has the map.

Nothing here is imported by the store; the store never depends on the engine.
"""
