"""Kernels: the engine's hot numeric routines, written apart from the model code that calls them.

A kernel here is a function over tensors (no modules of the model, no engine state) whose fast
path is worth keeping apart from the layer that calls it. Each module holds, side by side:

    the fast path        what the engine runs (tensor ops a compiled graph fuses, a custom op, ...)
    its reference        the same result in plain, slow, obviously correct torch (`*_reference`)
    its test             tests/kernels/test_<module>.py: fast path against reference on random
                         shapes and the edge cases (no token, one token, uneven groups), and the
                         custom ops registered and compiled where the engine compiles them

Kernels import torch only, never the engine, the store or the tiers; the store and the tiers
never import kernels. Hand-written accelerator kernels (Triton, vendor libraries) join the same
pattern as another fast path beside the reference, imported lazily, only where the device has
them, so that importing a kernel module on a CPU-only host loads nothing more than torch.

The kernels:
    routed_experts   the routed experts' sum on the host: tokens grouped by expert, one matmul
                     per active expert (`grouped_sum`), as the opaque op `kvcache::routed_experts`
                     for compiled decode graphs, and as tensor ops at one token (`gathered_sum`)
    grouped_matmul   the same sum on the device over stacked expert weights (`stacked_sum`): one
                     grouped matmul per projection (torch._grouped_mm) or batched matmuls over
                     gathered weights, with no read-back of the chosen expert ids
"""
