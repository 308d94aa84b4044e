"""The V4 family's shared parts, one noun per file (norm, rope, hyper-connections,
MoE, attention, compressors). Parameters carry the official checkpoint names."""
