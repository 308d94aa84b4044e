"""Overlapped steps (asynchronous scheduling): the next step is planned on a helper thread while
this step's forward runs, with placeholders for the tokens the forward has not sampled yet.

    engine thread   settle N ─ prepare N ─ [──────── forward N ────────] ─ sample N ─ outputs N ─ settle N+1 ...
    plan thread                           └ schedule N+1 (ahead of N) ┘

Every tensor op stays on the engine's own thread: the plan thread runs only the scheduler's
bookkeeping (queues, the pool's free lists, the KV pool's free slots and the prefix cache's
per-request flags of requests it preempts, token lists), which the forward never reads. Blocks
the plan takes for a request in the forward wait in its chunk until `settle` (the forward reads
the request's block table). Sampling runs after the forward as without overlap: every draw is
the same, so outputs are too. Two threads running torch ops would cost more than the plan
saves: OpenMP gives each thread its own team of workers, and once more threads exist than
cores, every team's workers sleep between parallel regions instead of spinning, so each op pays
a wake-up (v4-small decode at batch 8 ran 2x slower with the forward on a second thread).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from kvcache.engine.scheduler import SchedulerOutput


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
        if self.pending:
            raise RuntimeError("a plan is already pending: take or discard it first")
        self._future = self._thread.submit(self._plan_after, running)

    def _plan_after(self, running):
        out = SchedulerOutput()
        try:
            return self.scheduler.schedule(running, drafts=False, out=out)
        except BaseException:
            self.scheduler.discard(out)               # what it had set aside goes back
            raise

    def wait(self) -> None:
        """Until the plan is made (an error in it stays for `finish`)."""
        if self._future is not None:
            self._future.exception()

    def finish(self) -> None:
        """After the forward: the plan made, or the planner's error raised (its blocks given back)."""
        future, self._future = self._future, None
        if future is not None:
            self._plan = future.result()

    def take(self):
        """The plan made ahead (then `scheduler.settle` it), or None."""
        plan, self._plan = self._plan, None
        return plan

    def discard(self) -> None:
        """Drop a plan that will not run, giving back the blocks it set aside (a planner error
        is dropped with it: its own blocks went back when it raised)."""
        future, self._future = self._future, None
        if future is not None and future.exception() is None:
            self._plan = future.result()
        plan = self.take()
        if plan is not None:
            self.scheduler.discard(plan)

    def close(self) -> None:
        self.discard()
        self._thread.shutdown(wait=True)
