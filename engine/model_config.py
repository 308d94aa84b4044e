"""ModelConfig: one typed, validated view of a DeepSeek-V4 / V4.1 `config.json`.

Accepts the official key names (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`,
`rope_scaling`, V4.1's `text_config` nesting) and the transformers spellings of V4
(`layer_types`, `compress_rates`, `mlp_layer_types`, `rope_parameters`). Everything the
models read is a field here; unknown architectures and bad values fail with the field's name.

    model_type      "deepseek_v4"  (V4-Flash: SWA / CSA ratio 4 / HCA ratio 128, hash MoE, mHC head)
                    "deepseek_v41" (V4.1-Flash: ratio 2 / ratio 1 compressors on kv sources, Engram)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

MODEL_TYPES = ("deepseek_v4", "deepseek_v41")
ARCHITECTURES = {"DeepseekV4ForCausalLM": "deepseek_v4", "DeepseekV41ForCausalLM": "deepseek_v41"}
_TF_LAYER_TYPES = {"sliding_attention": 0, "compressed_sparse_attention": "csa",
                   "heavily_compressed_attention": "hca"}


class ConfigError(ValueError):
    """A config.json that cannot describe a supported model; the message names the field."""


@dataclass(frozen=True)
class YarnConfig:
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]          # one per backbone layer (drafter entries dropped)
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnConfig | None = None
    max_position_embeddings: int = 1 << 20
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    num_hash_layers: int = 0
    num_nextn_predict_layers: int = 0
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    # V4.1
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_compressed_vocab_size: int = 0
    engram_pad_token_id: int = 2
    image_token_id: int | None = None
    # checkpoint formats
    quantization: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)   # keys we keep but do not interpret (dspark_*)

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"config field {name!r}: {why}")
        need(self.model_type in MODEL_TYPES, "model_type", f"must be one of {MODEL_TYPES}, got {self.model_type!r}")
        need(len(self.compress_ratios) == self.num_hidden_layers, "compress_ratios",
             f"needs {self.num_hidden_layers} entries (one per layer), got {len(self.compress_ratios)}")
        need(0 < self.qk_rope_head_dim <= self.head_dim and self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
             "must be even and at most head_dim")
        need(self.num_attention_heads % self.o_groups == 0, "o_groups", "must divide num_attention_heads")
        need(0 < self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             "must be between 1 and n_routed_experts")
        need(self.scoring_func in ("sqrtsoftplus", "softmax", "sigmoid"), "scoring_func",
             f"must be sqrtsoftplus, softmax or sigmoid, got {self.scoring_func!r}")
        need(self.sliding_window >= 1 and self.hc_mult >= 1, "sliding_window", "and hc_mult must be >= 1")
        if self.model_type == "deepseek_v41":
            need(bool(self.kv_source_layer_ids), "kv_source_layer_ids", "is required for deepseek_v41")
            for i in self.kv_source_layer_ids:
                need(0 <= i < self.num_hidden_layers and self.compress_ratios[i] > 0, "kv_source_layer_ids",
                     f"layer {i} must exist and have a compress ratio > 0")

    # ------------------------------------------------------------------ derived
    @property
    def is_v41(self) -> bool:
        return self.model_type == "deepseek_v41"

    def layer_kind(self, layer: int) -> str:
        """"swa", "csa" (V4 ratio 4: overlapping windows + indexer), "hca" (V4, other ratios),
        or for V4.1 "compressed" (ratio 2 or 1, state shared from a kv source layer)."""
        r = self.compress_ratios[layer]
        if r == 0:
            return "swa"
        if self.is_v41:
            return "compressed"
        return "csa" if r == 4 else "hca"

    @property
    def expert_dtype(self) -> str:
        return str(self.quantization.get("expert_dtype", "")) if self.quantization else ""

    @property
    def weight_block_size(self) -> tuple[int, int] | None:
        b = self.quantization.get("weight_block_size") if self.quantization else None
        return (int(b[0]), int(b[1])) if b else None

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        return _parse(raw)

    @classmethod
    def load(cls, path: str) -> "ModelConfig":
        p = os.path.join(path, "config.json") if os.path.isdir(path) else path
        try:
            with open(p) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {p}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from None
        return cls.from_dict(raw)

    def to_dict(self) -> dict:
        """The official config.json form (what `kvcache model init` writes)."""
        arch = {v: k for k, v in ARCHITECTURES.items()}[self.model_type]
        d: dict[str, Any] = {"architectures": [arch], "model_type": self.model_type}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("model_type", "yarn", "quantization", "extra"):
                continue
            d[f.name] = list(v) if isinstance(v, tuple) else v
        if self.yarn is not None:
            d["rope_scaling"] = {"type": "yarn", **vars(self.yarn)}
        if self.quantization:
            d["quantization_config"] = dict(self.quantization)
        d.update(self.extra)
        return d


def _parse(raw: Mapping[str, Any]) -> ModelConfig:
    raw = dict(raw)
    arch = (raw.get("architectures") or [None])[0]
    model_type = raw.get("model_type") or ARCHITECTURES.get(arch or "", "")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"config field 'model_type': unsupported architecture {model_type or arch!r}; "
                          f"this engine runs {', '.join(ARCHITECTURES)}")
    text = dict(raw.get("text_config") or {})          # V4.1 nests the language model here
    merged = {**raw, **text}
    quant = dict(raw.get("quantization_config") or {})
    if "expert_dtype" in merged and "expert_dtype" not in quant and quant:
        quant["expert_dtype"] = merged["expert_dtype"]
    n = int(_req(merged, "num_hidden_layers"))
    ratios = _compress_ratios(merged, n)
    head_dim = int(_req(merged, "head_dim"))
    rope = merged.get("qk_rope_head_dim")
    if rope is None and merged.get("partial_rotary_factor"):
        rope = int(head_dim * float(merged["partial_rotary_factor"]))
    known = {f.name for f in fields(ModelConfig)}
    kw = {k: merged[k] for k in known if k in merged and k not in ("compress_ratios", "quantization", "extra",
                                                                     "yarn", "model_type")}
    for k in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids", "engram_num_embeddings"):
        if k in kw:
            kw[k] = tuple(int(x) for x in kw[k])
    if isinstance(kw.get("eos_token_id"), list):
        kw["eos_token_id"] = kw["eos_token_id"][0]
    kw["num_hash_layers"] = _hash_layers(merged, n)
    kw["qk_rope_head_dim"] = int(rope if rope is not None else 64)
    kw.update(_rope(merged))
    extra = {k: v for k, v in merged.items() if k.startswith("dspark_")}
    for k in ("vocab_size", "hidden_size", "num_attention_heads", "q_lora_rank", "o_groups", "o_lora_rank",
              "sliding_window", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
        _req(merged, k)
    kw.setdefault("n_shared_experts", 1)
    for k, default in (("index_n_heads", 0), ("index_head_dim", 0), ("index_topk", 0)):
        kw.setdefault(k, default)
    try:
        return ModelConfig(model_type=model_type, compress_ratios=ratios, quantization=quant, extra=extra, **kw)
    except TypeError as e:
        raise ConfigError(f"config has a field of the wrong type: {e}") from None


def _req(d: Mapping[str, Any], key: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"config field {key!r} is missing")
    return d[key]


def _compress_ratios(d: Mapping[str, Any], n: int) -> tuple[int, ...]:
    if d.get("compress_ratios") is not None:
        ratios = [int(r) for r in d["compress_ratios"]]
        if len(ratios) < n:
            raise ConfigError(f"config field 'compress_ratios': {len(ratios)} entries for {n} layers")
        return tuple(ratios[:n])      # entries past the backbone belong to MTP / DSpark stages
    if d.get("layer_types") is not None:   # transformers' V4 spelling
        rates = {"csa": 4, "hca": 128}
        for k, v in (d.get("compress_rates") or {}).items():
            rates["csa" if "sparse" in k or k == "csa" else "hca"] = int(v)
        out = []
        for t in d["layer_types"][:n]:
            kind = _TF_LAYER_TYPES.get(t)
            if kind is None:
                raise ConfigError(f"config field 'layer_types': unknown layer type {t!r}")
            out.append(0 if kind == 0 else rates[kind])
        return tuple(out)
    raise ConfigError("config field 'compress_ratios' is missing (or transformers' 'layer_types')")


def _hash_layers(d: Mapping[str, Any], n: int) -> int:
    if d.get("num_hash_layers") is not None:
        return int(d["num_hash_layers"])
    if d.get("mlp_layer_types") is not None:
        return sum(1 for t in d["mlp_layer_types"][:n] if t == "hash_moe")
    return 0


def _rope(d: Mapping[str, Any]) -> dict:
    out: dict[str, Any] = {}
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):   # transformers' nesting
        out["rope_theta"] = float(params.get("main", {}).get("rope_theta", d.get("rope_theta", 10000.0)))
        comp = params["compress"]
        out["compress_rope_theta"] = float(comp.get("rope_theta", d.get("compress_rope_theta", 160000.0)))
        scaling = comp if comp.get("rope_type", comp.get("type")) == "yarn" else None
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "yarn":
        out["yarn"] = YarnConfig(float(scaling.get("factor", 1.0)),
                                 int(scaling.get("original_max_position_embeddings", 0)),
                                 float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1))
    return out
