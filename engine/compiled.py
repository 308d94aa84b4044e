"""Compiled layers: the token-wise phases of every layer fused by torch.compile (`compile = true`).

A decode step at batch 1 is a few hundred tiny ops per layer; in eager PyTorch their dispatch,
not their arithmetic, is most of the step. Each layer splits into phases at the points where
per-request state is touched:

    streams ─┬─ attn_in  (compiled) mHC mix, norm, q / kv / history projections, RoPE
             │  attention core (eager) windows, compressors, index top-k, softmax over keys
             ├─ ffn_in   (compiled) output projection, expand, mHC mix, norm, gate, shared expert
             │  routed experts (eager) data-dependent: one matmul per active expert
             └─ ffn_out  (compiled) combine, expand ─> streams

The phases are the layers' own methods (`DecoderLayer.attn_in` ...): eager and compiled run the
same code. Compiled functions are made once per layer class and shared by every layer of that
class (dynamo guards on a layer's structure, e.g. its attention kind, not on which layer it is).
A planned decode step (engine/decode_plan.py) is not phases but one graph for the whole model
(`decode_layers`: every layer's `decode` and the logits), one call a step.
Shapes: a batch-1 step has its own graphs, other token counts share one dynamic graph (the
first count seen also gets a static one, except in planned decode, dynamic from the start). An
engine with `compile = true` meets them all at start (`warm_up`: a few scratch requests), so no
request waits for a compile; the inductor cache (TORCHINDUCTOR_CACHE_DIR) keeps them across
restarts.

CPU needs a C++ compiler (inductor writes C++); CUDA uses Triton. Tensor and expert parallelism
are not compiled (their all-reduces sit inside the phases): `compile_layers` refuses them.
"""

from __future__ import annotations

import shutil

from torch import nn

from kvcache.engine.sampling import SamplingParams

PHASES = ("attn_in", "ffn_in", "ffn_out")
MODEL_WHOLE = "decode_layers"   # a model's planned decode step (all layers, logits) as one graph
RECOMPILE_LIMIT = 64      # attention kinds x gate kinds x (static, 1, dynamic) token counts
# A graph's launcher in C++ rather than Python: a v4-small batch-1 step spent 13 of its ~23 ms in
# the phases with Python launchers and 11 with C++ ones (6 of them in matmuls), same run.
# Launcher and kernels built as two files (launcher at -O1, kernels -O3, side by side): the
# whole-model decode graphs' one huge file took g++ minutes at -O3 on one core; v4-small's cold
# start 702 -> 456 s, and steps no slower (two engines alternating in one process: b1 11.8 vs
# 14.5 ms, b8 31.6 vs 34.3 ms, noise on a slow VM)
OPTIONS = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}
# CUDA: Triton kernels with inductor's default (Python) launchers
ACCELERATOR_OPTIONS: dict = {}
BACKEND = "inductor"
_COMPILED: dict[tuple, dict] = {}


def phase(layer: nn.Module, name: str, *args):
    """Run one phase of `layer`: its compiled function when the layer is compiled, else the method."""
    fn = layer.__dict__.get("compiled", {}).get(name)
    return fn(layer, *args) if fn is not None else getattr(layer, name)(*args)


def phased_layers(model: nn.Module) -> list[nn.Module]:
    """Every module of `model` that has phases (backbone layers and drafter stages)."""
    return [m for m in model.modules() if all(callable(getattr(m, p, None)) for p in PHASES)]


def compile_layers(model: nn.Module, enabled: bool = True) -> int:
    """Compile (or, with enabled=False, un-compile) `model`'s layers; returns how many layers."""
    found = phased_layers(model)
    if not enabled:
        for layer in found:
            layer.__dict__.pop("compiled", None)
        model.__dict__.pop("compiled", None)
        return len(found)
    _check(model)
    import torch._dynamo
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           16 * RECOMPILE_LIMIT)
    options = OPTIONS if next(model.parameters()).device.type == "cpu" else ACCELERATOR_OPTIONS
    for layer in found:
        layer.__dict__["compiled"] = _compiled_phases(type(layer), options)
    if callable(getattr(model, MODEL_WHOLE, None)):
        model.__dict__["compiled"] = {MODEL_WHOLE: _compiled_model(type(model), options)}
    return len(found)


def _compiled_model(cls: type, options: dict):
    """The model's decode step (every layer's decode and the logits) as one compiled function,
    once per model class, backend and options: one graph call a step instead of one per layer
    (v4-small at batch 8, one process, alternating: 26.6-29.2 vs 32.5-38.1 ms a step)."""
    key = (cls, MODEL_WHOLE, BACKEND, tuple(sorted(options.items())))
    if key not in _COMPILED:
        _COMPILED[key] = _compile(getattr(cls, MODEL_WHOLE), options)
    return _COMPILED[key]


def _compile(fn, options: dict):
    """torch.compile with this module's backend (inductor takes `options`, other backends none)."""
    import torch
    return torch.compile(fn, backend=BACKEND, options=options if BACKEND == "inductor" else None)


def _compiled_phases(cls: type, options: dict) -> dict:
    """The compiled phases of a layer class, made once per process (and backend and options):
    every engine and every layer of the class share them (dynamo keeps a graph per variant the
    calls meet, e.g. attention kind, under the same functions)."""
    key = (cls, BACKEND, tuple(sorted(options.items())))
    if key not in _COMPILED:
        _COMPILED[key] = {p: _compile(getattr(cls, p), options) for p in PHASES}
    return _COMPILED[key]


def generate_on(engine):
    """warm_up's `run` on an engine: its prompts generated greedily to their max_tokens."""
    def run(prompts: list[list[int]], max_tokens: list[int]) -> None:
        for p, n in zip(prompts, max_tokens):
            engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        while engine.has_work():
            engine.step()
    return run


def warm_up(run, block_size: int, vocab_size: int) -> None:
    """Meet every graph variant a serving engine needs before the first real request (a compile
    takes seconds to minutes on 2 CPU cores; v4-small: ~5-8 minutes for all of them with a cold
    inductor cache, ~30 s warm): `run(prompts, max_tokens)` generates on a scratch engine.
    Variants: a prefill step (static size), pure decode steps of 3, 2 (one dynamic whole-model
    graph) and 1 tokens (batch 1: its own whole-model graph, experts summed in it; planned
    decode's block count is dynamic and never 1, decode_plan.MIN_BLOCKS), a prefill of another
    size (dynamic). Decode steps the decode plan cannot take (engine/decode_plan.py) run
    the phases, whose decode graphs this leaves to the first such step."""
    def ids(n: int, seed: int) -> list[int]:
        return [3 + (seed * 7919 + i * 104729) % (vocab_size - 3) for i in range(n)]
    run([ids(block_size + 3, 1), ids(5, 2), ids(2, 3)], [4, 3, 2])
    run([ids(7, 4), ids(3, 5)], [2, 3])


def _check(model: nn.Module) -> None:
    if any(getattr(m, "reduce", None) is not None for m in model.modules()):
        raise ValueError("compiled layers do not support tensor or expert parallelism yet: "
                         "run --tp / --ep without --compile")
    device = next(model.parameters()).device
    if device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        raise ValueError("compiling on CPU needs a C++ compiler (inductor writes C++): install g++ "
                           "(apt install build-essential) or run without compile")
