"""Byte-shuffling of 16-bit data (bf16/fp16 KV) before compression.

The high bytes of bf16 values (sign, exponent, top mantissa bits) repeat far more than the
low bytes; grouping them lets zstd find that: random-normal bf16 compresses 1.29x plain and
1.44-1.47x shuffled (measured in tests/tiering/test_object_store.py's data, zstd level 1).
"""

from __future__ import annotations

import numpy as np

from kvcache.kvstore.errors import CorruptBlockError


def shuffle2(payload) -> memoryview:
    """All high bytes of the little-endian 16-bit words, then all low bytes, then an odd tail."""
    a = np.frombuffer(payload, dtype=np.uint8)
    half = a.size // 2
    words = a[: 2 * half].view("<u2")
    out = np.empty(a.size, dtype=np.uint8)
    np.copyto(out[:half], words >> 8, casting="unsafe")
    np.copyto(out[half: 2 * half], words, casting="unsafe")   # keeps the low byte
    out[2 * half:] = a[2 * half:]
    return out.data


def unshuffle2_into(shuffled, out) -> None:
    """Inverse of shuffle2, written straight into `out` (exactly the raw length)."""
    src = np.frombuffer(shuffled, dtype=np.uint8)
    dst = np.frombuffer(out, dtype=np.uint8)
    if dst.size != src.size:
        raise CorruptBlockError("decoded size disagrees with header")
    even = src.size & ~1
    half = even // 2
    pairs = dst[:even].reshape(-1, 2)
    pairs[:, 1] = src[:half]
    pairs[:, 0] = src[half:even]
    dst[even:] = src[even:]
