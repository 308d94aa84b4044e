"""Which weights a model has: part of every cached block's namespace.

A block's KV is a function of its tokens *and the weights*. The model config alone does not
tell two checkpoints apart (a fine-tune, a re-quantization, another seed have the same config),
and a store shared by both would serve one model's KV to the other: wrong tokens, no error.
So an engine with a cache keys its blocks by a fingerprint of its weights:

    for each tensor of the state dict, sorted by name:
        name | shape | dtype | checksum(bytes)      checksum computed where the tensor lives
    (+ the V4.1 token map, which is not a tensor)      (GPU: no copy to the host)
    sha256 of all that -> 32 hex digits

checksum: the tensor's bytes as int32 words w_i, two sums mod 2^64: sum w_i and
sum w_i * (i mod 65521 + 1) (the second one also sees words swapped). Not cryptographic: it
tells honest checkpoints apart; `[cache] model_id` names the weights instead (no pass over
them at start) when the operator vouches for it.
"""

from __future__ import annotations

import hashlib
import logging
import time

import torch

log = logging.getLogger(__name__)

_CHUNK_WORDS = 1 << 24
_MASK = (1 << 64) - 1


def weights_id(model: torch.nn.Module, cache) -> str:
    """The weights' part of an engine's namespace: only an engine with a cache (a CacheConfig)
    needs one, since only its blocks outlive it; `cache.model_id` if given, else the fingerprint."""
    if cache is None:
        return ""
    if cache.model_id:
        return "id=" + cache.model_id
    t = time.perf_counter()
    fp = weights_fingerprint(model)
    log.info("weights fingerprint %s in %.2f s (set [cache] model_id to skip it)", fp, time.perf_counter() - t)
    return fp


def weights_fingerprint(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
            h.update(_checksum(t).to_bytes(8, "little"))
    token_map = getattr(model, "token_map", None)
    if token_map is not None:
        h.update(b"token_map|" + memoryview(token_map).tobytes())
    return h.hexdigest()[:32]


def _checksum(t: torch.Tensor) -> int:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    total = 0
    for start in range(0, raw.numel(), 4 * _CHUNK_WORDS):
        part = raw[start: start + 4 * _CHUNK_WORDS]
        if part.numel() % 4:
            part = torch.cat([part, part.new_zeros(4 - part.numel() % 4)])
        words = part.view(torch.int32).to(torch.int64)
        pos = torch.arange(start // 4, start // 4 + words.numel(), device=words.device) % 65521 + 1
        s1, s2 = int(words.sum()), int((words * pos).sum())
        total = (total * 1_000_003 + s1 * 0x9E3779B97F4A7C15 + s2) & _MASK
    return total
