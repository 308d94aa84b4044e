"""Which tensor is stored in which format, in the official DeepSeek-V4 / V4.1 layout.

    FP8 e4m3 + `.scale` (E8M0 blocks)   attention projections wq_a, wq_b, wkv, wo_a, wo_b,
                                        indexer wq_b, shared experts, MTP e_proj / h_proj, DSpark
                                        main_proj, Engram wkv; Engram tables in rows (1 x 32 blocks)
    FP4 e2m1 + `.scale` (or FP8)        routed experts (`expert_dtype` "fp4" / "fp8")
    fp32                                mHC parameters, attention sinks, compressor ape, gate bias
    int64                               gate.tid2eid (hash routing table)
    bf16                                everything else (embeddings, head, norms, compressors, gates)

A quantised weight `X.weight` has its scale at `X.scale` (the official sidecar name).
"""

from __future__ import annotations

import re

FP8_LINEAR = re.compile(r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]"
                        r"|e_proj|h_proj|main_proj|engram\.wkv|engram\.embed)\.weight$")
ROW_BLOCKS = re.compile(r"engram\.embed\.weight$")      # FP8 rows, one E8M0 scale per 32 values
ROUTED_EXPERT = re.compile(r"(^|\.)ffn\.experts\.\d+\.w[123]\.weight$")
FP32 = re.compile(r"(hc_(attn|ffn|head)_(fn|base|scale)|attn_sink|\.ape|ffn\.gate\.bias(_vl)?"
                  r"|confidence_head\.proj\.weight)$")
INT = re.compile(r"ffn\.gate\.tid2eid$")


def storage_format(name: str, expert_dtype: str) -> str:
    """'fp8', 'fp4', 'fp32', 'int64' or 'bf16' for a parameter name."""
    if FP8_LINEAR.search(name):
        return "fp8"
    if ROUTED_EXPERT.search(name):
        return "fp4" if expert_dtype == "fp4" else "fp8"
    if FP32.search(name):
        return "fp32"
    if INT.search(name):
        return "int64"
    return "bf16"


def fp8_block(name: str, weight_block: tuple[int, int] | None) -> tuple[int, int] | None:
    """The scale block of an FP8 tensor: the config's weight blocks, or (1, 32) for Engram rows."""
    return (1, 32) if ROW_BLOCKS.search(name) else weight_block


def scale_name(weight_name: str) -> str:
    return weight_name[: -len(".weight")] + ".scale"
