"""The asynchronous engine the API server uses: submit a prompt, stream its tokens, abort it.

    async with AsyncEngine(llm_engine) as engine:
        async for out in engine.generate(prompt, SamplingParams(max_tokens=64)):
            print(out.new_tokens, out.finished)

One background thread owns the LLMEngine: it runs `step()` while any request is in flight, and
each step's outputs go to their requests' asyncio queues through the event loop
(call_soon_threadsafe). The event loop never waits for a step: a submission or an abort is a
message to that thread (a thread-safe inbox it empties at the top of each iteration, before the
step), so while a long step runs the other streams' writes and health checks carry on, and an
abort sent during a step takes effect after it. A request is validated on the event loop before
it is sent (`LLMEngine.new_request` reads only the engine's configuration), so its errors raise
in `generate`; a request id the engine already holds is refused by the thread, and that error
comes back through the request's queue. Cancelling the consumer of `generate` aborts the request
and frees its blocks (once the thread reads that message). A step that raises (not one request's
failure: those fail alone inside the step) fails every request in flight with its error, not
those still in the inbox; the thread goes on serving new ones.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

from kvcache.engine.llm_engine import LLMEngine, StepOutput
from kvcache.engine.request import Request
from kvcache.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5      # how long an idle thread sleeps on its inbox before looking at the engine again


@dataclass
class _Consumer:
    """Where one request's outputs go: its `generate`'s queue, on that generator's loop."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request: Request


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._consumers: dict[str, _Consumer] = {}     # read by the thread, changed on the loop only
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvcache-engine", daemon=True)
        self._thread.start()

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the thread once it has read every message sent before (the last aborts and forgets)."""
        self._stop = True
        self._inbox.put(lambda: None)                  # wake an idle thread
        self._thread.join(timeout=30)

    async def generate(self, prompt, params: SamplingParams, priority: int = 0, request_id: str = "",
                       cache_salt: str = "", cache_points=()):
        """Yield a StepOutput each time the request gets tokens, until it is done. With n > 1 the
        outputs of all its samples come here (`out.request.stream` says which); it is done when
        every sample has finished. Validation errors raise here, before anything runs.
        `cache_salt` and `cache_points` are LLMEngine.add_request's."""
        req = self.engine.new_request(prompt, params, priority, request_id, cache_salt, cache_points)
        if req.request_id in self._consumers:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        outs: asyncio.Queue = asyncio.Queue()
        self._consumers[req.request_id] = _Consumer(asyncio.get_running_loop(), outs, req)
        self._send(lambda: self._admit(req))
        ended: set[str] = set()
        try:
            while True:
                out = await outs.get()
                if isinstance(out, Exception):         # the thread refused it (its id is in use)
                    raise out
                yield out
                if out.finished:
                    ended.add(out.request.request_id)
                    # every sample: n once the parent has forked (at its first token), else itself
                    if req.finished and len(ended) == (req.params.n if req.metrics.first_token is not None else 1):
                        return
        finally:
            self._consumers.pop(req.request_id, None)
            self._send(lambda: self._drop(req))    # the consumer went away: free what is left

    def abort(self, request_id: str) -> None:
        """Abort a request (a parent: with its samples) after the step running now; its consumer
        gets a final output for each."""
        self._send(lambda: self._abort(request_id))

    # ------------------------------------------------------------ the engine thread
    def _send(self, message: Callable[[], None]) -> None:
        self._inbox.put(message)

    def _admit(self, req: Request) -> None:
        try:
            self.engine.add(req)
        except Exception as e:                     # its consumer raises it, instead of waiting forever
            self._deliver_to(req, e)

    def _drop(self, req: Request) -> None:
        """Abort and forget `req`, if the engine still holds this very request (not a later one
        that reuses its id, nor one the engine refused)."""
        if self.engine.requests.get(req.request_id) is req:
            self.engine.abort(req.request_id)
            self.engine.forget(req.request_id)

    def _abort(self, request_id: str) -> None:
        live = [r for r in self.engine.family(request_id) if not r.finished]
        self.engine.abort(request_id)
        self._deliver([StepOutput(r, [], True) for r in live])

    def _deliver(self, outs: list[StepOutput]) -> None:
        """Each output to the queue of the request it belongs to (a sample's: its parent's)."""
        for out in outs:
            self._deliver_to(out.request.parent or out.request, out)

    def _deliver_to(self, root: Request, item) -> None:
        target = self._consumers.get(root.request_id)
        if target is not None and target.request is root:     # not a later request with the same id
            target.loop.call_soon_threadsafe(target.queue.put_nowait, item)

    def _read_inbox(self, wait_s: float = 0.0) -> None:
        """Run every message sent so far; with `wait_s`, wait that long for the first one."""
        try:
            message = self._inbox.get(timeout=wait_s) if wait_s else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                message()
            except Exception:                      # a bug in one message must not stop the engine
                log.exception("engine message failed")
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        while not self._stop:
            self._read_inbox()
            if not self.engine.has_work():
                self._read_inbox(wait_s=_IDLE_WAIT_S)
                continue
            try:
                outs = self.engine.step()
            except Exception as e:                 # not one request's fault (those fail alone inside step)
                log.exception("engine step failed; failing every request in flight")
                outs = self._fail_all(f"{type(e).__name__}: {e}")
            self._deliver(outs)
        self._read_inbox()                         # what was sent before close: the last aborts and forgets

    def _fail_all(self, error: str) -> list[StepOutput]:
        """Finish every unfinished request with this error, so no consumer waits forever on a
        step that cannot run."""
        return self.engine.fail_all(error)
