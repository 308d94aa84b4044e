"""Demo checkpoints: deterministic random weights in the official layout, with a tokenizer that
carries DeepSeek's special tokens (`kvcache model init`, and `kvcache serve --model demo`).

    write_demo_checkpoint(config, out)     config.json + safetensors shards + tokenizer.json
    demo_checkpoint(models_dir, name)      the same, built once under models_dir/name (atomic:
                                           built in a temporary directory, then renamed)

Same config and seed, same bytes on every machine (engine/checkpoint/init.py), so a demo built
on two hosts keys its KV blocks the same way.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "configs", "models")
TOKENIZER_MAX_VOCAB = 32768


@dataclass(frozen=True)
class DemoCheckpoint:
    """What write_demo_checkpoint wrote."""
    path: str
    model_type: str
    shards: int
    tensors: int
    parameters: int
    tokenizer_vocab: int
    logit_vocab: int


def config_path(name: str) -> str:
    """configs/models/NAME.json; a FileNotFoundError listing the names there otherwise."""
    path = os.path.join(CONFIG_DIR, f"{name}.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no demo model config {name!r}; known: {', '.join(demo_names())}")
    return path


def demo_names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


def write_demo_checkpoint(config_file: str, out_dir: str, seed: int = 0, shard_bytes: int = 1 << 30,
                          progress=None) -> DemoCheckpoint:
    """Random weights for the config.json at `config_file`, written to `out_dir` (created)."""
    import torch
    from kvcache.engine.checkpoint.init import random_weights
    from kvcache.engine.checkpoint.writer import save_checkpoint, snap_to_formats
    from kvcache.engine.model_config import ModelConfig
    from kvcache.engine.models import build_model
    from kvcache.engine.tokenizer import build_demo_tokenizer
    config = ModelConfig.load(config_file)
    tok = build_demo_tokenizer(min(config.vocab_size, TOKENIZER_MAX_VOCAB))
    token_map = None
    if config.engram_layer_ids:       # Engram's hash tables are sized by the tokenizer's compressed vocabulary
        from kvcache.engine.layers.engram import compressed_token_map
        token_map = compressed_token_map(tok)
        config = dataclasses.replace(config, engram_compressed_vocab_size=int(token_map.max()) + 1)
    torch.manual_seed(seed)
    model = random_weights(build_model(config), seed)
    if token_map is not None:
        model.set_token_map(token_map)
    snap_to_formats(model, config)          # what is saved is exactly what loads back
    tensors = len(model.state_dict())
    files = save_checkpoint(model, config, out_dir, shard_bytes, progress=progress)
    tok.save(out_dir)
    return DemoCheckpoint(out_dir, config.model_type, len(files), tensors, sum(p.numel() for p in model.parameters()),
                          tok.vocab_size, config.vocab_size)


def demo_checkpoint(models_dir: str, name: str, seed: int = 0) -> str:
    """models_dir/name, built from configs/models/NAME.json unless it is there already. Built in a
    temporary directory beside it and renamed into place, so a crash mid-build leaves no half
    checkpoint that a later start would load; two processes building at once keep one."""
    target = os.path.join(models_dir, name)
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    config_file = config_path(name)
    os.makedirs(models_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.", dir=models_dir)
    try:
        write_demo_checkpoint(config_file, tmp, seed)
        try:
            os.rename(tmp, target)
        except OSError:             # another process renamed its build first: keep that one
            if not os.path.isfile(os.path.join(target, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
