"""The V4 family's shared parts, one noun per file (norm, rope, hyper-connections, MoE,
attention, compressors, V4.1's attention, kv sources and indexer, Engram), and where a request's
history rows live (history) and how a planned decode step reads and writes them (decode_step).
Parameters carry the official checkpoint names."""
