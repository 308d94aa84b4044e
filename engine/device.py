"""Where the engine computes, and in which precision.

    cpu    fp32 weights and math. bf16 is slower end to end on the dev CPUs even where AMX makes
           a lone bf16 linear faster (3x at 8 rows): v4-small compiled decode in bf16 ran
           96 / 237 tok/s at batch 1 / 8 against 117 / 275 in fp32, same machine (benchmarks/README.md)
    cuda   bf16 weights; norms, mHC, routing, softmax and compressor pooling stay fp32 (the model
           upcasts them itself). FP8 / FP4 checkpoint tensors are dequantised at load: no FP8
           GEMM kernel is wired in yet, so they are not kept quantised on the device either.
    npu    as cuda, through torch_npu (Huawei Ascend), imported only when selected: installing
           torch_npu makes a plain `import torch` fail on hosts without CANN.

deep_gemm is likewise never imported unless a kernel asks for it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch


def synchronize(device: str | torch.device) -> None:
    """Wait for the device's queued work (timing); nothing to wait for on the CPU."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "npu":
        torch.npu.synchronize(device)


@dataclass(frozen=True)
class Placement:
    device: str           # "cpu", "cuda:0", "npu:0"
    dtype: torch.dtype    # weight dtype


class DeviceUnavailable(RuntimeError, ValueError):
    """The device asked for is not on this machine (or this torch build): the caller's request is
    what cannot be met (a ValueError, so the CLI says it in one line), nothing broke."""


def select(name: str = "auto") -> Placement:
    """`auto` picks cuda when present, else cpu; `cuda[:i]`, `npu[:i]` and `cpu` are explicit."""
    kind = name.split(":")[0]
    if name == "auto":
        return select("cuda") if torch.cuda.is_available() else select("cpu")
    if kind == "cpu":
        return Placement("cpu", torch.float32)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"device {name!r}: this torch ({torch.__version__}) sees no CUDA device; "
                                    "install the CUDA build of torch 2.13.0 (see README) or use --device cpu")
        return Placement(name if ":" in name else "cuda:0", torch.bfloat16)
    if kind == "npu":
        try:
            importlib.import_module("torch_npu")       # registers the "npu" device with torch
        except ImportError as e:
            raise DeviceUnavailable(
                f"device {name!r} needs torch_npu with the CANN toolkit ({e}); use cpu or cuda") from None
        return Placement(name if ":" in name else "npu:0", torch.bfloat16)
    raise ValueError(f"unknown device {name!r}: use auto, cpu, cuda[:i] or npu[:i]")
