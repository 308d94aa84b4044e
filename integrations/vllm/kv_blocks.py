"""vLLM's KV tensors seen as whole blocks: one block of every layer is one store payload.

`register_kv_caches` hands one tensor per layer, views into one buffer; where the block index
sits depends on the attention backend:

    CPU attention     [blocks, kv_heads, block_size, 2 x head_size]     block dim 0
    FlashAttention    [2, blocks, block_size, kv_heads, head_size]      block dim 1

so the block dimension is found as the one of vLLM's block count, and each layer is viewed with
it first. A payload is the bytes of block b of every layer, layer after layer (the record's
layout names each layer's part). Whole blocks are copied, never single tokens: inside a block
the CPU backend packs K in an ISA-specific order that only it reads.

    gather(ids)  layers ──copy──> host staging [n, payload bytes], each block into its place
    scatter      host staging ──index_copy──> layers (only the rows that loaded), from strided
                 views of the rows: one copy, never an intermediate one
    destinations(ids)   on the CPU, loads skip staging: each block's payload is read straight
                 into its place in every layer (a client Scatter of the layers' byte runs)

    payload of block b:  | layer 0's block b | layer 1's block b | ... |
                                 │                   │
    layer tensors:   L0 [.. b ..]        L1 [.. b ..]                   one run per layer
                     (or one run per K/V half where a layer keeps them apart)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.kvstore.types import MAX_PARTS, Scatter, TensorSpec


@dataclass(frozen=True)
class LayerPart:
    name: str
    offset: int             # bytes into the payload
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]  # one block of this layer


class KVBlocks:
    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int):
        if not kv_caches:
            raise ValueError("vLLM registered no KV cache tensors")
        self.views: list[torch.Tensor] = []
        self.parts: list[LayerPart] = []
        offset = 0
        for name, t in kv_caches.items():
            dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
            if not dims:
                raise ValueError(f"KV tensor {name} {tuple(t.shape)} has no dimension of vLLM's {num_blocks} blocks")
            v = t.movedim(dims[0], 0)
            shape = tuple(v.shape[1:])
            nbytes = v[0].numel() * t.element_size()
            self.views.append(v)
            self.parts.append(LayerPart(name, offset, nbytes, t.dtype, shape))
            offset += nbytes
        self.payload_bytes, self.num_blocks = offset, num_blocks
        self.device = next(iter(kv_caches.values())).device
        self._runs = _byte_runs(self.views) if self.device.type == "cpu" else None

    @property
    def direct(self) -> bool:
        """Whether loads can be read straight into the layers (`destinations`)."""
        return self._runs is not None

    def destinations(self, block_ids: list[int]) -> list[Scatter]:
        """Per block, where its payload goes in every layer: views of vLLM's own memory, so the
        caller must own those blocks until the read is done."""
        assert self._runs is not None, "destinations need CPU tensors whose blocks are byte runs"
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"block ids {block_ids} outside vLLM's {self.num_blocks} blocks")
        return [Scatter([mv[base + b * step + off: base + b * step + off + n]
                         for mv, base, step, runs in self._runs for off, n in runs]) for b in block_ids]

    @property
    def layout(self) -> tuple[TensorSpec, ...]:
        """The payload's layout as the store's records describe it."""
        return tuple(TensorSpec(p.name[-255:], str(p.dtype).removeprefix("torch."), p.shape) for p in self.parts)

    def staging(self, n: int) -> torch.Tensor:
        """A host buffer for n payloads (uint8 rows); pinned where an accelerator copies into it."""
        pin = self.device.type == "cuda"
        return torch.empty((n, self.payload_bytes), dtype=torch.uint8, pin_memory=pin)

    def _part(self, staging: torch.Tensor, p: LayerPart) -> torch.Tensor:
        """Layer p's columns of the staging rows, as that layer's blocks: a strided view, no copy."""
        return staging[:, p.offset:p.offset + p.nbytes].view(p.dtype).unflatten(1, p.shape)

    def gather(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy blocks out of every layer into host staging rows (row i: block_ids[i]; `out`, or a
        new buffer): one copy per block per layer, straight into its place in the row (measured on
        2 cores: ~20 GB/s, against ~3.5 for a gather then a copy into the row)."""
        out = self.staging(len(block_ids)) if out is None else out[: len(block_ids)]
        if self.device.type == "cpu":
            for v, p in zip(self.views, self.parts):
                dst = self._part(out, p)
                for row, b in enumerate(block_ids):
                    dst[row].copy_(v[b])
            return out
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for v, p in zip(self.views, self.parts):       # one gather on the device, one copy to the host
            self._part(out, p).copy_(v.index_select(0, ids))
        return out

    def scatter(self, staging: torch.Tensor, rows: list[int], block_ids: list[int]) -> None:
        """Copy staging rows `rows` into blocks `block_ids` of every layer (one index_copy per layer
        from a strided view of the rows: no intermediate copy)."""
        if not rows:
            return
        picked = staging if rows == list(range(staging.shape[0])) else staging[torch.tensor(rows, dtype=torch.long)]
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for v, p in zip(self.views, self.parts):
            v.index_copy_(0, ids, self._part(picked, p).to(self.device, non_blocking=True))


def _byte_runs(views: list[torch.Tensor]):
    """Per layer (its storage's bytes, block 0's byte offset, bytes between blocks, block 0's runs
    as (offset, length)), in payload order; None when some layer's block is not one run, or one
    per slice of its first dimension (K/V halves), or when a block would be more runs than a
    Scatter takes."""
    storages: dict[int, memoryview] = {}
    out = []
    for v in views:
        es, one = v.element_size(), v[0]
        if one.is_contiguous():
            runs = [(0, one.numel() * es)]
        elif one.dim() > 1 and one[0].is_contiguous():
            runs = [(j * one.stride(0) * es, one[0].numel() * es) for j in range(one.shape[0])]
        else:
            return None
        st = v.untyped_storage()
        if st.data_ptr() not in storages:
            storages[st.data_ptr()] = memoryview(torch.empty(0, dtype=torch.uint8).set_(st).numpy())
        out.append((storages[st.data_ptr()], v.storage_offset() * es, v.stride(0) * es, runs))
    return out if sum(len(r) for *_, r in out) <= MAX_PARTS else None     # a Scatter's limit
