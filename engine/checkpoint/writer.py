"""Write a model's weights as an official-layout checkpoint: sharded safetensors, the index JSON,
quantised tensors in the formats of `formats.py`, and `config.json`."""

from __future__ import annotations

import json
import os
import stat

import torch
from safetensors.torch import save_file

from kvcache.engine.checkpoint.formats import fp8_block, scale_name, storage_format
from kvcache.engine.checkpoint.loader import decode_stored
from kvcache.engine.checkpoint.quant import quantize_fp4, quantize_fp8
from kvcache.engine.model_config import ModelConfig


def encode_tensor(name: str, t: torch.Tensor, config: ModelConfig) -> dict[str, torch.Tensor]:
    """One parameter -> the tensors the checkpoint stores for it (a quantised weight brings its scale)."""
    fmt = storage_format(name, config.expert_dtype)
    t = t.detach()
    if fmt == "fp8" and config.weight_block_size is not None:      # no block size: an unquantised checkpoint
        q, s = quantize_fp8(t.float(), fp8_block(name, config.weight_block_size))
        return {name: q, scale_name(name): s}
    if fmt == "fp4":
        q, s = quantize_fp4(t.float())
        return {name: q, scale_name(name): s}
    if fmt == "int64":
        return {name: t.to(torch.int64)}
    return {name: t.float() if fmt == "fp32" else t.to(torch.bfloat16)}


def save_checkpoint(model: torch.nn.Module, config: ModelConfig, out_dir: str, shard_bytes: int = 1 << 30,
                    progress=None) -> list[str]:
    """Write `model`'s parameters and buffers under their official names; returns the shard files."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"{out_dir} is a file, not a directory: give a directory for the checkpoint")
    os.makedirs(out_dir, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    params = list(model.state_dict().items())
    for name, t in params:
        for n, enc in encode_tensor(name, t, config).items():
            nbytes = enc.numel() * enc.element_size()
            if size and size + nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1][n] = enc.contiguous()
            size += nbytes
        if progress is not None:
            progress.update(1)
    files, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        files.append(fname)
        for n, t in shard.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    index_path = os.path.join(out_dir, "model.safetensors.index.json")
    with open(index_path, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1, sort_keys=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=2)
    # safetensors writes its files 0600 whatever the umask; give the shards the mode open() gave
    # the index (the user's umask), so a checkpoint's files are all readable by the same people
    mode = stat.S_IMODE(os.stat(index_path).st_mode)
    for fname in files:
        os.chmod(os.path.join(out_dir, fname), mode)
    return files


def snap_to_formats(model: torch.nn.Module, config: ModelConfig) -> None:
    """Round every parameter through its storage format in place, so the model in memory equals
    what loading its checkpoint gives back (demo checkpoints, tests)."""
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            enc = encode_tensor(name, t, config)
            t.copy_(decode_stored(name, enc, config).to(t.dtype))
