"""The asynchronous engine the API server uses: submit a prompt, stream its tokens, abort it.

    async with AsyncEngine(llm_engine) as engine:
        async for out in engine.generate(prompt, SamplingParams(max_tokens=64)):
            print(out.new_tokens, out.finished)

One background thread runs `LLMEngine.step()` while any request is in flight; each step's outputs
go to their requests' asyncio queues through the event loop (call_soon_threadsafe). Engine calls
(add, abort, step) are serialised by one lock, so submitting never races a step. Cancelling the
consumer of `generate` aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import threading

from kvcache.engine.llm_engine import LLMEngine, StepOutput
from kvcache.engine.sampling import SamplingParams


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

    async def generate(self, prompt, params: SamplingParams, priority: int = 0, request_id: str = ""):
        """Yield a StepOutput each time the request gets tokens; the last has finished=True.
        Validation errors raise here, before anything runs."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        with self._lock:
            req = self.engine.add_request(prompt, params, priority, request_id)
            self._queues[req.request_id] = (loop, queue)
        self._wake.set()
        try:
            while True:
                out: StepOutput = await queue.get()
                yield out
                if out.finished:
                    return
        finally:
            self._queues.pop(req.request_id, None)
            if not req.finished:               # the consumer went away: free the request now
                self.abort(req.request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort(request_id)

    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                busy = self.engine.has_work()
                outs = self.engine.step() if busy else []
            for out in outs:
                target = self._queues.get(out.request.request_id)
                if target is not None:
                    target[0].call_soon_threadsafe(target[1].put_nowait, out)
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
