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
import types

from torch import nn

PHASES = ("attn_in", "ffn_in", "ffn_out")
WHOLE = ("decode",)       # a block's whole decode step as one graph, where the block class has one
MODEL_WHOLE = "decode_layers"   # a model's batch-1 decode step (all blocks, logits) as one graph
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
    fn = block.__dict__.get("compiled", {}).get(name)
    return fn(block, *args) if fn is not None else getattr(block, name)(*args)


def blocks(model: nn.Module) -> list[nn.Module]:
    """Every module of `model` that has phases (backbone layers and drafter blocks)."""
    return [m for m in model.modules() if all(callable(getattr(m, p, None)) for p in PHASES)]


def compile_blocks(model: nn.Module, enabled: bool = True) -> int:
    """Compile (or, with enabled=False, un-compile) `model`'s blocks; returns how many blocks."""
    found = blocks(model)
    if not enabled:
        for blk in found:
            blk.__dict__.pop("compiled", None)
        model.__dict__.pop("compiled", None)
        return len(found)
    _check(model)
    import torch._dynamo
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           16 * RECOMPILE_LIMIT)
    options = OPTIONS if next(model.parameters()).device.type == "cpu" else ACCELERATOR_OPTIONS
    for blk in found:
        variant = blk.variant() if callable(getattr(blk, "variant", None)) else None
        blk.__dict__["compiled"] = _compiled_phases(type(blk), variant, options)
    if callable(getattr(model, MODEL_WHOLE, None)):
        model.__dict__["compiled"] = {MODEL_WHOLE: _compiled_model(type(model), options)}
    return len(found)


def _compiled_model(cls: type, options: dict):
    """The model's batch-1 decode step (every block and the logits) as one compiled function,
    once per model class, backend and options."""
    key = (cls, MODEL_WHOLE, BACKEND, tuple(sorted(options.items())))
    if key not in _COMPILED:
        _COMPILED[key] = _compile(getattr(cls, MODEL_WHOLE), options)
    return _COMPILED[key]


def _compile(fn, options: dict):
    """torch.compile with this module's backend (inductor takes `options`, other backends none)."""
    import torch
    return torch.compile(fn, backend=BACKEND, options=options if BACKEND == "inductor" else None)


def _compiled_phases(cls: type, variant, options: dict) -> dict:
    """The compiled functions of a block class and variant (e.g. its attention kind), made once
    per process (and backend and options): every engine and every layer of the variant share
    them. The phases (prefill and the general path) are one per class, as their graphs largely
    coincide across variants; a whole-block decode is one per variant, each on its own copy of
    the method's code object: dynamo keeps graphs per code object and walks them on every call,
    and with every variant's decode graphs on one code object the guard checks of a step's 8
    block calls cost ~1 ms more."""
    opts = tuple(sorted(options.items()))
    key = (cls, variant, BACKEND, opts)
    if key not in _COMPILED:
        shared = (cls, None, BACKEND, opts)
        if shared not in _COMPILED:
            _COMPILED[shared] = {p: _compile(getattr(cls, p), options) for p in PHASES}
        _COMPILED[key] = {**_COMPILED[shared], **{p: _compile(_own_code(getattr(cls, p), variant), options)
                                                  for p in WHOLE if hasattr(cls, p)}}
    return _COMPILED[key]


def _own_code(fn, variant):
    """`fn` with a code object of its own (same bytecode), so that its dynamo cache is its own."""
    if variant is None:
        return fn
    code = fn.__code__.replace(co_name=fn.__name__)
    own = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__qualname__, own.__doc__ = fn.__qualname__, fn.__doc__
    return own


def warm_up(run, block_size: int, vocab_size: int) -> None:
    """Meet every graph variant a serving engine needs before the first real request (a compile
    takes seconds to two minutes on 2 CPU cores; v4-small: ~280 s for all of them with a cold
    inductor cache, ~20 s warm): `run(prompts, max_tokens)` generates on a scratch engine. Variants: a prefill step (static size), pure decode steps of 3, 2 (dynamic size) and
    1 tokens (batch-1: the whole model one graph, experts summed in it; block decode's page
    count is dynamic and never 1, decode_plan.MIN_PAGES), a prefill of another size (dynamic).
    Decode steps the block-decode plan cannot take (engine/decode_plan.py) run the phases, whose
    decode graphs this leaves to the first such step."""
    def ids(n: int, seed: int) -> list[int]:
        return [3 + (seed * 7919 + i * 104729) % (vocab_size - 3) for i in range(n)]
    run([ids(block_size + 3, 1), ids(5, 2), ids(2, 3)], [4, 3, 2])
    run([ids(7, 4), ids(3, 5)], [2, 3])


def _check(model: nn.Module) -> None:
    if any(getattr(m, "reduce", None) is not None for m in model.modules()):
        raise ValueError("compiled blocks do not support tensor or expert parallelism yet: "
                         "run --tp / --ep without --compile")
    device = next(model.parameters()).device
    if device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        raise ValueError("compiling on CPU needs a C++ compiler (inductor writes C++): install g++ "
                           "(apt install build-essential) or run without compile")
