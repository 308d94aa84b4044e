"""The asynchronous engine the API server uses: submit a prompt, stream its tokens, abort it.

    async with AsyncEngine(llm_engine) as engine:
        async for out in engine.generate(prompt, SamplingParams(max_tokens=64)):
            print(out.new_tokens, out.finished)

One background thread runs `LLMEngine.step()` while any request is in flight; each step's outputs
go to their requests' asyncio queues through the event loop (call_soon_threadsafe). Engine calls
(add, abort, step) are serialised by one lock, so submitting never races a step. Cancelling the
consumer of `generate` aborts the request and frees its blocks. A step that raises (not one
request's failure: those fail alone inside the step) fails every request in flight with its
error; the thread goes on serving new ones.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from kvcache.engine.llm_engine import LLMEngine, StepOutput
from kvcache.engine.request import FinishReason
from kvcache.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvcache-engine", daemon=True)
        self._thread.start()

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    async def generate(self, prompt, params: SamplingParams, priority: int = 0, request_id: str = "",
                       cache_salt: str = "", cache_points=()):
        """Yield a StepOutput each time the request gets tokens, until it is done. With n > 1 the
        outputs of all its samples come here (`out.request.stream` says which); it is done when
        every sample has finished. Validation errors raise here, before anything runs.
        `cache_salt` and `cache_points` are LLMEngine.add_request's."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        with self._lock:
            req = self.engine.add_request(prompt, params, priority, request_id, cache_salt, cache_points)
            self._queues[req.request_id] = (loop, queue)
        self._wake.set()
        ended: set[str] = set()
        try:
            while True:
                out: StepOutput = await queue.get()
                yield out
                if out.finished:
                    ended.add(out.request.request_id)
                    # every sample: n once the parent has forked (at its first token), else itself
                    if req.finished and len(ended) == (req.params.n if req.metrics.first_token is not None else 1):
                        return
        finally:
            self._queues.pop(req.request_id, None)
            with self._lock:
                self.engine.abort(req.request_id)    # the consumer went away: free what is left now
                self.engine.forget(req.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (a parent: with its samples); its consumer gets a final output for each."""
        with self._lock:
            live = [r for r in self.engine.family(request_id) if not r.finished]
            self.engine.abort(request_id)
        self._deliver([StepOutput(r, [], True) for r in live])

    def _deliver(self, outs: list[StepOutput]) -> None:
        """Each output to the queue of the request it belongs to (a sample's: its parent's)."""
        for out in outs:
            root = out.request.parent or out.request
            target = self._queues.get(root.request_id)
            if target is not None:
                target[0].call_soon_threadsafe(target[1].put_nowait, out)

    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                busy = self.engine.has_work()
                try:
                    outs = self.engine.step() if busy else []
                except Exception as e:             # not one request's fault (those fail alone inside
                    log.exception("engine step failed; failing every request in flight")   # step)
                    outs = self._fail_all(f"{type(e).__name__}: {e}")
            self._deliver(outs)
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _fail_all(self, error: str) -> list[StepOutput]:
        """Finish every unfinished request with this error (their blocks freed), one final output
        each, so no consumer waits forever on a step that cannot run."""
        live = [r for r in self.engine.requests.values() if not r.finished]
        for r in live:
            self.engine.scheduler.abort(r, FinishReason.ERROR, error=error)
        return [StepOutput(r, [], True) for r in live]
