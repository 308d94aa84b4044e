"""One readable file per architecture over the shared layers; `build_model` picks by model_type."""

from __future__ import annotations

import contextlib

from kvcache.engine.model_config import ModelConfig
from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from kvcache.engine.models.deepseek_v41 import DeepseekV41ForCausalLM


def model_class(config: ModelConfig):
    if config.model_type == "deepseek_v4":
        return DeepseekV4ForCausalLM
    if config.model_type == "deepseek_v41":
        return DeepseekV41ForCausalLM
    raise NotImplementedError(f"{config.model_type} is parsed but its model is not built yet")


def build_model(config: ModelConfig):
    return model_class(config)(config)


def build_empty(config: ModelConfig):
    """The model on the meta device: shapes and names, no storage (checkpoint loading, counting).
    Layers' random initialisation is skipped: on meta it only costs time (v4-flash's 34k linears:
    8 of `kvcache model info`'s 10 s)."""
    import torch
    with torch.device("meta"), _no_reset(torch.nn.Linear, torch.nn.Embedding):
        return model_class(config)(config)


@contextlib.contextmanager
def _no_reset(*classes):
    saved = [(c, c.__dict__["reset_parameters"]) for c in classes]
    try:
        for c in classes:
            c.reset_parameters = lambda self: None
        yield
    finally:
        for c, fn in saved:
            c.reset_parameters = fn
