"""One readable file per architecture over the shared layers; `build_model` picks by model_type."""

from __future__ import annotations

from kvcache.engine.config import ModelConfig


def model_class(config: ModelConfig):
    if config.model_type == "deepseek_v4":
        from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
        return DeepseekV4ForCausalLM
    if config.model_type == "deepseek_v41":
        from kvcache.engine.models.deepseek_v41 import DeepseekV41ForCausalLM
        return DeepseekV41ForCausalLM
    raise NotImplementedError(f"{config.model_type} is parsed but its model is not built yet")


def build_model(config: ModelConfig):
    return model_class(config)(config)
