"""Load a checkpoint directory into a model: official or transformers names, sharded or not.

    config.json ─> ModelConfig ─> model with uninitialised parameters (allocated once)
    model.safetensors.index.json (or one model.safetensors) ─> safe_open per shard (mmap, lazy)
    per parameter: read ─ dequantise (FP8 blocks / FP4 experts, with their `.scale`) ─ check
                   shape ─ copy into the parameter ─ drop          (never two copies of the model)

Every missing tensor, wrong shape or wrong dtype is an error naming the tensor. Tensors of parts
this engine does not run are skipped with one message each: the vision tower (`vision.*`,
`aligner.*`, `image_*`) and, for models built without a drafter, `mtp.*`. Transformers' names
(either spelling, hf_names.py) are renamed on the way; transformers has no MTP block, so a V4
checkpoint in its layout with no `mtp.*` tensors builds without a drafter whatever config.json's
`num_nextn_predict_layers` says (transformers writes 1).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from contextlib import ExitStack
from typing import Callable

import torch
from safetensors import safe_open
from tqdm import tqdm

from kvcache.engine.checkpoint.formats import fp8_block, scale_name
from kvcache.engine.checkpoint.hf_names import UnknownTensorName, from_transformers, is_transformers_layout
from kvcache.engine.checkpoint.quant import dequant_fp4, dequant_fp8
from kvcache.engine.model_config import ModelConfig
from kvcache.engine.device import select
from kvcache.engine.layers.engram import compressed_token_map
from kvcache.engine.models import build_empty
from kvcache.engine.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
SKIPPED_PREFIXES = {"vision.": "the vision tower", "aligner.": "the vision aligner", "image_": "image embeddings",
                    "model.vision": "the vision tower"}


class CheckpointError(ValueError):
    """A checkpoint that does not fit its config (the message names the tensor)."""


class ShardedTensors:
    """name -> tensor, read lazily from the shards of one checkpoint directory."""

    def __init__(self, path: str, stack: ExitStack):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            weight_map = None
        else:
            raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self._handles = {}
        for fname in files:
            full = os.path.join(path, fname)
            if not os.path.exists(full):
                raise CheckpointError(f"shard {fname} named by the index is missing from {path}")
            try:
                self._handles[fname] = stack.enter_context(safe_open(full, framework="pt"))
            except Exception as e:       # safetensors' own error type (truncated, bad header...)
                raise CheckpointError(f"{full} is not a readable safetensors file ({e}); re-download or "
                                      "re-write the checkpoint") from None
        self.where = weight_map or {k: "model.safetensors" for k in self._handles["model.safetensors"].keys()}
        for fname, h in self._handles.items():     # the index must not promise what a shard lacks
            listed = {n for n, f in self.where.items() if f == fname}
            absent = listed - set(h.keys())
            if absent:
                raise CheckpointError(f"the index maps {sorted(absent)[0]} (and {len(absent) - 1} more) to "
                                      f"{fname}, which does not contain it")

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        return self._handles[self.where[name]].get_tensor(name)


def _official_view(tensors: ShardedTensors) -> dict[str, Callable[[], torch.Tensor]]:
    """official name -> loader; transformers layouts are renamed (and their stacked experts split)."""
    if not is_transformers_layout(tensors.names()):
        return {n: (lambda n=n: tensors.get(n)) for n in tensors.names()}
    out = {}
    for name in tensors.names():
        if name.startswith(tuple(SKIPPED_PREFIXES)):
            out[name] = lambda n=name: tensors.get(n)
            continue
        for off, t in from_transformers({name: _Lazy(tensors, name)}):
            out[off] = t if callable(t) else (lambda t=t: t)
    return out


class _Lazy:
    """A tensor read on first use; `t[e]` / `t[e, :k]` slice it (stacked transformers experts)."""

    def __init__(self, tensors: ShardedTensors, name: str, index=None):
        self.tensors, self.name, self.index = tensors, name, index

    @property
    def shape(self):
        return self.tensors._handles[self.tensors.where[self.name]].get_slice(self.name).get_shape()

    def __getitem__(self, index):
        return _Lazy(self.tensors, self.name, index)

    def __call__(self) -> torch.Tensor:
        t = self.tensors.get(self.name)
        return t if self.index is None else t[self.index]


def _decode(name: str, raw: torch.Tensor, get_scale, block) -> torch.Tensor:
    if raw.dtype == torch.float8_e4m3fn:
        scale = get_scale(name)
        if block is None:
            raise CheckpointError(f"{name} is FP8 but config.json has no quantization_config.weight_block_size")
        return dequant_fp8(raw, scale, fp8_block(name, block))
    if raw.dtype in (torch.int8, torch.uint8) and name.endswith(".weight"):
        return dequant_fp4(raw, get_scale(name))
    return raw


def decode_stored(name: str, stored: dict[str, torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """The value of parameter `name` from its stored tensors (`name` and maybe its `.scale`)."""
    return _decode(name, stored[name], lambda n: stored[scale_name(n)], config.weight_block_size)


def load_weights(model: torch.nn.Module, config: ModelConfig, path: str, progress: bool = True) -> None:
    """Fill every parameter and buffer of `model` from the checkpoint at `path` (see module doc)."""
    expected = model.state_dict(keep_vars=True)
    with ExitStack() as stack:
        try:
            view = _official_view(ShardedTensors(path, stack))
        except UnknownTensorName as e:
            raise CheckpointError(f"checkpoint at {path}: {e}") from None
        _report_extras(view, expected)

        def get_scale(name: str) -> torch.Tensor:
            s = scale_name(name)
            if s not in view:
                raise CheckpointError(f"{name} is quantised but its scale {s} is missing")
            return view[s]()
        missing = [n for n in expected if n not in view]
        if missing:
            raise CheckpointError(f"checkpoint at {path} lacks {len(missing)} tensors the config needs, "
                                  f"e.g. {', '.join(missing[:3])}")
        for name, target in tqdm(expected.items(), desc="loading weights", unit="tensor", disable=not progress):
            value = _decode(name, view[name](), get_scale, config.weight_block_size)
            if tuple(value.shape) != tuple(target.shape):
                raise CheckpointError(f"{name} has shape {tuple(value.shape)}, the config needs {tuple(target.shape)}")
            if target.dtype in (torch.int64, torch.int32) and value.is_floating_point():
                raise CheckpointError(f"{name} must hold integers (expert ids), got {value.dtype}")
            if target.is_floating_point() and not value.is_floating_point():
                raise CheckpointError(f"{name} must be floating point, got {value.dtype}")
            with torch.no_grad():
                target.copy_(value.to(target.dtype))


def _report_extras(view: dict, expected: dict) -> None:
    extras = [n for n in view if n not in expected and not n.endswith(".scale")]
    skipped: dict[str, int] = {}
    for n in extras:
        what = next((w for p, w in SKIPPED_PREFIXES.items() if n.startswith(p)), None)
        if what is None and n.startswith("mtp."):
            what = "the drafter (mtp.*), not built into this model"
        if what is None:
            raise CheckpointError(f"unexpected tensor {n!r}: the checkpoint does not match config.json "
                                  "(another architecture or layer count?)")
        skipped[what] = skipped.get(what, 0) + 1
    for what, count in skipped.items():
        log.warning("skipping %d tensors of %s (text-only serving)", count, what)


def _without_absent_drafter(config: ModelConfig, path: str) -> ModelConfig:
    """`config` with no MTP block when `path` is a transformers-layout V4 checkpoint without one
    (transformers' config.json keeps `num_nextn_predict_layers` but it never saves an MTP block)."""
    if config.model_type != "deepseek_v4" or not config.num_nextn_predict_layers:
        return config
    with ExitStack() as stack:
        names = ShardedTensors(path, stack).names()
    if not is_transformers_layout(names) or any(n.startswith("mtp.") for n in names):
        return config
    log.info("%s is a transformers checkpoint without an MTP block: building the model without a drafter", path)
    return dataclasses.replace(config, num_nextn_predict_layers=0)


def load_model(path: str, device: str = "cpu", progress: bool = True):
    """(model, config) from a checkpoint directory: fp32 weights on CPU, bf16 on an accelerator
    (engine/device.py); quantised tensors are dequantised on the way in."""
    place = select(device)
    config = _without_absent_drafter(ModelConfig.load(path), path)
    model = build_empty(config).to_empty(device=place.device)
    if place.dtype != torch.float32:
        model = model.to(place.dtype)
    load_weights(model, config, path, progress)
    if config.engram_layer_ids:      # Engram keys n-grams by the checkpoint tokenizer's normalised spellings
        model.set_token_map(compressed_token_map(load_tokenizer(path)))
    return model.eval(), config
