"""The inference engine (DeepSeek-V4 family). Not built yet: see issues 4-6.

Nothing here is imported by the store; the store never depends on the engine.
"""
