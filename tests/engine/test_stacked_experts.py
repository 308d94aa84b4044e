"""Routed experts summed on the device (kernels/grouped_matmul.py, stacked by
engine/layers/moe.py:stack_experts): a MoE's same sums as the host path, one copy of the weights,
greedy tokens unchanged through the engine, clear refusals. The kernels against their references:
tests/kernels/."""

import copy
import dataclasses

import pytest
import torch

from kvcache.engine.layers.moe import MoE, stack_experts
from kvcache.engine.llm import LLM
from kvcache.engine.config import EngineConfig
from kvcache.engine.models import build_model
from kvcache.engine.sampling import SamplingParams
from tests.engine.test_engine import model  # noqa: F401  (the v4 / v41 tiny model fixture)
from tests.engine.tiny import randomize, v4_config

CFG = EngineConfig(block_size=16, num_blocks=64, max_tokens_per_step=48, max_running=4)


def _moe(dtype=torch.float32):
    return randomize(MoE(v4_config(), hashed=False), 2).eval().to(dtype)


@torch.no_grad()
def test_stacked_sum_equals_the_host_path():
    """fp32 (batched matmuls over gathered weights): within fp32 rounding of the host path, for
    one token (the host's pair-by-pair path) and many (grouped by expert)."""
    host = _moe()
    dev = copy.deepcopy(host)
    assert stack_experts(dev) == 1 and not dev.stacked.grouped
    for n in (1, 2, 7):
        x = torch.randn(n, host.gate.weight.shape[1])
        torch.testing.assert_close(dev(x), host(x), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_stacks_are_rebuilt_after_the_model_is_cast():
    """.to() converts each expert parameter on its own, so they stop being views into the stacks:
    stacking again rebuilds them from the experts (no stale weights, no second copy kept)."""
    moe = _moe()
    stack_experts(moe)
    moe.to(torch.float64)
    assert moe.stacked.stale(moe.experts)
    stack_experts(moe)
    assert not moe.stacked.stale(moe.experts) and moe.stacked.w2s.dtype == torch.float64
    x = torch.randn(4, moe.gate.weight.shape[1], dtype=torch.float64)
    ref = copy.deepcopy(moe)
    stack_experts(ref, on_device=False)
    torch.testing.assert_close(moe(x), ref(x))


@torch.no_grad()
def test_host_stacks_are_linear_and_a_compiled_token_sums_in_the_graph():
    """Host-path stacks keep nn.Linear's layout (rows along the input dim); a one-token routed
    sum compiled in a graph (gathered_sum: no op call) equals the op's, and so does gathered_sum
    run eagerly on a few tokens (each token's terms in ascending expert id)."""
    from kvcache.kernels.routed_experts import gathered_sum
    moe = _moe()
    stack_experts(moe, on_device=False)
    s = moe.stacked
    assert s.linear and s.w1s.shape[1:] == moe.experts[0].w1.weight.shape
    assert s.w2s[3].data_ptr() == moe.experts[3].w2.weight.data_ptr() and s.w2s.is_contiguous()
    torch.compiler.reset()
    fn = torch.compile(lambda x, w, i: moe.routed_sum(x, w, i), backend="aot_eager")
    for n in (1, 3):
        x = torch.randn(n, moe.gate.weight.shape[1])
        weights, ids = moe.gate(x, None)
        op = torch.ops.kvcache.routed_experts(x, weights, ids, s.w1s, s.w3s, s.w2s, s.limit)
        torch.testing.assert_close(gathered_sum(x, weights, ids, s.w1s, s.w3s, s.w2s, s.limit), op,
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(moe.routed_sum(x, weights, ids), op, rtol=0, atol=0)   # eager: the op
        torch.testing.assert_close(fn(x, weights, ids), op, rtol=1e-5, atol=1e-5)
    graph = torch._dynamo.explain(lambda x, w, i: moe.routed_sum(x, w, i))(x[:1], weights[:1], ids[:1])
    ops = {str(n.target) for g in graph.graphs for n in g.graph.nodes if n.op in ("call_function", "call_method")}
    assert graph.graph_break_count == 0 and any("sum" in o for o in ops)
    assert not any("routed_experts" in o for o in ops)              # one token: summed in the graph


def test_device_experts_are_off_by_default_on_the_cpu():
    """On the CPU the engine stacks the experts (planned decode's op reads the stacks) but sums them
    by the host path."""
    from kvcache.engine.layers.moe import device_experts_pay
    model = build_model(v4_config(num_nextn_predict_layers=0))
    assert not device_experts_pay(model)
    LLM(model=model, config=CFG)
    assert all(m.stacked is not None and not m.stacked.on_device for m in model.modules() if isinstance(m, MoE))


@torch.no_grad()
def test_stacked_bf16_uses_grouped_matmuls_when_present():
    host = _moe(torch.bfloat16)
    dev = copy.deepcopy(host)
    stack_experts(dev)
    assert dev.stacked.grouped == hasattr(torch, "_grouped_mm")
    x = torch.randn(9, host.gate.weight.shape[1]).to(torch.bfloat16)
    torch.testing.assert_close(dev(x).float(), host(x).float(), rtol=3e-2, atol=3e-2)


def test_experts_keep_one_copy_of_their_weights_and_sum_on_the_host_again():
    moe = _moe()
    before = moe.experts[5].w2.weight.detach().clone()
    stack_experts(moe)
    w = moe.experts[5].w2.weight
    assert w.data_ptr() == moe.stacked.w2s[5].data_ptr()          # a view, not a second copy
    assert torch.equal(w, before)
    assert "stacked.w1s" not in moe.state_dict()                   # checkpoints keep the experts' names
    stack_experts(moe, on_device=False)
    assert not moe.stacked.on_device and torch.equal(moe.experts[5].w2.weight, before)
    x = torch.randn(3, moe.gate.weight.shape[1])
    assert moe.routed(x, *moe.gate(x, None)).out is not None                    # the host path sums


@torch.no_grad()
def test_engine_with_device_experts_gives_the_same_tokens(model):
    g = torch.Generator().manual_seed(1)
    ps = [[5 + i] + torch.randint(3, 300, (n,), generator=g).tolist() for i, n in enumerate((40, 7, 23, 1))]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def tokens(device_experts: bool):
        llm = LLM(model=model, config=dataclasses.replace(CFG, device_experts=device_experts))
        return [o[0].token_ids for o in llm.generate(ps, greedy)]
    host = tokens(False)
    assert tokens(True) == host
    assert tokens(False) == host                     # and back to the host path


def test_device_experts_refuse_expert_parallelism():
    model = build_model(v4_config(num_nextn_predict_layers=0))
    for m in model.modules():
        if isinstance(m, MoE):
            m.local_experts = {0, 1}                 # what engine/parallel.shard sets under --ep
    with pytest.raises(ValueError, match="expert parallelism"):
        LLM(model=model, config=dataclasses.replace(CFG, device_experts=True))
