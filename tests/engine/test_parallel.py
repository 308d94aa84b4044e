"""Tensor and expert parallelism: two gloo processes give the single-process logits and tokens."""

import pytest
import torch
import torch.multiprocessing as mp

from tests.engine.tp_worker import run, worker

MODES = ["tp", "ep", "tp+ep"]


@pytest.mark.timeout(600)
def test_tp_and_ep_over_two_processes_match_one(tmp_path):
    mp.spawn(worker, args=(2, str(tmp_path / "rendezvous"), str(tmp_path), MODES), nprocs=2, join=True)
    for kind in ("v4", "v41"):
        want_logits, want_tokens = run(kind, None, 0, 1)
        for mode in MODES:
            got = torch.load(tmp_path / f"{kind}-{mode}.pt")
            rel = float((got["logits"] - want_logits).abs().max() / want_logits.abs().max())
            assert rel < 1e-5, (kind, mode, rel)
            assert got["tokens"] == want_tokens, (kind, mode)


def test_sharding_refuses_uneven_splits():
    from kvcache.engine.parallel import _shard_attention
    from tests.engine.tp_worker import build
    model = build("v4")
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        _shard_attention(model.layers[0].attn, 0, 3)


def test_sharding_refuses_a_model_an_engine_was_built_on():
    """The engine stacks the experts (full-width views) and compiles for the shapes it sees:
    sharded afterwards, each rank would sum every expert at full width and the all-reduce would
    multiply the MoE's output by the number of ranks."""
    from kvcache.engine.llm import LLM
    from kvcache.engine.parallel import shard
    from tests.engine.tp_worker import build
    model = build("v4")
    LLM(model=model)
    with pytest.raises(ValueError, match="shard the model before building an engine"):
        shard(model, 0, 2)
