"""engine/decode_graphs.py on the CPU: everything but the CUDA calls themselves.

A stand-in graph "captures" by keeping the step function bound to the bucket's static buffers and
"replays" by running it again into the captured output buffer. So what these tests check is the
part a GPU run would depend on and that runs the same here: steps padded to (batch, blocks)
buckets, per-step values reaching the step only through the static buffers, padding rows that
touch no request's state, and graphs dropped when the experts are restacked. (Whether CUDA can
capture the step is tests/engine/test_accelerator.py's, on a GPU.)
"""

import dataclasses

import pytest
import torch

from kvcache.engine import decode_graphs as dg
from kvcache.engine.decode_plan import step_views
from kvcache.engine.layers.moe import stack_experts
from kvcache.engine.llm import LLM
from kvcache.engine.config import EngineConfig
from kvcache.engine.models import build_model
from kvcache.engine.sampling import SamplingParams
from tests.engine.tiny import randomize, v4_config

CFG = EngineConfig(block_size=16, num_blocks=64, max_tokens_per_step=48, max_running=4, device_experts=True,
                    planned_decode=True)
# different lengths: decode batches shrink 4 -> 2 -> 1 and the longest request outgrows 4 blocks
STAGGERED = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (70, 30, 12, 45)]


class _Replay:
    """A captured step: `replay` runs it again, writing the output buffer as a graph would."""

    def __init__(self, run, out: torch.Tensor):
        self.run, self.out = run, out

    def replay(self):
        self.out.copy_(self.run())


class _CpuGraphs(dg.DecodeGraphs):
    """DecodeGraphs with the CUDA graph replaced by _Replay (same buffers, same bucket plans)."""

    def __init__(self, model, block_size, max_batch, max_blocks):
        self.model, self.block_size = model, block_size
        self.max_batch, self.max_blocks = dg.bucket(max_batch), dg.bucket(max_blocks)
        self.graphs, self.failed, self.captures, self.replays = {}, None, 0, 0

    def logits(self, chunks, states):
        out = super().logits(chunks, states)
        self.replays += out is not None
        return out

    def _capture(self, plan):
        self.captures += 1
        inputs = plan.null_host()
        tokens = torch.zeros((1, plan.batch), dtype=torch.long)

        def run():
            return self.model.decode_step(tokens, step_views(inputs, plan.batch, plan.blocks, plan.ratios), plan.lanes)
        for _ in range(2):           # the warm-up on the null plan: must move no request's state
            run()
        out = run().clone()
        g = dg._Graph(_Replay(run, out), inputs, tokens, out, plan.lanes, dg._stacks(self.model))
        self.graphs[(plan.batch, plan.blocks)] = g
        return g


def _generate(model, prompts, graphs: bool):
    llm = LLM(model=model, config=CFG)
    if graphs:
        llm.engine.decode_graphs = _CpuGraphs(model, CFG.block_size, CFG.max_running, CFG.num_blocks)
    seen = {}
    llm.engine.logits_hook = lambda req, pos, logits: seen.__setitem__((req.prompt[0], pos), logits.clone())
    tokens = [o[0].token_ids for o in llm.generate(prompts, STAGGERED)]
    return tokens, seen, llm.engine.decode_graphs


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [[5 + i] + torch.randint(3, 300, (n,), generator=g).tolist() for i, n in enumerate((40, 7, 23, 1))]


@pytest.fixture(scope="module")
def model():
    return randomize(build_model(v4_config(num_nextn_predict_layers=0)), 3).eval()


@torch.no_grad()
def test_bucketed_replays_give_the_unpadded_steps_tokens_and_logits(model):
    want_tokens, want, _ = _generate(model, _prompts(), graphs=False)
    tokens, got, graphs = _generate(model, _prompts(), graphs=True)
    assert graphs.failed is None
    assert sorted(graphs.graphs) == [(1, 8), (2, 8), (4, 4), (4, 8)]     # (batch, blocks) buckets met
    assert graphs.captures == 4 and graphs.replays > 60                  # each captured once, replayed
    assert tokens == want_tokens
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_restacked_experts_drop_the_graphs(model):
    """Another engine changing the experts' layout frees the stacks a graph reads: the next step
    captures anew on the new stacks instead of replaying the old addresses."""
    llm = LLM(model=model, config=CFG)
    graphs = llm.engine.decode_graphs = _CpuGraphs(model, CFG.block_size, CFG.max_running, CFG.num_blocks)
    ps = _prompts()[:2]
    llm.generate(ps, STAGGERED[2])
    before = graphs.captures
    stacks = dg._stacks(model)
    stack_experts(model, on_device=False)
    stack_experts(model, on_device=True)                                  # new tensors, same layout as before
    assert not dg._same(dg._stacks(model), stacks)
    llm.generate(ps, STAGGERED[2])
    assert graphs.captures > before
    assert all(dg._same(dg._stacks(model), g.stacks) for g in graphs.graphs.values())


def test_buckets_are_powers_of_two():
    assert [dg.bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9)] == [1, 1, 2, 4, 4, 8, 8, 16]


def test_graphs_refuse_a_cpu_model(model):
    with pytest.raises(ValueError, match="CUDA device"):
        dg.DecodeGraphs(model, 16, 4, 64)
    with pytest.raises(ValueError, match="planned_decode"):
        LLM(model=model, config=dataclasses.replace(CFG, cuda_graphs=True, planned_decode=False))
