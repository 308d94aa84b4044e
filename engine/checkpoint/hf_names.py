"""Tensor names of V4 checkpoints saved by transformers <-> the official names this engine uses
(`layers.N.attn.wq_a.weight`). Transformers has spelled them two ways:

    its modules' names (`model.layers.N.self_attn.q_a_proj.weight`, `lm_head.weight`): what its
        `state_dict()` holds, and what older `save_pretrained` versions wrote. Routed experts are
        stacked: `mlp.experts.gate_up_proj` [E, 2I, d] (w1 rows then w3 rows) and
        `mlp.experts.down_proj` [E, d, I]; the official layout has one `ffn.experts.{e}.w1|w2|w3.weight`
        per expert.
    5.24's `save_pretrained` ("5.x" below): its conversion mapping (official -> module name, one
        regex per rename) run in reverse, so the official names behind `model.`
        (`model.layers.N.attn.wq_a.weight`, experts split again) and `head.weight`; the globals its
        renames anchor at the start keep their module names (`model.embed_tokens.weight`,
        `model.hc_head.hc_fn`). The reversal is lossy in one place: `.norm.` -> `.kv_norm.` undone
        turns the attention's `kv_norm` into `attn.norm` (the compressors' `norm` is official).

Both spellings load, even mixed; a name neither can place is refused by name (UnknownTensorName).
"""

from __future__ import annotations

import re
from typing import Iterator, Mapping

import torch

# (transformers suffix, official suffix) inside one layer; longest first matters for `kv_proj`
_LAYER = [
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
    ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"),
    ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight"),
    ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn.kv_norm.weight"),
    ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"),
    ("self_attn.sinks", "attn.attn_sink"),
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate.weight", "ffn.gate.weight"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
]
# (transformers name, official name) outside the layers; 5.x saves the head as `head.weight`
_GLOBAL = [("model.embed_tokens.weight", "embed.weight"), ("lm_head.weight", "head.weight"),
           ("head.weight", "head.weight"), ("model.norm.weight", "norm.weight"),
           ("model.hc_head.hc_fn", "hc_head_fn"), ("model.hc_head.hc_base", "hc_head_base"),
           ("model.hc_head.hc_scale", "hc_head_scale")]
# 5.x saves: only the attention's kv_norm differs from the official suffix
_SAVED_5X = {"attn.norm.weight": "attn.kv_norm.weight"}
_TO_OFFICIAL = dict(_LAYER)
_TO_HF = {v: k for k, v in _LAYER}
_TO_HF_GLOBAL = {v: k for k, v in _GLOBAL if k != v}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_OFF_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_OFF_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


def is_transformers_layout(names) -> bool:
    return any(n.startswith("model.layers.") or n == "model.embed_tokens.weight" for n in names)


class UnknownTensorName(ValueError):
    """A tensor in a transformers-layout checkpoint that no DeepSeek-V4 name corresponds to."""


def _unknown(name: str) -> UnknownTensorName:
    return UnknownTensorName(f"tensor {name!r} has no place in a DeepSeek-V4 model: it is neither an official "
                             "name nor one transformers writes (another architecture, or a newer transformers "
                             "spelling this engine does not know yet?)")


def from_transformers(tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Official (name, tensor) pairs from a transformers V4 state dict or checkpoint, either
    spelling (module doc); a name neither places raises UnknownTensorName."""
    glob = dict(_GLOBAL)
    for name, t in tensors.items():
        if name in glob:
            yield glob[name], t
            continue
        m = _HF_LAYER.match(name)
        if m is None:
            raise _unknown(name)
        layer, rest = m.groups()
        if rest == "mlp.experts.gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"layers.{layer}.ffn.experts.{e}.w1.weight", t[e, :inter]
                yield f"layers.{layer}.ffn.experts.{e}.w3.weight", t[e, inter:]
        elif rest == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                yield f"layers.{layer}.ffn.experts.{e}.w2.weight", t[e]
        else:
            yield f"layers.{layer}.{_layer_suffix(name, rest)}", t


def _layer_suffix(name: str, rest: str) -> str:
    """The official suffix inside a layer for transformers' `rest` (module names, or a 5.x save)."""
    if rest in _TO_OFFICIAL:
        return _TO_OFFICIAL[rest]
    if rest in _SAVED_5X:
        return _SAVED_5X[rest]
    if rest in _TO_HF or _OFF_EXPERT.match(rest):      # 5.x saves the official suffix itself
        return rest
    raise _unknown(name)


def to_transformers(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers V4 state dict from official tensors (`mtp.*` dropped: transformers has no MTP)."""
    glob = _TO_HF_GLOBAL
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        if name.startswith("mtp."):
            continue
        if name in glob:
            out[glob[name]] = t
            continue
        m = _OFF_LAYER.match(name)
        if m is None:
            raise KeyError(f"no transformers name for {name!r}")
        layer, rest = m.groups()
        e = _OFF_EXPERT.match(rest)
        if e is not None:
            experts.setdefault(layer, {}).setdefault(int(e.group(1)), {})[e.group(2)] = t
        else:
            out[f"model.layers.{layer}.{_TO_HF[rest]}"] = t
    for layer, by_e in experts.items():
        ids = sorted(by_e)
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_e[i]["w1"], by_e[i]["w3"]]) for i in ids])
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([by_e[i]["w2"] for i in ids])
    return out
