"""Overlapped steps (asynchronous scheduling): the next step is planned on a helper thread while
this step's forward runs, with placeholders for the tokens the forward has not sampled yet.

    engine thread   settle N ─ prepare N ─ [──────── forward N ────────] ─ sample N ─ outputs N ─ settle N+1 ...
    plan thread                           └ schedule N+1 (ahead of N) ┘

Every tensor op stays on the engine's own thread: the plan thread runs only the scheduler's
bookkeeping (queues, the pool's free lists, token lists), which the forward never reads. Blocks
the plan takes for a request in the forward wait in its chunk until `settle` (the forward reads
the request's block table). Sampling runs after the forward as without overlap: every draw is
the same, so outputs are too. Two threads running torch ops would cost more than the plan
saves: OpenMP gives each thread its own team of workers, and once more threads exist than
cores, every team's workers sleep between parallel regions instead of spinning, so each op pays
a wake-up (v4-small decode at batch 8 ran 2x slower with the forward on a second thread).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor


class PlanAhead:
    """The plan for the next step, made while the current one's forward runs."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcache-plan")
        self._future: Future | None = None
        self._plan = None

    @property
    def pending(self) -> bool:
        return self._future is not None or self._plan is not None

    def start(self, running) -> None:
        """Plan the step after `running` (a SchedulerOutput whose forward is about to run)."""
        self._future = self._thread.submit(self.scheduler.schedule, running, False)

    def finish(self) -> None:
        """Wait for the plan (after the forward): an error in planning raises here."""
        future, self._future = self._future, None
        if future is not None:
            self._plan = future.result()

    def take(self):
        """The plan made ahead (then `scheduler.settle` it), or None."""
        plan, self._plan = self._plan, None
        return plan

    def discard(self) -> None:
        """Drop a plan that will not run, giving back the blocks it set aside."""
        self.finish()
        plan = self.take()
        if plan is not None:
            self.scheduler.discard(plan)

    def close(self) -> None:
        self.discard()
        self._thread.shutdown(wait=True)
