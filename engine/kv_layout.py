"""What a model caches per request, as data: the KV pool and the block store read this.

    group        layers         grows with tokens?            one row per     row
    window       every layer    no: the last W rows           token           head_dim latent (K = V)
    compressed   CSA/HCA (V4),  yes                           `ratio` tokens  head_dim latent
                 kv sources (V4.1)
    index_keys   CSA (V4),      yes                           `ratio` tokens  index_head_dim key
                 kv sources (V4.1)
    carry        compressor     no: pending rows of an        -               raw kv + gate rows (fp32)
                 layers         unfinished window (+ CSA's previous-window Ca half)

History groups are what a prefix cache stores per block of tokens; window and carry are bounded
per-request state (rebuilt by replaying the last window, or snapshotted at request ends).
Row formats: the engine's own (bf16 on accelerators, fp32 on CPU) and the published formats of
other engines, so `kvcache model info` can show what a block costs in each.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.engine.model_config import ModelConfig

# bytes per row in published cache formats (deepseek-v4-architecture.md section 3.2)
ROW_FORMATS = {
    "bf16": {"latent": lambda d: 2 * d, "index": lambda d: 2 * d},
    "fp8_ds_mla+fp8_index": {"latent": lambda d: 584, "index": lambda d: 132},       # vLLM V4
    "fp8_ds_mla+mxfp4_index": {"latent": lambda d: 584, "index": lambda d: 68},
    "v41_fp4+mxfp4_index": {"latent": lambda d: 288, "index": lambda d: 68},         # FlashMLA V41_FP4
}


@dataclass(frozen=True)
class KVGroup:
    name: str                  # "window", "compressed", "index_keys", "carry"
    layers: tuple[int, ...]
    row: str                   # "latent" or "index" (what ROW_FORMATS prices)
    row_dim: int
    tokens_per_row: int        # history groups: the compress ratio; window: 1
    window: int = 0            # window groups: rows kept

    @property
    def grows(self) -> bool:
        return self.name in ("compressed", "index_keys")

    def bytes_per_token(self, fmt: str = "bf16") -> float:
        """History bytes per prompt token over this group's layers (0 for bounded groups)."""
        if not self.grows:
            return 0.0
        return sum(ROW_FORMATS[fmt][self.row](self.row_dim) / r for r in self._ratios)

    _ratios: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]

    def bytes_per_token(self, fmt: str = "bf16") -> float:
        return sum(g.bytes_per_token(fmt) for g in self.groups)

    def window_bytes(self, fmt: str = "bf16") -> int:
        return sum(len(g.layers) * g.window * ROW_FORMATS[fmt]["latent"](g.row_dim)
                   for g in self.groups if g.name == "window")

    def describe(self) -> list[dict]:
        return [{"group": g.name, "layers": list(g.layers), "row_dim": g.row_dim,
                 "tokens_per_row": g.tokens_per_row, "bf16_bytes_per_token": g.bytes_per_token("bf16")}
                for g in self.groups]


def kv_layout(config: ModelConfig) -> KVLayout:
    c = config
    n = c.num_hidden_layers
    groups = [KVGroup("window", tuple(range(n)), "latent", c.head_dim, 1, c.sliding_window)]
    if c.is_v41:
        hist = list(c.kv_source_layer_ids)
        idx = hist
    else:
        hist = [i for i in range(n) if c.compress_ratios[i] > 0]
        idx = [i for i in hist if c.layer_kind(i) == "csa"]
    if hist:
        ratios = tuple(c.compress_ratios[i] for i in hist)
        groups.append(KVGroup("compressed", tuple(hist), "latent", c.head_dim, min(ratios), _ratios=ratios))
    if idx and c.index_head_dim:
        ratios = tuple(c.compress_ratios[i] for i in idx)
        groups.append(KVGroup("index_keys", tuple(idx), "index", c.index_head_dim, min(ratios), _ratios=ratios))
    if hist:
        groups.append(KVGroup("carry", tuple(hist), "latent", c.head_dim, 1))
    return KVLayout(tuple(groups))
