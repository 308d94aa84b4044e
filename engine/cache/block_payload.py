"""What one KV block stores in the block store: the history rows its tokens produced, in every
history lane of the pool, as one payload with a named-tensor layout.

    payload of block b = concat over lanes (sorted by layer, then "entries" before "index") of
                         lane[b] : [block_size / ratio, dim]  row-major, in the pool's block dtype
                                   (the weights': float32 on CPU, bf16 on a GPU)
    layout             = (TensorSpec("L{layer}.{kind}", "float32", (rows, dim)), ...)

Windows and compressor carry are not in blocks: they are per-request and rebuilt on a hit (bounded
replay) or saved whole as a tail snapshot (exact mode). The layout id that goes into the
store namespace names this structure, so a change of lanes or dtype never reads old blocks.
"""

from __future__ import annotations

import hashlib

import torch

from kvcache.engine.kv_pool import KVPool
from kvcache.kvstore.types import TensorSpec

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def block_layout(pool: KVPool) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(f"L{layer}.{kind}", _DTYPE_NAMES[t.dtype], (t.shape[1], t.shape[2]))
                 for (layer, kind), t in sorted(pool.lanes.items()))


def layout_id(pool: KVPool) -> str:
    """A short, stable id of the block layout (goes into the store namespace's kv_layout)."""
    text = ";".join(f"{s.name}:{s.dtype}:{'x'.join(map(str, s.shape))}" for s in block_layout(pool))
    return f"kvpool-v1-{pool.block_size}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def encode_block(pool: KVPool, block_id: int, tokens: int | None = None) -> bytes:
    """The payload of one pool block (every history lane's rows for it). With `tokens`, of a
    partial block whose first `tokens` tokens are computed: in each lane, the rows past those
    they produced (tokens // ratio of its block_size // ratio) are zeros. A pool block is reused
    without being cleared, so those rows hold whatever its previous user (another tenant's
    request) wrote; they are overwritten before anything reads them, but must never be saved."""
    parts = [_rows(pool, t, block_id, tokens).contiguous().view(torch.uint8).reshape(-1)
             for _, t in sorted(pool.lanes.items())]
    return torch.cat(parts).cpu().numpy().tobytes() if parts else b""


def _rows(pool: KVPool, lane: torch.Tensor, block_id: int, tokens: int | None) -> torch.Tensor:
    """A lane's rows of one block, those past `tokens`' rows zeroed (None: all of them)."""
    rows = lane[block_id]
    if tokens is None:
        return rows
    rows = rows.clone()
    rows[tokens * lane.shape[1] // pool.block_size:] = 0
    return rows


def decode_block(pool: KVPool, block_id: int, payload) -> None:
    """Write a stored payload into pool block `block_id` (raises if its size does not fit the layout)."""
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    want = sum(t[0].numel() * t.element_size() for t in pool.lanes.values())
    if raw.numel() != want:
        raise ValueError(f"a stored block of {raw.numel()} bytes does not fit this pool's layout ({want} bytes)")
    pos = 0
    for _, t in sorted(pool.lanes.items()):
        n = t[0].numel() * t.element_size()
        t[block_id] = raw[pos: pos + n].view(t.dtype).view(t.shape[1:]).to(t.device)
        pos += n


def decode_blocks(pool: KVPool, block_ids: list[int], payloads: list) -> None:
    """decode_block for many blocks at once: one copy per lane instead of one per lane and block."""
    if not block_ids:
        return
    want = sum(t[0].numel() * t.element_size() for t in pool.lanes.values())
    for p in payloads:
        if memoryview(p).nbytes != want:
            raise ValueError(f"a stored block of {memoryview(p).nbytes} bytes does not fit this pool's layout "
                             f"({want} bytes)")
    raw = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(len(payloads), want)
    pos, index = 0, torch.tensor(block_ids, dtype=torch.long, device=pool.device)
    for _, t in sorted(pool.lanes.items()):
        n = t[0].numel() * t.element_size()
        t[index] = raw[:, pos: pos + n].contiguous().view(t.dtype).view(len(payloads), *t.shape[1:]).to(t.device)
        pos += n
