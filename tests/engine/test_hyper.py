"""mHC's Sinkhorn (engine/layers/hyper.py): the elementwise form that compiled blocks trace gives
the batched form's result bit for bit, eager and compiled."""

import torch

from kvcache.engine.layers.hyper import sinkhorn_batched, sinkhorn_elementwise


def _comb(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(shape, generator=g) * 3, dim=-1) + 1e-6


def test_elementwise_sinkhorn_equals_batched():
    for seed, shape in enumerate([(1, 1, 4, 4), (1, 37, 4, 4), (2, 5, 3, 3)]):
        comb = _comb(shape, seed)
        assert torch.equal(sinkhorn_elementwise(comb, 20, 1e-6), sinkhorn_batched(comb, 20, 1e-6))


def test_compiled_sinkhorn_is_one_kernel_with_the_same_result():
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    comb = _comb((1, 9, 4, 4), 7)
    out, code = run_and_get_code(torch.compile(sinkhorn_elementwise), comb, 20, 1e-6)
    assert torch.equal(out, sinkhorn_batched(comb, 20, 1e-6))
    assert "\n".join(code).count('extern "C"') == 1        # CPU: one C++ kernel for all 39 passes
