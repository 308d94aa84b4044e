"""Device selection (lazy torch_npu, clear errors) and config errors that name the field."""

import sys

import pytest
import torch

from kvcache.engine.model_config import ConfigError, ModelConfig
from kvcache.engine.device import select
from tests.engine.tiny import V4_TINY


def test_cpu_is_fp32_and_missing_accelerators_are_clear_errors():
    assert select("cpu").dtype == torch.float32
    if not torch.cuda.is_available():
        assert select("auto").device == "cpu"
        with pytest.raises(RuntimeError, match="CUDA build of torch"):
            select("cuda")
    if "torch_npu" not in sys.modules:
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            with pytest.raises(RuntimeError, match="torch_npu"):
                select("npu")
    with pytest.raises(ValueError, match="unknown device"):
        select("tpu")


def test_engine_imports_leave_torch_npu_and_deep_gemm_alone():
    import kvcache.engine.checkpoint.loader  # noqa: F401
    import kvcache.engine.models.deepseek_v4  # noqa: F401
    import kvcache.engine.models.deepseek_v41  # noqa: F401
    assert "torch_npu" not in sys.modules and "deep_gemm" not in sys.modules


@pytest.mark.parametrize("field,value,match", [
    ("num_hidden_layers", None, "'num_hidden_layers' is missing"),
    ("compress_ratios", [0, 4], "'compress_ratios': 2 entries for 6 layers"),
    ("scoring_func", "relu", "'scoring_func'"),
    ("o_groups", 3, "'o_groups'"),
    ("architectures", ["GPT2LMHeadModel"], "unsupported architecture"),
])
def test_config_errors_name_the_field(field, value, match):
    raw = {**V4_TINY, field: value}
    if field == "architectures":
        raw.pop("model_type")
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_transformers_spelling_of_v4_parses_the_same():
    ours = ModelConfig.from_dict(V4_TINY)
    tf = {k: v for k, v in V4_TINY.items() if k not in ("compress_ratios", "num_hash_layers", "rope_scaling")}
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 16: "heavily_compressed_attention"}
    tf.update(layer_types=[kinds[r] for r in V4_TINY["compress_ratios"][:6]],
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
              mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 4,
              rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0},
                               "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 4,
                                            "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}})
    parsed = ModelConfig.from_dict(tf)
    assert parsed.compress_ratios == ours.compress_ratios and parsed.num_hash_layers == 2 and parsed.yarn == ours.yarn
