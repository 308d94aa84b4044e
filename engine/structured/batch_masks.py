"""One step's token masks, filled on the host while the forward pass runs.

    step:  schedule ─┬─ BatchMasks.start(chunks) ── worker thread: compiler.fill_batch (native,
                     │                               parallel, GIL released) ─┐
                     └─ model.step(chunks)  (the forward pass) ───────────────┤
                                                                              v
           sample: StepMasks.apply(row, logits) waits for the fill, -inf where the grammar forbids

Only sampling chunks of requests whose constraint is active get a row filled; the others' rows
stay all-allowed and are never applied. A row that allows nothing (the matcher failed) is that
request's error, reported by `apply`, never a token drawn from nothing.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvcache.engine.structured import masks


class StepMasks:
    def __init__(self, future: Future, mask: np.ndarray, rows: dict, vocab_size: int):
        self._future, self.mask, self.rows, self.vocab_size = future, mask, rows, vocab_size

    def apply(self, row: int, logits: torch.Tensor) -> str | None:
        """Mask `logits` (chunk `row`'s, [V], in place); the reason when its matcher failed (a
        failed matcher's mask allows EOS alone: checked by its error, not by the bits)."""
        matcher = self.rows.get(row)
        if matcher is None:
            return None
        try:
            self._future.result()
        except Exception as e:              # the fill itself raised: these rows fail, not the step
            return f"the output's constraint could not be applied: {type(e).__name__}: {str(e)[:200]}"
        problem = matcher.error()
        if problem or not self.mask[row].any():
            return f"the output's constraint failed: {problem or 'no token is allowed'}"
        masks.apply(logits, self.mask[row])
        return None


class BatchMasks:
    def __init__(self, compiler, vocab_size: int):
        self.compiler, self.vocab_size = compiler, vocab_size
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self.fill_s = 0.0                 # time the worker spent filling (for the benchmark)

    def start(self, chunks) -> StepMasks | None:
        """Start filling the rows of `chunks` (a step's, in order) that sample under a constraint."""
        rows = [(ch.request.guide.matcher, i) for i, ch in enumerate(chunks)
                if ch.samples and ch.request.guide is not None and ch.request.guide.active]
        if not rows:
            return None
        mask = masks.allocate(len(chunks), self.vocab_size)
        # one worker thread, in step order: a matcher is never filled twice at once, and the engine
        # thread touches one only after its step's fill is done (StepMasks.apply waits for it)
        return StepMasks(self._worker.submit(self._fill, rows, mask), mask, {i: m for m, i in rows}, self.vocab_size)

    def _fill(self, rows, mask) -> None:
        t = time.perf_counter()
        self.compiler.fill_batch(rows, mask)
        self.fill_s += time.perf_counter() - t

    def close(self) -> None:
        self._worker.shutdown(wait=False)
