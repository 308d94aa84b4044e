"""The host kernels of the routed experts (kernels/routed_experts.py) against their reference:
grouped_sum (with expert parallelism's `local`), the `kvcache::routed_experts` op eager and under
torch.compile, and gathered_sum, on random problems with the edge cases of tests/kernels/experts.py."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvcache.kernels.routed_experts import gathered_sum, grouped_sum, routed_sum_reference
from tests.kernels.experts import CASES, LIMIT, experts, routing

E, D, INTER = 8, 32, 16


def _tol(dtype: torch.dtype) -> dict:
    # a matmul over several tokens may round unlike one over a token
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,uneven", CASES)
def test_grouped_sum_equals_the_reference(n, k, uneven, dtype):
    """Also with experts held by another rank (expert parallelism: theirs add nothing)."""
    g = torch.Generator().manual_seed(7 + n * 10 + k)
    ex = experts(E, D, INTER, g, dtype)
    x = torch.randn(n, D, generator=g).to(dtype)
    weights, ids = routing(n, k, E, g, uneven)
    for local in (None, {0, 3, 5}, set()):
        got = grouped_sum(x, weights, ids, ex.expert, LIMIT, local)
        want = routed_sum_reference(x, weights, ids, ex.expert, LIMIT, local)
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got, want, **_tol(dtype), msg=lambda m: f"{local=}: {m}")


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(n=st.integers(0, 24), k=st.integers(1, 6), n_experts=st.integers(7, 12), uneven=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_grouped_sum_equals_the_reference_on_any_shape(n, k, n_experts, uneven, seed):
    g = torch.Generator().manual_seed(seed)
    ex = experts(n_experts, 16, 8, g)
    x = torch.randn(n, 16, generator=g)
    weights, ids = routing(n, k, n_experts, g, uneven)
    torch.testing.assert_close(grouped_sum(x, weights, ids, ex.expert, LIMIT),
                               routed_sum_reference(x, weights, ids, ex.expert, LIMIT), **_tol(x.dtype))


@pytest.mark.parametrize("n,k,uneven", CASES)
def test_op_and_gathered_sum_equal_the_reference(n, k, uneven):
    """Over linear stacks (what a decode graph passes): the op, and gathered_sum's tensor ops."""
    g = torch.Generator().manual_seed(11 + n)
    ex = experts(E, D, INTER, g)
    x = torch.randn(n, D, generator=g)
    weights, ids = routing(n, k, E, g, uneven)
    want = routed_sum_reference(x, weights, ids, ex.expert, LIMIT)
    op = torch.ops.kvcache.routed_experts(x, weights, ids, ex.w1, ex.w3, ex.w2, LIMIT)
    torch.testing.assert_close(op, want, **_tol(x.dtype))
    torch.testing.assert_close(gathered_sum(x, weights, ids, ex.w1, ex.w3, ex.w2, LIMIT), want, **_tol(x.dtype))


def test_the_op_is_registered_with_a_fake():
    """torch.library's own checks: schema, fake (meta) kernel, autograd registration, dispatch."""
    g = torch.Generator().manual_seed(3)
    ex = experts(E, D, INTER, g)
    x = torch.randn(5, D, generator=g)
    weights, ids = routing(5, 2, E, g)
    torch.library.opcheck(torch.ops.kvcache.routed_experts.default,
                          (x, weights, ids, ex.w1, ex.w3, ex.w2, LIMIT))


def _graph_ops(fn, *args) -> tuple[int, set[str]]:
    graph = torch._dynamo.explain(fn)(*args)
    return graph.graph_break_count, {str(n.target) for g in graph.graphs for n in g.graph.nodes
                                     if n.op in ("call_function", "call_method")}


def test_the_op_and_gathered_sum_compile_in_one_graph():
    """Compiled (fullgraph: no data-dependent Python left in the graph): the op stays one opaque
    call and gathered_sum becomes tensor ops; both equal the reference."""
    g = torch.Generator().manual_seed(5)
    ex = experts(E, D, INTER, g)
    torch.compiler.reset()
    op = torch.compile(lambda x, w, i: torch.ops.kvcache.routed_experts(x, w, i, ex.w1, ex.w3, ex.w2, LIMIT),
                       backend="aot_eager", fullgraph=True)
    gathered = torch.compile(lambda x, w, i: gathered_sum(x, w, i, ex.w1, ex.w3, ex.w2, LIMIT),
                             backend="aot_eager", fullgraph=True)
    for n in (1, 4):
        x = torch.randn(n, D, generator=g)
        weights, ids = routing(n, 2, E, g, uneven=n > 1)
        want = routed_sum_reference(x, weights, ids, ex.expert, LIMIT)
        torch.testing.assert_close(op(x, weights, ids), want, **_tol(x.dtype))
        torch.testing.assert_close(gathered(x, weights, ids), want, **_tol(x.dtype))
    breaks, ops = _graph_ops(lambda x, w, i: torch.ops.kvcache.routed_experts(x, w, i, ex.w1, ex.w3, ex.w2, LIMIT),
                             x, weights, ids)
    assert breaks == 0 and any("routed_experts" in o for o in ops)
