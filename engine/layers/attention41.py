"""V4.1 attention: V4's attention core over history that layers share (CSA2 "Full / Reindex / Reuse").

    role        layers (Flash)        owns                                  reads
    swa         0, 1                  window only                           -
    kv source   2, 8, 14 (r 2), 20    compressor, indexer wk/k_norm, and    its own entries and keys
                (r 1)                 indexer wq_b/weights_proj (top-k)
    reindex     24, 28, 32, 36        indexer wq_b/weights_proj             layer 20's keys, inside layer
                                                                            20's candidate blocks
    reuse       the others            window only                           latest kv source's entries,
                                                                            latest index source's top-k
Every layer keeps its own q and its own sliding window. Sharing happens through `shared`, a dict
the model passes down the layers of one forward call: "kv" (entries, keys, ratio), "topk"
[B, T, k] and, from the candidate source, "candidates" [B, T, N].
"""

from __future__ import annotations

import torch

from kvcache.engine.model_config import ModelConfig
from kvcache.engine.layers.attention import QUERY_TILE, Attention, AttentionState
from kvcache.engine.layers.history import make_rows
from kvcache.engine.layers.kv_source import IndexKeys, SourceCompressor, SourceState, emit
from kvcache.engine.layers.rope import RotaryTables
from kvcache.engine.layers.sparse_index import SparseIndexer, candidate_mask


class SharedAttention(Attention):
    def __init__(self, config: ModelConfig, layer: int, ratio: int | None = None):
        super().__init__(config, layer, ratio)
        c = config
        r = c.compress_ratios[layer] if ratio is None else ratio
        self.ratio = r
        self.is_kv_source = r > 0 and layer in c.kv_source_layer_ids
        self.is_index_source = r > 0 and layer in c.index_source_layer_ids
        self.is_candidate = r > 0 and layer == c.candidate_source_layer_id
        self.is_reindex = self.is_index_source and not self.is_kv_source and c.candidate_source_layer_id >= 0
        self.block, self.top_blocks = c.candidate_block_size, c.candidate_topk_blocks
        if self.is_kv_source:
            self.compressor = SourceCompressor(c.hidden_size, c.head_dim, r, c.rms_norm_eps)
        if self.is_index_source:
            self.indexer = SparseIndexer(c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim,
                                         c.index_topk)
            if self.is_kv_source:
                keys = IndexKeys(c.head_dim, c.index_head_dim, c.rms_norm_eps)
                self.indexer.wk, self.indexer.k_norm = keys.wk, keys.k_norm

    def new_state(self, view=None) -> AttentionState:
        lanes = None if view is None else view.rows
        st = AttentionState()
        if self.is_kv_source:
            dev = self.attn_sink.device
            keys = make_rows(self.indexer.wk.out_features, lanes, "index", dev) if self.is_index_source else None
            st.compressor = SourceState(rows=make_rows(self.head_dim, lanes, "entries", dev), keys=keys)
        if view is not None:
            view.attach(st, "window")
            if self.is_kv_source and self.ratio == 2:
                view.attach(st.compressor, "pending")
        return st

    def project_history(self, x, qr, positions, rope: RotaryTables) -> dict:
        pre = {}
        if self.kind != "swa" and self.is_kv_source:
            pre["rows"] = self.compressor.project(x)
        if self.kind != "swa" and self.is_index_source:
            pre["iq"], pre["iw"] = self.indexer.query(x, qr, positions, rope)
        return pre

    def decode_histories(self, pre: dict, positions, states, rope: RotaryTables, shared) -> list:
        """Per request: shared history has no batched path yet."""
        return [self.history({k: v[:, i:i + 1] for k, v in pre.items()}, pos, st, rope, shared[i])
                for i, (pos, st) in enumerate(zip(positions, states))]

    def history(self, pre: dict, positions, state: AttentionState, rope: RotaryTables, shared):
        if self.kind == "swa":
            return None, None
        if self.is_kv_source:
            src: SourceState = state.compressor
            self.absorb(pre["rows"], src, rope)
            shared["kv"] = (src.entries, src.index_keys, self.ratio)
        if "kv" not in shared:
            raise RuntimeError("a V4.1 layer reads shared history before any kv-source layer wrote it")
        entries, keys, ratio = shared["kv"]
        if self.is_index_source:
            shared["topk"] = self._select(pre, positions, keys, ratio, shared)
        topk = shared["topk"]
        return entries, lambda i, j: topk[:, i:j]

    def absorb(self, rows: torch.Tensor, src: SourceState, rope: RotaryTables) -> None:
        """A kv source's projected rows [B, T, .] into its state: the entries and index keys of
        the groups they close."""
        latents = self.compressor.latents_from(rows, src)
        wk = self.indexer.wk if self.is_index_source else None
        keys = self.indexer.k_norm(wk(latents.to(wk.weight.dtype))) if wk is not None else None
        emit(src, latents, keys, self.ratio, rope)

    def _select(self, pre, positions, keys, ratio, shared) -> torch.Tensor:
        """Top-k per query [B, T, k], computed tile by tile (scores are [B, Tq, N])."""
        tops, cands = [], []
        for i in range(0, len(positions), QUERY_TILE):
            j = i + QUERY_TILE
            s = self.indexer.scores_from(pre["iq"][:, i:j], pre["iw"][:, i:j], positions[i:j], keys, ratio)
            if self.is_candidate:
                cands.append(candidate_mask(s, positions[i:j], ratio, self.block, self.top_blocks))
            elif self.is_reindex:
                s = s.masked_fill(~shared["candidates"][:, i:j], float("-inf"))
            tops.append(self.indexer.select(s))
        if self.is_candidate:
            shared["candidates"] = torch.cat(cands, 1)
        return torch.cat(tops, 1)
