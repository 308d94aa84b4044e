"""kvcache: a content-addressed, tiered KV-cache store for LLM inference.

The repository root is this package; see ARCHITECTURE.md for the map.
"""

__version__ = "0.1.0"
