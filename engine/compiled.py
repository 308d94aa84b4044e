"""Compiled blocks: the token-wise phases of every block fused by torch.compile (`compile = true`).

A decode step at batch 1 is a few hundred tiny ops per layer; in eager PyTorch their dispatch,
not their arithmetic, is most of the step. Each block splits into phases at the points where
per-request state is touched:

    streams ─┬─ attn_in  (compiled) mHC mix, norm, q / kv / history projections, RoPE
             │  attention core (eager) windows, compressors, index top-k, softmax over keys
             ├─ ffn_in   (compiled) output projection, expand, mHC mix, norm, gate, shared expert
             │  routed experts (eager) data-dependent: one matmul per active expert
             └─ ffn_out  (compiled) combine, expand ─> streams

The phases are the blocks' own methods (`Block.attn_in` ...): eager and compiled run the same
code. Compiled functions are made once per block class and shared by every layer of that class
(dynamo guards on a block's structure, e.g. its attention kind, not on which layer it is).
Shapes: a batch-1 step has its own graphs, other token counts share one dynamic graph (the
first count seen also gets a static one). An engine with `compile = true` meets them all at start
(`warm_up`: a few scratch requests), so no request waits for a compile; the inductor cache
(TORCHINDUCTOR_CACHE_DIR) keeps them across restarts.

CPU needs a C++ compiler (inductor writes C++); CUDA uses Triton. Tensor and expert parallelism
are not compiled (their all-reduces sit inside the phases): `compile_blocks` refuses them.
"""

from __future__ import annotations

import shutil

from torch import nn

PHASES = ("attn_in", "ffn_in", "ffn_out")
RECOMPILE_LIMIT = 64      # attention kinds x gate kinds x (static, 1, dynamic) token counts
# A graph's launcher in C++ rather than Python: a v4-small batch-1 step spent 13 of its ~23 ms in
# the phases with Python launchers and 11 with C++ ones (6 of them in matmuls), same run.
OPTIONS = {"cpp_wrapper": True}
# CUDA: Triton kernels with inductor's default (Python) launchers
ACCELERATOR_OPTIONS: dict = {}
BACKEND = "inductor"
_COMPILED: dict[tuple, dict] = {}


def phase(block: nn.Module, name: str, *args):
    """Run one phase of `block`: its compiled function when the block is compiled, else the method."""
    compiled = block.__dict__.get("compiled")
    return compiled[name](block, *args) if compiled else getattr(block, name)(*args)


def blocks(model: nn.Module) -> list[nn.Module]:
    """Every module of `model` that has phases (backbone layers and drafter blocks)."""
    return [m for m in model.modules() if all(callable(getattr(m, p, None)) for p in PHASES)]


def compile_blocks(model: nn.Module, enabled: bool = True) -> int:
    """Compile (or, with enabled=False, un-compile) `model`'s blocks; returns how many blocks."""
    found = blocks(model)
    if not enabled:
        for blk in found:
            blk.__dict__.pop("compiled", None)
        return len(found)
    _check(model)
    import torch._dynamo
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           16 * RECOMPILE_LIMIT)
    options = OPTIONS if next(model.parameters()).device.type == "cpu" else ACCELERATOR_OPTIONS
    for blk in found:
        blk.__dict__["compiled"] = _compiled_phases(type(blk), options)
    return len(found)


def _compiled_phases(cls: type, options: dict) -> dict:
    """One compiled function per phase and block class, made once per process (and backend and
    options): every engine and every layer of the class share them, and with them dynamo's graphs."""
    import torch
    key = (cls, BACKEND, tuple(sorted(options.items())))
    if key not in _COMPILED:
        options = options if BACKEND == "inductor" else None
        _COMPILED[key] = {p: torch.compile(getattr(cls, p), backend=BACKEND, options=options) for p in PHASES}
    return _COMPILED[key]


def warm_up(run, block_size: int, vocab_size: int) -> None:
    """Meet every graph variant a serving engine needs before the first real request (a compile
    takes seconds to a minute on 2 CPU cores): `run(prompts, max_tokens)` generates on a scratch
    engine. Variants: a prefill step (static size), pure decode steps of 3, 2 (dynamic size) and
    1 tokens (batch-1: experts summed in the graph), a prefill of another size (dynamic)."""
    def ids(n: int, seed: int) -> list[int]:
        return [3 + (seed * 7919 + i * 104729) % (vocab_size - 3) for i in range(n)]
    run([ids(block_size + 3, 1), ids(5, 2), ids(2, 3)], [4, 3, 2])
    run([ids(7, 4)], [2])


def _check(model: nn.Module) -> None:
    if any(getattr(m, "reduce", None) is not None for m in model.modules()):
        raise ValueError("compiled blocks do not support tensor or expert parallelism yet: "
                         "run --tp / --ep without --compile")
    device = next(model.parameters()).device
    if device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        raise ValueError("compiling on CPU needs a C++ compiler (inductor writes C++): install g++ "
                           "(apt install build-essential) or run without compile")
