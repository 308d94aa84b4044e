"""Compressor.absorb_many (a decode step's rows in one call) against one absorb() per request:
same entries, same buffers, whether each request's window stays open or closes this step."""

import torch

from kvcache.engine.layers.compressor import Compressor, CompressorState
from kvcache.engine.layers.history import SlotRows
from kvcache.engine.layers.rope import RotaryTables
from tests.engine.tiny import v4_config


def states_on_lanes(n: int, m: int, width: int, overlap_dim: int = 0, dtype=torch.float32) -> list[CompressorState]:
    """n states whose buffers (and CSA overlap carries) live in pool-like slot lanes, as the engine
    gives them."""
    lane = lambda rows, w: torch.zeros(n + 2, rows, w, dtype=dtype)   # noqa: E731
    kv_lane, gate_lane = lane(m - 1, width), lane(m - 1, width)        # a buffer holds < m rows
    ov = (lane(m, overlap_dim), lane(m, overlap_dim)) if overlap_dim else None
    out = []
    for i in range(n):
        st = CompressorState()
        st.buf_kv, st.buf_gate = SlotRows(kv_lane, i + 1), SlotRows(gate_lane, i + 1)
        if ov:
            st.overlap_kv, st.overlap_gate = SlotRows(ov[0], i + 1), SlotRows(ov[1], i + 1)
        out.append(st)
    return out


def test_absorb_many_equals_absorb_per_request():
    torch.manual_seed(0)
    config = v4_config()
    rope = RotaryTables(config)
    for overlap, m in ((True, 4), (False, 8)):
        comp = Compressor(config.hidden_size, config.head_dim, m, overlap, config.rms_norm_eps)
        width = (2 if overlap else 1) * config.head_dim
        ov = config.head_dim if overlap else 0
        batched, alone = states_on_lanes(3, m, width, ov), states_on_lanes(3, m, width, ov)
        batched[2].floor = alone[2].floor = 3      # its first entries came from the cache: not rewritten
        dense = CompressorState()                  # a state without slots takes absorb() inside absorb_many
        x = torch.randn(1, 3, config.hidden_size)
        prompt = [torch.randn(1, t, config.hidden_size) for t in (1, m - 1, 2 * m + 2)]   # windows at different fills
        for st_b, st_a, p in zip(batched, alone, prompt):
            comp.absorb(*comp.project(p), st_b, rope)
            comp.absorb(*comp.project(p), st_a, rope)
        for step in range(2 * m + 1):
            x = torch.randn(1, 4, config.hidden_size)
            kv, gate = comp.project(x)
            got = comp.absorb_many(kv, gate, batched + [dense], rope)
            want = [comp.absorb(kv[:, i:i + 1], gate[:, i:i + 1], st, rope) for i, st in enumerate(alone)]
            for g, w in zip(got[:3], want):
                assert torch.equal(g, w), (overlap, step)
            for b, a in zip(batched, alone):
                assert b.count == a.count and b.rows.count == a.rows.count
                if overlap and a.overlap_kv is not None:
                    assert torch.equal(b.overlap_kv, a.overlap_kv) and torch.equal(b.overlap_gate, a.overlap_gate)
                assert (b.buf_kv is None) == (a.buf_kv is None)
                if b.buf_kv is not None:
                    assert torch.equal(b.buf_kv, a.buf_kv) and torch.equal(b.buf_gate, a.buf_gate)
            assert got[3].shape[1] == dense.count


def test_select_many_equals_select_from_per_request():
    from kvcache.engine.layers.compressor import Indexer
    torch.manual_seed(1)
    config = v4_config()
    ix = Indexer(config.hidden_size, config.q_lora_rank, 4, 16, topk=3, ratio=4, eps=1e-6)
    keys = [torch.randn(1, n, 16) for n in (0, 2, 5, 9)]
    keys[2][0, 1:3] = 0.0                               # relu ties at exactly 0: the stable order decides
    positions = [torch.tensor([p]) for p in (2, 9, 21, 39)]
    q, w = torch.randn(1, 4, 4, 16), torch.randn(1, 4, 4)
    got = ix.select_many(q, w, positions, keys)
    for r, (pos, k) in enumerate(zip(positions, keys)):
        want = ix.select_from(q[:, r:r + 1], w[:, r:r + 1], pos, k)
        assert torch.equal(got[r], want), r
