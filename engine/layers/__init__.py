"""Shared building blocks of the V4 family, one noun per file (norm, rope, hyper-connections,
MoE, attention, compressors). Parameters carry the official checkpoint names."""
