"""CUDA graphs of planned decode (`EngineConfig(cuda_graphs=True)`): a decode step replayed as one
graph instead of thousands of kernel launches from Python.

On a GPU a small model's decode step is host-bound: a v4-small step at batch 1 launched ~1,570
kernels in ~26 ms of host time while the GPU was busy ~2.3 ms (H200). Planned decode makes the
step pure tensor ops on a few per-step tensors (engine/decode_plan.py), so it can be captured:

    step sizes -> bucket (batch: next power of two; blocks: next power of two)
    first time a bucket is met:  warm the step up on a null plan (every row padding: it writes
        only the pool's scratch block and slot, so no request's state moves), then capture
        model.decode_step reading static input buffers  ->  (graph, inputs, tokens, logits)
    every step:  plan on the host (padded to the bucket), copy its values and tokens into the
        bucket's buffers (two host-to-device copies), replay, read logits[:B], advance the
        host-side counts

Graphs share one memory pool; the pool lanes and weights are the same tensors at every replay.
The routed experts must be summed on the device (stacked, grouped matmuls): the host path reads
the chosen ids back, which a graph cannot. Steps that do not plan (prefill, mixed steps, states
planned decode cannot take, more requests or blocks than the largest bucket) run as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvcache.engine.decode_plan import step_views
from kvcache.engine.models.deepseek_v4 import checked_tokens

log = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    inputs: torch.Tensor          # the plan's packed values (step_views' layout)
    tokens: torch.Tensor          # [1, batch]
    logits: torch.Tensor          # [batch, vocab], written by each replay
    lanes: list                   # the pool lanes it reads and writes (the same tensors every step)
    stacks: tuple                 # the experts' stack tensors it reads, held (so never freed under it)


def bucket(n: int) -> int:
    """The next power of two >= n (>= 1)."""
    return 1 << max(n - 1, 0).bit_length()


class DecodeGraphs:
    def __init__(self, model, block_size: int, max_batch: int, max_blocks: int):
        device = model.embed.weight.device
        if device.type != "cuda":
            raise ValueError(f"cuda_graphs needs the model on a CUDA device, not {device}")
        if not hasattr(model, "decode_step"):
            raise ValueError(f"cuda_graphs needs planned decode, which {type(model).__name__} does not have")
        if not _device_experts(model):
            raise ValueError("cuda_graphs needs the routed experts summed on the device (device_experts on): "
                             "the host path reads the chosen experts back every layer")
        self.model, self.block_size = model, block_size
        self.max_batch, self.max_blocks = bucket(max_batch), bucket(max_blocks)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.mempool = torch.cuda.graph_pool_handle()
        self.failed: str | None = None         # a capture failed: graphs off for this engine, said once

    def logits(self, chunks: list[torch.Tensor], states: list) -> torch.Tensor | None:
        """The step's logits [len(chunks), vocab] by replaying its bucket's graph (states advanced),
        or None when it is not a step the graphs take (the caller runs it as usual). The logits
        are a view of the graph's output buffer, which the next replay (of any graph: they share
        one pool) overwrites: read or copy them before the next step (the engine copies them to
        the host at once)."""
        if self.failed or any(len(ch) != 1 for ch in chunks) or len(chunks) > self.max_batch:
            return None
        if not _device_experts(self.model):      # another engine on this model turned them off since
            return None
        blocks = bucket(max(-(-(st.length + 1) // self.block_size) for st in states))
        if blocks > self.max_blocks:
            return None
        plan = self.model.plan_decode(chunks, states, bucket(len(chunks)), blocks)
        if plan is None:
            return None
        tokens = checked_tokens(self.model.config, chunks, states, plan.batch)
        g = self.graphs.get((plan.batch, plan.blocks))
        if g is None:
            try:
                g = self._capture(plan)
            except Exception as e:      # a capture that fails once fails every time: run without graphs
                self.failed = f"{type(e).__name__}: {e}"
                log.warning("CUDA graph capture failed (%s): decode steps run without graphs", self.failed)
                torch.cuda.synchronize()
                return None
        if any(a is not b for got, had in zip(plan.lanes, g.lanes) for a, b in zip(got.values(), had.values())):
            raise RuntimeError("the pool's lanes are not the tensors the graph was captured on")
        if not _same(_stacks(self.model), g.stacks):   # another engine restacked the experts (layout,
            self.graphs.clear()                        # cast): the graphs read the old stacks; capture anew
            return self.logits(chunks, states)
        g.inputs.copy_(plan.host, non_blocking=True)
        g.tokens.copy_(tokens, non_blocking=True)
        g.graph.replay()
        plan.commit()
        return g.logits[: len(chunks)]

    def _capture(self, plan) -> _Graph:
        device = self.model.embed.weight.device
        inputs = plan.null_host().to(device)
        tokens = torch.zeros((1, plan.batch), dtype=torch.long, device=device)

        def run():     # step_views inside: its flags (closes = values != 0) must be ops the graph replays
            return self.model.decode_step(tokens, step_views(inputs, plan.batch, plan.blocks, plan.ratios), plan.lanes)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):            # compiles, RoPE tables, cuBLAS workspaces: not in the graph
            for _ in range(2):
                run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # the outer stream context puts the caller's stream back even when the capture fails
        # (torch.cuda.graph leaves its capture stream current if capture_end raises); thread_local:
        # only this thread's unsafe calls break the capture, not other threads' (cache loads)
        with torch.cuda.stream(torch.cuda.current_stream(device)):
            with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
                logits = run()
        g = _Graph(graph, inputs, tokens, logits, plan.lanes, _stacks(self.model))
        self.graphs[(plan.batch, plan.blocks)] = g
        return g


def _stacks(model) -> tuple:
    """The experts' stack tensors every layer reads (a cast or move replaces them, even inside the
    same StackedExperts)."""
    return tuple(t for layer in model.layers
                 for t in (layer.ffn.stacked.w1s, layer.ffn.stacked.w3s, layer.ffn.stacked.w2s))


def _same(now: tuple, captured: tuple) -> bool:
    """Whether these are the very tensors a graph was captured on (identity, not equal values)."""
    return len(now) == len(captured) and all(a is b for a, b in zip(now, captured))


def _device_experts(model) -> bool:
    """Whether every layer's routed experts are summed on the device (no read-back of their ids)."""
    return all(layer.ffn.stacked is not None and layer.ffn.stacked.on_device for layer in model.layers)
