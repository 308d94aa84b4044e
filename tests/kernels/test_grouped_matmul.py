"""The device kernel of the routed experts (kernels/grouped_matmul.py) against its reference:
stacked_sum by gathered batched matmuls (fp32, any device), in bounded chunks, by grouped matmuls
(bf16, where torch._grouped_mm runs), and compiled as one graph."""

import pytest
import torch

from kvcache.kernels.grouped_matmul import grouped_mm_works, stacked_sum, stacked_sum_reference
from tests.kernels.experts import CASES, LIMIT, experts, routing

E, D, INTER = 8, 32, 16
ON_DEVICE = [c for c in CASES if c[0] > 0]       # the engine never sums an empty batch on the device
GROUPED = grouped_mm_works(torch.bfloat16, "cpu", D, INTER)


def _problem(n, k, uneven, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    stacks = experts(E, D, INTER, g, dtype).transposed()
    weights, ids = routing(n, k, E, g, uneven)
    return torch.randn(n, D, generator=g).to(dtype), weights, ids, stacks


@pytest.mark.parametrize("n,k,uneven", ON_DEVICE)
def test_gathered_matmuls_equal_the_reference(n, k, uneven):
    x, weights, ids, stacks = _problem(n, k, uneven, 17 + n)
    got = stacked_sum(x, weights, ids, *stacks, LIMIT, grouped=False)
    torch.testing.assert_close(got, stacked_sum_reference(x, weights, ids, *stacks, LIMIT), rtol=1e-5, atol=1e-5)


def test_gathered_weights_are_read_in_bounded_chunks(monkeypatch):
    """Without grouped matmuls the pairs' weights are gathered GATHER_BYTES at a time (a 512-token
    prefill of a big model would otherwise gather tens of GiB at once): same sums in chunks of
    3 pairs, the last one short."""
    x, weights, ids, stacks = _problem(7, 2, True, 23)
    monkeypatch.setattr("kvcache.kernels.grouped_matmul.GATHER_BYTES", 3 * stacks[0][0].numel() * 4)
    got = stacked_sum(x, weights, ids, *stacks, LIMIT, grouped=False)
    torch.testing.assert_close(got, stacked_sum_reference(x, weights, ids, *stacks, LIMIT), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not GROUPED, reason="torch._grouped_mm does not run here")
@pytest.mark.parametrize("n,k,uneven", ON_DEVICE)
def test_grouped_matmuls_equal_the_reference(n, k, uneven):
    """bf16 (the only dtype grouped matmuls take), experts with no pair being empty groups:
    within bf16 rounding of the reference computed in fp32 from the same weights."""
    x, weights, ids, stacks = _problem(n, k, uneven, 29 + n, torch.bfloat16)
    got = stacked_sum(x, weights, ids, *stacks, LIMIT, grouped=True)
    want = stacked_sum_reference(x.float(), weights, ids, *(s.float() for s in stacks), LIMIT)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


def test_grouped_matmuls_are_refused_where_they_do_not_apply():
    assert not grouped_mm_works(torch.float32, "cpu", D, INTER)     # bf16 only


def test_stacked_sum_compiles_in_one_graph():
    """No read-back of the ids and no data-dependent Python: fullgraph compiles it, and the
    compiled sum equals the reference."""
    x, weights, ids, stacks = _problem(6, 2, True, 31)
    torch.compiler.reset()
    fn = torch.compile(lambda x, w, i: stacked_sum(x, w, i, *stacks, LIMIT, grouped=False),
                       backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(fn(x, weights, ids), stacked_sum_reference(x, weights, ids, *stacks, LIMIT),
                               rtol=1e-5, atol=1e-5)
